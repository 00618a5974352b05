"""`adstream demo`: the whole loop on the local stack, each room run by its own real command.

History → offline base model → worker + online trainer + ad server as processes → simulated
users ask for ads and click (closed loop) → events flow to ClickHouse and Redis, labels to the
trainer, LoRA deltas back into the serving replicas. At the end it reports what each part did.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

import httpx

from schemas.clients import clickhouse_args, redis_args
from schemas.errors import StackError
from schemas.settings import Settings

CLI = [sys.executable, "-m", "deploy.cli"]


@dataclass(frozen=True)
class DemoSpec:
    """How big the demo's market is and how long its closed loop runs."""

    users: int = 400
    ads: int = 300
    history: int = 20_000
    requests: int = 600
    rate: float = 20.0
    seed: int = 7
    port: int = 8011
    label_window_s: float = 2.0


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class Demo:
    """Runs the steps, keeps the child processes, and always stops them."""

    def __init__(self, spec: DemoSpec, settings: Settings, say: Callable[[str], None]) -> None:
        self.spec = spec
        self.say = say
        run_id = time.strftime("%Y%m%d%H%M%S")
        self.dir = (settings.state_dir / "demo" / run_id).resolve()
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        # each run its own topics, Redis keys and ClickHouse database, so its figures are its own
        clickhouse_url = urlunparse(urlparse(settings.clickhouse_url)._replace(path=f"/demo_{run_id}"))
        self.env = dict(os.environ)
        self.env.update(
            ADSTREAM_CLICKHOUSE_URL=clickhouse_url,
            ADSTREAM_TOPIC_PREFIX=f"demo{run_id}.",
            ADSTREAM_REDIS_PREFIX=f"adstream-demo:{run_id}:",
            ADSTREAM_MODEL_DIR=str(self.dir / "models"),
            ADSTREAM_HTTP_PORT=str(spec.port),
            ADSTREAM_STATE_DIR=str(settings.state_dir.resolve()),
            # a demo lasts a minute of simulated time, not hours: close label windows after a few
            # seconds and train in small micro-batches so deltas reach the server while it runs
            ADSTREAM_ATTRIBUTION_WINDOW_S=str(spec.label_window_s),
            ADSTREAM_MICRO_BATCH="64",
            ADSTREAM_SNAPSHOT_EVERY_S="5",
        )
        self.settings = Settings(
            topic_prefix=self.env["ADSTREAM_TOPIC_PREFIX"],
            redis_prefix=self.env["ADSTREAM_REDIS_PREFIX"],
            model_dir=self.dir / "models",
            http_port=spec.port,
            state_dir=settings.state_dir,
            kafka_bootstrap=settings.kafka_bootstrap,
            redis_url=settings.redis_url,
            clickhouse_url=clickhouse_url,
        )
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def run(self, name: str, *args: str, timeout: float = 600) -> str:
        """Run one adstream command to completion; its output is kept in logs/<name>.log."""
        log = self.dir / "logs" / f"{name}.log"
        self.say(f"$ adstream {' '.join(args)}")
        t0 = time.monotonic()
        with log.open("wb") as out:
            proc = subprocess.run(
                [*CLI, *args], env=self.env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            )
        if proc.returncode != 0:
            raise StackError(
                f"`adstream {' '.join(args)}` failed ({proc.returncode}); see {log}:\n{_tail(log)}"
            )
        self.say(f"  done in {time.monotonic() - t0:.1f}s")
        return log.read_text(errors="replace")

    def start(self, name: str, *args: str) -> None:
        log = self.dir / "logs" / f"{name}.log"
        self.say(f"$ adstream {' '.join(args)} &   (log: {log})")
        with log.open("wb") as out:
            self.children[name] = subprocess.Popen(
                [*CLI, *args], env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def check_children(self) -> None:
        for name, proc in self.children.items():
            if proc.poll() is not None:
                log = self.dir / "logs" / f"{name}.log"
                raise StackError(f"{name} exited with {proc.returncode}; see {log}:\n{_tail(log)}")

    def stop_children(self) -> None:
        for name, proc in reversed(list(self.children.items())):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            self.say(f"stopped {name}")

    def wait_http(self, url: str, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_children()
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise StackError(f"{url} did not answer within {timeout_s:.0f}s")


@contextmanager
def running(demo: Demo) -> Iterator[Demo]:
    try:
        yield demo
    finally:
        demo.stop_children()


def market_args(spec: DemoSpec) -> list[str]:
    return ["--users", str(spec.users), "--ads", str(spec.ads), "--seed", str(spec.seed)]


def split_catalog(history: Path, catalog: Path) -> int:
    """Copy the AdCreative lines of an event file into a catalog file; return how many."""
    n = 0
    with history.open("rb") as src, catalog.open("wb") as dst:
        for line in src:
            if b'"kind":"ad"' in line:
                dst.write(line)
                n += 1
    return n


def run_demo(spec: DemoSpec, settings: Settings, say: Callable[[str], None]) -> dict[str, Any]:
    """The whole loop; returns the figures it reports."""
    from deploy.stack import create_topics

    demo = Demo(spec, settings, say)
    s = demo.settings
    create_topics(s)
    history, catalog = demo.dir / "history.jsonl", demo.dir / "catalog.jsonl"
    say("1. a day of history from the simulated market, to train the base model offline")
    demo.run(
        "simulate", "simulate", *market_args(spec), "--impressions", str(spec.history), "--out", str(history)
    )
    n_ads = split_catalog(history, catalog)
    demo.run(
        "train", "train", "--events", str(history), "--epochs", "3", "--json", str(demo.dir / "train.json")
    )
    demo.run("catalog", "produce", "ad.catalog", str(catalog))
    say(f"   catalog of {n_ads} ads published to {s.topic_prefix}ad.catalog")

    with running(demo):
        say("2. the loop's processes: streams worker, online LoRA trainer, Ray Serve ad server")
        demo.start("worker", "worker", "--loglevel", "warn")
        demo.start("trainer", "trainer")
        demo.start("serve", "serve", "--catalog", str(catalog), "--port", str(spec.port))
        url = f"http://{s.http_host}:{spec.port}"
        demo.wait_http(f"{url}/healthz")
        say(f"   serving at {url} (OpenAPI at {url}/docs)")
        adapters_before = httpx.get(f"{url}/v1/adapters", timeout=5).json()

        say("3. closed loop: simulated users ask for ads, click, dwell and convert")
        out = demo.run(
            "closed-loop",
            "closed-loop",
            "--url",
            url,
            *market_args(spec),
            "--requests",
            str(spec.requests),
            "--rate",
            str(spec.rate),
            "--kafka",
        )
        say("   " + "\n   ".join(line for line in out.splitlines()[-12:] if line.strip()))
        say("4. letting the worker close label windows and the trainer publish deltas")
        time.sleep(10)
        demo.check_children()
        adapters_after = httpx.get(f"{url}/v1/adapters", timeout=5).json()
        metrics = httpx.get(f"{url}/metrics", timeout=5).text

    report = {
        "dir": str(demo.dir),
        "adapters_before": adapters_before,
        "adapters_after": adapters_after,
        "clickhouse": clickhouse_counts(s),
        "redis_users": redis_user_count(s),
        "serving_metrics": {
            line.split(" ")[0]: line.split(" ")[-1]
            for line in metrics.splitlines()
            if line.startswith("adstream_serving_") and not any(x in line for x in ("_bucket", "_created"))
        },
    }
    (demo.dir / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


def clickhouse_counts(settings: Settings) -> dict[str, int]:
    """Rows per raw event table (FINAL: duplicates collapsed)."""
    from clickhouse_driver import Client

    from deploy.endpoints import clickhouse_database

    db = clickhouse_database(settings.clickhouse_url)
    client = Client(**clickhouse_args(settings, db))
    counts = {}
    try:
        for table in ("impressions", "clicks", "dwell", "conversions"):
            try:
                counts[table] = int(client.execute(f"SELECT count() FROM {table} FINAL")[0][0])
            except Exception:  # table missing: the worker did not migrate (reported as -1)
                counts[table] = -1
    finally:
        client.disconnect()
    return counts


def redis_user_count(settings: Settings) -> int:
    import redis

    client = redis.Redis.from_url(**redis_args(settings))
    try:
        return sum(1 for _ in client.scan_iter(match=f"{settings.redis_prefix}*", count=1000))
    finally:
        client.close()
