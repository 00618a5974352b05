"""The closed loop against services started from the deployment files, and what it must show:
deltas reach serving, events reach ClickHouse, the dashboard answers. Shared by the compose and
the k8s runs."""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse, urlunparse

from schemas.settings import Settings
from tests.integration.deploy.harness import LocalRun, get, metric, resolve, wait_for

USERS, ADS, SEED = 150, 120, 5


def secrets_env() -> dict[str, str]:
    """What an operator's .env / secrets.env holds: every required token and key, fresh."""
    keys = ("ADSTREAM_REDIS__PASSWORD", "ADSTREAM_SERVING__ADMIN_TOKEN", "ADSTREAM_DELTA_SIGNING_KEY",
            "ADSTREAM_EVENT_SIGNING_KEY", "RAY_AUTH_TOKEN", "GRAFANA_ADMIN_PASSWORD")  # fmt: skip
    return {k: secrets.token_urlsafe(40) for k in keys}


@dataclass
class Isolation:
    """The run's own topics, Redis keys, ClickHouse database and models folder."""

    run_id: str
    clickhouse_url: str
    tmp: Path

    @classmethod
    def make(cls, stack: Settings, tag: str, tmp: Path) -> Isolation:
        run_id = f"{tag}{uuid.uuid4().hex[:6]}"
        url = urlunparse(urlparse(stack.clickhouse.url)._replace(path=f"/{run_id}"))
        return cls(run_id, url, tmp)

    def overrides(self) -> dict[str, str]:
        return {
            "ADSTREAM_TOPIC_PREFIX": f"{self.run_id}.",
            "ADSTREAM_REDIS_PREFIX": f"adstream-{self.run_id}:",
            "ADSTREAM_MODEL_DIR": str(self.tmp / "models"),
            "ADSTREAM_STATE_DIR": str(self.tmp / "state"),
        }

    def settings(self, stack: Settings) -> Settings:
        return Settings(
            topic_prefix=f"{self.run_id}.",
            redis_prefix=f"adstream-{self.run_id}:",
            kafka={"bootstrap": stack.kafka.bootstrap},
            redis={"url": stack.redis.url},
            clickhouse={"url": self.clickhouse_url},
            model_dir=self.tmp / "models",
        )

    def clean(self, stack: Settings) -> None:
        from clickhouse_driver import Client

        from deploy.stack import delete_topics_async
        from schemas.clients import clickhouse_args, clickhouse_database

        s = self.settings(stack)
        try:
            asyncio.run(delete_topics_async(s))
        except Exception:  # best effort: the broker keeps topics in memory only
            pass
        admin = Client(**clickhouse_args(s))
        admin.execute(f"DROP DATABASE IF EXISTS {clickhouse_database(s)}")
        admin.disconnect()
        import redis

        rc = redis.Redis.from_url(stack.redis.url)
        keys = list(rc.scan_iter(match=f"adstream-{self.run_id}:*", count=1000))
        if keys:
            rc.delete(*keys)
        rc.close()


def counts(settings: Settings) -> dict[str, int]:
    from schemas.clients import clickhouse_client, clickhouse_database

    client = clickhouse_client(settings, clickhouse_database(settings))
    try:
        return {t: int(client.execute(f"SELECT count() FROM {t}")[0][0]) for t in ("impressions", "clicks")}
    finally:
        client.disconnect()


def run_cli(run: LocalRun, name: str, argv: list[str], env: dict[str, str], timeout_s: float = 300) -> str:
    log = run.tmp / "logs" / f"{name}.log"
    run.say(f"run {name}: {' '.join(argv)}")
    out = subprocess.run(
        resolve(argv), env=env, capture_output=True, text=True, timeout=timeout_s, cwd=run.tmp
    )
    log.write_text(out.stdout + out.stderr)
    assert out.returncode == 0, f"{' '.join(argv)} → {out.returncode}:\n{(out.stdout + out.stderr)[-2000:]}"
    return out.stdout


def replica_urls(ports: range) -> list[str]:
    urls = []
    for port in ports:
        try:
            body = get(f"http://127.0.0.1:{port}/healthz", timeout=2).json()
        except Exception:  # no replica on this port
            continue
        if isinstance(body, dict) and "model_version" in body:
            urls.append(f"http://127.0.0.1:{port}")
    return urls


@dataclass
class LoopResult:
    before: dict[str, int]
    after: dict[str, int]
    applied: float
    served: float
    dashboard_status: int
    replicas: list[str]


def closed_loop(
    run: LocalRun, env: dict[str, str], settings: Settings, proxy: str, replica_ports: range, dashboard: str
) -> LoopResult:
    """Catalog in through Kafka, simulated users against the balancer, their events back through
    Kafka; then wait for ClickHouse rows, applied deltas in a replica, and the dashboard."""
    hist = run.tmp / "market.jsonl"
    market = ["--users", str(USERS), "--ads", str(ADS), "--seed", str(SEED)]
    sim = ["adstream", "simulate", *market, "--impressions", "400", "--drift-at", "0", "--new-ads", "0"]
    run_cli(run, "simulate", [*sim, "--out", str(hist)], env)
    catalog = run.tmp / "catalog.jsonl"
    catalog.write_text("".join(line for line in hist.open() if json.loads(line).get("kind") == "ad"))
    run_cli(run, "produce-catalog", ["adstream", "produce", "ad.catalog", str(catalog)], env)
    replicas = wait_for("replicas on their direct ports", lambda: replica_urls(replica_ports), 120)
    wait_for(
        "the catalog in every replica",
        lambda: all(
            metric(get(f"{u}/metrics").text, "adstream_serving_catalog_ads") >= ADS for u in replicas
        ),
        120,
    )
    before = counts(settings)
    loop = ["adstream", "closed-loop", "--url", proxy, "--requests", "400", "--rate", "20", *market]
    run_cli(run, "closed-loop", [*loop, "--kafka"], env, 400)

    def grown() -> dict[str, int] | None:
        now = counts(settings)
        return (
            now if now["impressions"] > before["impressions"] and now["clicks"] > before["clicks"] else None
        )

    after = wait_for("events in ClickHouse", grown, 180)

    def applied() -> float:
        return sum(
            metric(get(f"{u}/metrics").text, "adstream_serving_deltas_total", outcome="applied")
            for u in replicas
        )

    n_applied = wait_for("deltas applied in a replica", applied, 240, every_s=5)
    served = sum(
        metric(get(f"{u}/metrics").text, "adstream_serving_requests_total", status="200") for u in replicas
    )
    status = get(dashboard, timeout=30).status_code
    return LoopResult(before, after, n_applied, served, status, replicas)
