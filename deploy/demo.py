"""`adstream demo`: the whole loop on the local stack, each room run by its own real command.

History → offline base model → worker + online trainer + ad server as processes → simulated
users ask for ads and click (closed loop) → events flow to ClickHouse and Redis, labels to the
trainer, LoRA deltas back into the serving replicas. At the end it reports what each part did.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

import httpx
import numpy as np

from deploy.machine import describe, process_cpu_s
from schemas.clients import clickhouse_client, clickhouse_database, redis_args
from schemas.errors import StackError
from schemas.settings import Settings

CLI = [sys.executable, "-m", "deploy.cli"]
DEMO_CANARY_SHARE = "1.0"  # the loop's canary share (`Demo`): every user on the live adapters


@dataclass(frozen=True)
class DemoSpec:
    """How big the demo's market is and how long its closed loop runs (the defaults finish in
    about 6 minutes on a 2-core machine)."""

    users: int = 400
    ads: int = 300
    history: int = 20_000
    requests: int = 6_000
    rate: float = 30.0
    seed: int = 7
    port: int = 8011
    dashboard_port: int = 8050
    drift_mode: str = "handover"
    drift_share: float = 0.5
    warm_state: bool = True  # produce the history to Kafka so users are served with their state
    # the share of the market's campaigns that pay per thousand shown impressions (CPM), the rest
    # per click (`MarketConfig.cpm_share`); 0 here, so the benchmarks built on the demo (soak,
    # freshness, live loop) keep the markets of their earlier runs; `adstream demo` sets 0.2
    cpm_share: float = 0.0


def free_port() -> int:
    """A TCP port nothing listens on now (for the demo's own metrics servers)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
        clickhouse_url = urlunparse(urlparse(settings.clickhouse.url)._replace(path=f"/demo_{run_id}"))
        self.env = dict(os.environ)
        self.worker_metrics_port, self.trainer_metrics_port = free_port(), free_port()
        self.env.update(
            ADSTREAM_CLICKHOUSE__URL=clickhouse_url,
            ADSTREAM_TOPIC_PREFIX=f"demo{run_id}.",
            ADSTREAM_REDIS_PREFIX=f"adstream-demo:{run_id}:",
            ADSTREAM_MODEL_DIR=str(self.dir / "models"),
            ADSTREAM_SERVING__HTTP_PORT=str(spec.port),
            ADSTREAM_STATE_DIR=str(settings.state_dir.resolve()),
            ADSTREAM_METRICS__PORT=str(self.worker_metrics_port),
            # admin routes refuse a default token: this run's own, never printed
            ADSTREAM_SERVING__ADMIN_TOKEN=secrets.token_urlsafe(24),
        )
        # every user on the canary's candidate arm, the live adapters (unless the caller's
        # environment says otherwise): at the default 5 % the canary decides only after 500
        # learning-arm impressions per arm, which a demo's traffic never gives its candidate, so
        # the stable arm (no promoted adapters) served the rest of the learning arm. The canary's
        # error-rate rollback still acts, and the trainer's paired guard resets a losing adapter.
        self.env.setdefault("ADSTREAM_CANARY__SHARE", DEMO_CANARY_SHARE)
        # the simulator scores each learning-arm slate and the one serving would have served
        # without adapters (`ab.shadow_slates`): the adapters' own lift on the same requests
        self.env.setdefault("ADSTREAM_AB__SHADOW_SLATES", "true")
        self.admin = {"Authorization": f"Bearer {self.env['ADSTREAM_SERVING__ADMIN_TOKEN']}"}
        self.settings = Settings(
            topic_prefix=self.env["ADSTREAM_TOPIC_PREFIX"],
            redis_prefix=self.env["ADSTREAM_REDIS_PREFIX"],
            model_dir=self.dir / "models",
            serving={"http_port": spec.port},
            state_dir=settings.state_dir,
            kafka={"bootstrap": settings.kafka.bootstrap},
            redis={"url": settings.redis.url},
            clickhouse={"url": clickhouse_url},
        )
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def run(self, name: str, *args: str, timeout: float = 600) -> str:
        """Run one adstream command to completion; its output is kept in logs/<name>.log."""
        log = self.dir / "logs" / f"{name}.log"
        self.say(f"$ adstream {' '.join(args)}")
        t0 = time.monotonic()
        with log.open("wb") as out:
            proc = subprocess.run(  # wide: its tables go into the report as they are
                [*CLI, *args],
                env={**self.env, "COLUMNS": "160"},
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
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

    def commands(self) -> set[str]:
        """The top-level commands of this `adstream` (a room may not ship some yet)."""
        import typer.main

        from deploy.cli import app

        return set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]

    def start_optional(self, name: str, *args: str) -> bool:
        """Start a command if this build has it (the dashboard); say so when it does not."""
        if args[0] not in self.commands():
            self.say(f"   ({name}: no `adstream {args[0]}` in this build)")
            return False
        self.start(name, *args)
        return True

    def run_optional(self, name: str, *args: str) -> str | None:
        """Run a command if this build has it; its output, or None (also when it fails)."""
        if args[0] not in self.commands():
            return None
        try:
            return self.run(name, *args, timeout=300)
        except (StackError, subprocess.TimeoutExpired) as exc:
            self.say(f"   ({name} failed: {str(exc).splitlines()[0]})")
            return None

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


def market_config(spec: DemoSpec, *, history: bool) -> Any:
    """The demo's market: the same world (seed) for history and closed loop. History has no
    drift and ends now, so the users' state the worker builds from it is current when the loop
    starts; the closed loop drifts half-way."""
    from workloads import MarketConfig

    if history:
        # expected ads per request ≈ 3 (slot shares × slot k): the history spans this many seconds
        span_s = spec.history / 3.0 / 100.0
        start = datetime.now(UTC) - timedelta(seconds=span_s + 5)
        return MarketConfig(seed=spec.seed, n_users=spec.users, n_ads=spec.ads, drift_at=None,
                            new_ads_at=None, n_new_ads=0, start=start, rate=100.0,
                            cpm_share=spec.cpm_share)  # fmt: skip
    return MarketConfig(seed=spec.seed, n_users=spec.users, n_ads=spec.ads, drift_at=0.5,
                        drift_mode=spec.drift_mode, drift_share=spec.drift_share,
                        new_ads_at=None, n_new_ads=0, cpm_share=spec.cpm_share)  # fmt: skip


def write_history(spec: DemoSpec, history: Path, catalog: Path) -> dict[str, Any]:
    """Simulate the history into a file (and the catalog into another, its campaigns, some with
    targeting, into `campaigns.jsonl` beside it); its ground truth."""
    from schemas.codec import encode
    from workloads import Market

    market = Market(market_config(spec, history=True))
    with history.open("wb") as out, catalog.open("wb") as cat:
        for m in market.open_loop(spec.history):
            line = encode(m) + b"\n"
            out.write(line)
            if m.kind == "ad":
                cat.write(line)
    entries = market.campaigns(include_new=True)
    campaigns_file(catalog).write_bytes(b"".join(encode(c) + b"\n" for c in entries))
    s = market.summary()
    return {"impressions": s.impressions, "clicks": s.clicks, "oracle_auc": s.oracle_auc, "users": spec.users}


def campaigns_file(catalog: Path) -> Path:
    """Where `write_history` puts the campaign entries of the catalog at `catalog`."""
    return catalog.with_name("campaigns.jsonl")


async def produce_file(settings: Settings, path: Path) -> int:
    """Produce every event of a file to its contract topic (the worker builds user state); the
    history's impressions signed and its clicks with their tokens, with the stack's event key."""
    from schemas.codec import decode_any
    from schemas.signing import event_key, seal
    from workloads.sinks import KafkaSink

    key = event_key(settings)
    n = 0
    async with KafkaSink(settings) as sink:
        batch = []
        with path.open("rb") as fh:
            for line in fh:
                batch.append(seal(decode_any(line), key))
                if len(batch) >= 2000:
                    await sink.send_many(batch)
                    n += len(batch)
                    batch = []
        if batch:
            await sink.send_many(batch)
            n += len(batch)
    return n


def wait_rows(settings: Settings, table: str, at_least: int, timeout_s: float, demo: Demo) -> int:
    """Wait until the worker has written `at_least` rows of `table` to ClickHouse."""
    deadline = time.monotonic() + timeout_s
    n = 0
    while time.monotonic() < deadline:
        demo.check_children()
        n = clickhouse_counts(settings).get(table, -1)
        if n >= at_least:
            break
        time.sleep(1)
    return n


async def closed_loop(spec: DemoSpec, demo: Demo, url: str, live: bool) -> tuple[Any, Any, Any]:
    """Run the closed loop against the ad server while `Watch` samples it each second."""
    import asyncio

    from rich.live import Live

    from deploy.demo_live import Watch
    from workloads import Market
    from workloads.closed_loop import ClosedLoopReport, run_closed_loop
    from workloads.sinks import KafkaSink

    market = Market(market_config(spec, history=False))
    report = ClosedLoopReport()
    watch = Watch(market, report, url, f"http://127.0.0.1:{demo.trainer_metrics_port}/metrics", demo.admin)
    async with KafkaSink(demo.settings) as sink, httpx.AsyncClient(timeout=5) as http:
        loop = asyncio.create_task(
            run_closed_loop(market, url, spec.requests, sink.send_many, rate=spec.rate, report=report)
        )
        with Live(watch.table(), refresh_per_second=2, transient=not live) as view:
            while not loop.done():
                await asyncio.sleep(1.0)
                demo.check_children()
                await watch.sample(http)
                view.update(watch.table())
            await loop
            # let the last labels reach the trainer and its deltas the replica
            for _ in range(8):
                await asyncio.sleep(1.0)
                await watch.sample(http)
                view.update(watch.table())
    return market, report, watch


@dataclass
class LoopRun:
    """What one run of the whole loop leaves: its folder, the simulated market (ground truth,
    clicks), the closed loop's record, the watcher's samples and the services' final answers."""

    demo: Demo
    spec: DemoSpec
    started: str
    train: dict[str, Any]
    truth: dict[str, Any]
    market: Any
    loop: Any
    watch: Any
    adapters_start: Any
    adapters_end: Any
    metrics: str
    attribution: str | None
    loop_s: float  # wall seconds of the closed loop
    cpu_s: dict[str, float]  # CPU seconds each process (itself, not its children) used during the loop

    @property
    def score_log(self) -> Path:
        """The trainer's progressive log (every example scored by online and frozen before learning)."""
        return self.demo.dir / "trainer_scores.json"


def run_loop(
    spec: DemoSpec,
    settings: Settings,
    say: Callable[[str], None],
    *,
    live: bool = True,
    env: dict[str, str] | None = None,
    extras: bool = True,
) -> LoopRun:
    """Train the base offline, start worker + trainer + ad server, drive the closed loop, stop them.

    `env`: extra settings for the loop's processes (`ADSTREAM_AB__CONTROL_SHARE=…`); `extras`: the
    dashboard and the attribution comparison too (a benchmark leaves them out)."""
    import asyncio
    import logging

    from deploy.stack import create_topics

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll would bury the view
    market_config(spec, history=False)  # a bad --drift-mode etc. fails now, not after training
    demo = Demo(spec, settings, say)
    demo.env.update(env or {})
    s = demo.settings
    create_topics(s)
    history, catalog = demo.dir / "history.jsonl", demo.dir / "catalog.jsonl"
    started = datetime.now(UTC).isoformat(timespec="seconds")
    say("1. history from the simulated market (no drift, ending now), to train the base model offline")
    truth = write_history(spec, history, catalog)
    demo.run(
        "train", "train", "--events", str(history), "--epochs", "3", "--json", str(demo.dir / "train.json")
    )
    train = json.loads((demo.dir / "train.json").read_text())
    demo.run("catalog", "produce", "ad.catalog", str(catalog))
    demo.run("campaigns", "produce", "ad.campaigns", str(campaigns_file(catalog)))

    with running(demo):
        say("2. the loop's processes: streams worker, online LoRA trainer, Ray Serve ad server, dashboard")
        demo.start("worker", "worker", "--loglevel", "warn")
        demo.start(
            "trainer", "trainer", "--metrics-port", str(demo.trainer_metrics_port),
            "--score-log", str(demo.dir / "trainer_scores.json"),
        )  # fmt: skip
        demo.start("serve", "serve", "--catalog", str(catalog), "--port", str(spec.port))
        dashboard = extras and demo.start_optional(
            "dashboard", "dashboard", "--port", str(spec.dashboard_port)
        )
        url = f"http://{s.serving.http_host}:{spec.port}"
        demo.wait_http(f"{url}/healthz")
        say(f"   serving at {url} (OpenAPI at {url}/docs)")
        adapters_start = httpx.get(f"{url}/v1/adapters", headers=demo.admin, timeout=5).json()
        if dashboard:
            say(f"   dashboard at http://127.0.0.1:{spec.dashboard_port}/")
        if spec.warm_state:
            say("3. the history goes through Kafka too, so the worker holds every user's current state")
            produced = asyncio.run(produce_file(s, history))
            got = wait_rows(s, "impressions", truth["impressions"], 180, demo)
            say(
                f"   {produced:,} events produced; "
                f"{got:,} of {truth['impressions']:,} impressions in ClickHouse"
            )
        else:
            say("3. (--cold: the history is not produced; users start with empty state)")
        say(
            f"4. closed loop: {spec.requests:,} requests at {spec.rate:g}/s, "
            f"`{spec.drift_mode}` drift half-way"
        )
        cpu0 = {name: process_cpu_s(proc.pid) for name, proc in demo.children.items()}
        t0 = time.monotonic()
        market, loop_report, watch = asyncio.run(closed_loop(spec, demo, url, live))
        loop_s = time.monotonic() - t0
        demo.check_children()
        cpu_s = {name: round(process_cpu_s(proc.pid) - cpu0[name], 1) for name, proc in demo.children.items()}
        adapters_end = httpx.get(f"{url}/v1/adapters", headers=demo.admin, timeout=5).json()
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        compare = (
            demo.run_optional("attribution", "attribution", "compare", "--by", "slot") if extras else None
        )
    return LoopRun(demo, spec, started, train, truth, market, loop_report, watch, adapters_start,
                   adapters_end, metrics, compare, loop_s, cpu_s)  # fmt: skip


def run_demo(
    spec: DemoSpec, settings: Settings, say: Callable[[str], None], *, live: bool = True
) -> dict[str, Any]:
    """The whole loop; returns the figures it reports (also written to the run's folder)."""
    from deploy.demo_live import QUALITY_SERIES, phase_means, write_report
    from deploy.live_figures import loop_figures

    run = run_loop(spec, settings, say, live=live)
    demo, s, train, truth = run.demo, run.demo.settings, run.train, run.truth
    lat = run.loop.latencies_ms
    summary = run.market.summary()
    quality = {k: phase_means(run.watch.samples, k) for k in QUALITY_SERIES}
    report: dict[str, Any] = {
        "dir": str(demo.dir),
        "started": run.started,
        "machine": describe(),
        "spec": asdict(spec),
        "offline": {
            "holdout_auc": train["ranker"]["auc"],
            "oracle_auc": truth["oracle_auc"],
            "history": truth,
        },
        "loop": {
            "requests": run.loop.requests,
            "served": run.loop.served,
            "errors": dict(run.loop.errors),
            "events": dict(run.loop.events),
            "p50_ms": float(np.percentile(lat, 50)) if lat else float("nan"),
            "p99_ms": float(np.percentile(lat, 99)) if lat else float("nan"),
            "oracle_auc_after_drift": summary.oracle_auc_after_drift,
            "frozen_truth_auc_after_drift": summary.frozen_auc_after_drift,
        },
        "quality": quality,
        "explanation": explain(train, truth, quality),
        "adapters_start": run.adapters_start,
        "adapters_after": run.adapters_end,
        "adapters_end": {a["adapter_id"]: a["version"] for a in run.adapters_end},
        "clickhouse": clickhouse_counts(s),
        "redis_users": redis_user_count(s),
        "attribution": run.attribution,
        "live": loop_figures(run),
        "serving_metrics": {
            line.split(" ")[0]: line.split(" ")[-1]
            for line in run.metrics.splitlines()
            if line.startswith("adstream_serving_") and not any(x in line for x in ("_bucket", "_created"))
        },
    }
    write_report(demo.dir, report, run.watch.samples)
    return report


def explain(train: dict[str, Any], truth: dict[str, Any], quality: dict[str, Any]) -> list[str]:
    """Why the served pCTR AUC is not the oracle's, from figures measured in this run."""
    served = quality["served_auc"]["before_drift"]
    oracle = quality["oracle_auc"]["before_drift"]
    population = quality["population_auc"]["before_drift"]
    return [
        f"Offline, the base ranker scores {train['ranker']['auc']:.3f} on the time-ordered holdout of the "
        f"history (random logging policy), where the oracle scores {truth['oracle_auc']:.3f}.",
        f"On served traffic before the drift: served pCTR {served:.3f}, oracle {oracle:.3f}, and an oracle "
        f"that knows every ad, slot and position effect but not the user's taste {population:.3f}. "
        f"The oracle's lead over that one ({oracle - population:+.3f}) is what knowing each user's tastes "
        "is worth; a model learns those only from the user's own few events (about "
        f"{truth['impressions'] / max(1, truth.get('users', 1)):.0f} impressions per user of history here), "
        "so the per-user Bayes ceiling, not the oracle, bounds the served AUC (benchmarks/offline_quality.py "
        "measures that ceiling).",
        f"Served minus the taste-blind oracle: {served - population:+.3f} "
        "(positive: the model ranks by what it learned of users, beyond ad/slot/position effects).",
    ]


def clickhouse_counts(settings: Settings) -> dict[str, int]:
    """Rows per raw event table (FINAL: duplicates collapsed)."""
    from clickhouse_driver.errors import ServerException

    client = clickhouse_client(settings, clickhouse_database(settings))
    counts = {}
    try:
        for table in ("impressions", "clicks", "dwell", "conversions"):
            try:
                counts[table] = int(client.execute(f"SELECT count() FROM {table} FINAL")[0][0])
            except ServerException:  # table missing: the worker did not migrate (reported as -1)
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
