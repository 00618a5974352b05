"""Streams benchmark: sustained events/s of both worker engines, next to the floors of their clients.

On the running local stack (broker, Redis, ClickHouse), in one run:

1. simulator events (`workloads.Market.open_loop`) are encoded and produced to the user-event
   topics of a fresh topic prefix (the catalog first);
2. floors, each reading every user-event record from the beginning and doing nothing with it:
   `aiokafka getmany` (a bare `getmany` loop: the ceiling any Python consumer of this broker has
   here, measured before each engine and at the end; the median is `raw`) and `faust agent` (a
   bare Faust agent iterating the records' events with acks on, in a child process: what Faust's
   per-record stream costs);
3. `core` (a ceiling, not a floor), once per round in a fresh child process: the worker's
   per-event core over the same records, without Kafka, Redis or ClickHouse (`core_floor`:
   judge, state + label join, row, example encoding), as events per CPU second with the µs of
   each stage (the median round): no engine built on this core can pass it on one core, so it
   says how far the goals are from the core itself;
4. `worker`: `adstream worker --engine faust|aiokafka` (a child process) processes the same
   records: validation, time-ordered merge, user state, label join, ClickHouse sink, Redis commit.
   The rate is measured from 5 % to 100 % applied (the offsets the worker commits to Redis), so
   start-up and catalog load are excluded; py-spy samples the worker meanwhile and the profile is
   summarised by package and by function (self time). The records dead-lettered meanwhile are
   counted: the events are all valid and signed with the key the worker checks, so none should be.
   Over the same window: the worker's own CPU seconds (`worker_cpu_share`: 1.0 is one core all
   the time, i.e. CPU-bound; `cpu_us_per_event`) and how busy the whole machine was
   (`machine_busy_share`: broker, Redis and ClickHouse share its cores).

5. `scale` (`--workers N`, default 2; 0 skips it): N workers of each engine in one consumer group
   (each takes its share of the partitions, `RangePartitionAssignor`) over the same events on
   topics of their own: the machine-level rate (applied records of all of them, 5 % → 100 %), the
   per-worker rate (that ÷ N) and its ratio to raw, the speed-up over the one worker of the same
   round, and each worker's CPU share (a worker near 0 got no partitions: the split failed).

Goals (issue 35; issue 15's were 0.15, stretch 0.25), as ratios of the same run: the Faust engine
≥ 0.8 × the aiokafka engine, each engine ≥ 0.3 × raw per worker, the core alone ≥ 0.5 × raw.

Usage: `.venv/bin/python -m benchmarks.streams [--events 100000] [--rounds 3] [--workers 2]
[--no-profile]`. Prints a table and writes `benchmarks/results/streams.json` (per engine
`events_per_s` and `ratio_to_raw`; `core.ratio_to_raw`; `scale.<engine>`: the N workers' machine
rate, `per_worker_ratio_to_raw`, `speedup_vs_one_worker`; the floors; the machine: CPU model,
cores, load).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.lib.args import int_at_least
from deploy.machine import machine, process_cpu_s, write_result
from deploy.stack import create_topics, delete_topics_async
from schemas import topics
from schemas.clients import clickhouse_client, clickhouse_database
from schemas.codec import decode, encode, key_of, model_for_topic, topic_of
from schemas.events import AdCreative
from schemas.settings import Settings
from schemas.signing import event_key
from workloads.config import MarketConfig
from workloads.market import Market

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "benchmarks" / "results" / "streams.json"
USER_TOPICS = (topics.IMPRESSIONS, topics.CLICKS, topics.DWELL, topics.CONVERSIONS)
GOAL_FAUST_VS_AIOKAFKA = 0.8
COMMITS_MEASURED = 4  # --events: at least this many worker commits (sink.batch_size records each)
STALL_S = 180.0  # a worker that has not applied 5 % by then is stuck (it takes ~20 s here)
GOAL_RATIO_TO_RAW = 0.3  # each engine, per worker (issue 35)
GOAL_CORE_TO_RAW = 0.5  # the worker core alone, no I/O (issue 35)


def generate(
    n: int, seed: int, s: Settings
) -> tuple[list[tuple[str, bytes, bytes]], list[tuple[str, bytes, bytes]]]:
    """(catalog records, user-event records) of about n user events, as (topic, key, value)."""
    # signed with the event key of the workers' settings `s` (their state dir's key file), as the
    # worker verifies them (part of its cost); another key would make every one a dead letter
    market = Market(
        MarketConfig(seed=seed, n_users=20_000, n_ads=2_000, rate=200.0), signing_key=event_key(s)
    )
    catalog: list[tuple[str, bytes, bytes]] = []
    events: list[tuple[str, bytes, bytes]] = []
    for e in market.open_loop(n):
        rec = (topic_of(e), key_of(e), encode(e))
        (catalog if isinstance(e, AdCreative) else events).append(rec)
        if len(events) >= n:
            break
    return catalog, events


async def produce(s: Settings, records: list[tuple[str, bytes, bytes]]) -> float:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(
        bootstrap_servers=s.kafka.bootstrap, linger_ms=20, max_batch_size=512 * 1024, acks=1
    )
    await producer.start()
    t0 = time.perf_counter()
    try:
        futs = [
            await producer.send(topics.topic_name(t, s.topic_prefix), value=v, key=k) for t, k, v in records
        ]
        await asyncio.gather(*futs)
    finally:
        await producer.stop()
    return time.perf_counter() - t0


def arrival_rate(arrivals: list[tuple[float, int, int]]) -> dict[str, float]:
    """Records (and MB) per second of batches that arrived at (time, records, bytes): the window
    opens when the first batch arrives, so that batch's records are not in the rate (counting
    them would credit up to 10,000 records, a tenth of a default run, to no time at all).

    >>> arrival_rate([(10.0, 10_000, 0), (10.5, 45_000, 0), (11.0, 45_000, 0)])["events_per_s"]
    90000.0
    """
    dt = arrivals[-1][0] - arrivals[0][0] if arrivals else 0.0  # one batch: no window
    n = sum(a[1] for a in arrivals[1:])
    nbytes = sum(a[2] for a in arrivals[1:])
    return {
        "events": sum(a[1] for a in arrivals),
        "seconds": dt,
        "events_per_s": n / dt if dt else 0.0,
        "mb_per_s": nbytes / dt / 1e6 if dt else 0.0,
    }


async def raw_consume(s: Settings, expect: int) -> dict[str, float]:
    """Read every user-event record once with a bare aiokafka consumer; the rate from the first
    batch's arrival to the last's (`arrival_rate`)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    c = AIOKafkaConsumer(bootstrap_servers=s.kafka.bootstrap, enable_auto_commit=False)
    await c.start()
    try:
        tps = [
            TopicPartition(topics.topic_name(t, s.topic_prefix), p)
            for t in USER_TOPICS
            for p in range(s.kafka.topic_partitions or 8)
        ]
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        n = 0
        arrivals: list[tuple[float, int, int]] = []
        deadline = time.monotonic() + 300
        while n < expect and time.monotonic() < deadline:
            batch = await c.getmany(timeout_ms=500, max_records=10_000)
            if not batch:
                continue
            now = time.perf_counter()  # counted without copying the batch: this loop is the floor
            k = sum(len(part) for part in batch.values())
            arrivals.append((now, k, sum(len(r.value or b"") for part in batch.values() for r in part)))
            n += k
    finally:
        await c.stop()
    return arrival_rate(arrivals)


async def dead_letters_so_far(s: Settings) -> int:
    """Records on the dead-letter topic (its end offsets summed): a worker run's dead letters
    are the difference; the benchmark's events are all valid, so it should be none."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    name = topics.topic_name(topics.DLQ, s.topic_prefix)
    n_parts = s.kafka.topic_partitions or topics.TOPICS_BY_NAME[topics.DLQ].partitions
    c = AIOKafkaConsumer(bootstrap_servers=s.kafka.bootstrap, enable_auto_commit=False)
    await c.start()
    try:
        ends = await c.end_offsets([TopicPartition(name, p) for p in range(n_parts)])
    finally:
        await c.stop()
    return int(sum(ends.values()))


def bare_faust_child(expect: int, out: Path) -> None:
    """(Child process) a Faust app whose one agent counts the raw records of the user topics
    (acks on, Faust's defaults otherwise); writes {events, seconds} from first to last record."""
    import faust

    from schemas.clients import faust_args

    s = Settings()
    app = faust.App(
        f"{s.topic_prefix}bare-faust-{uuid.uuid4().hex[:6]}",
        **faust_args(s),
        store="memory://",
        web_enabled=False,
        topic_disable_leader=True,
        consumer_auto_offset_reset="earliest",
        datadir=str(s.state_dir / "bare-faust"),
    )
    source = app.topic(
        *(topics.topic_name(t, s.topic_prefix) for t in USER_TOPICS),
        value_serializer="raw",
        key_serializer="raw",
        partitions=s.kafka.topic_partitions or 8,
    )
    seen = {"n": 0, "t0": 0.0}

    @app.agent(source)
    async def count(stream: Any) -> None:
        async for _event in stream.events():  # acked when the next one is taken
            if not seen["n"]:
                seen["t0"] = time.perf_counter()
            seen["n"] += 1
            if seen["n"] >= expect:
                dt = time.perf_counter() - seen["t0"]
                out.write_text(json.dumps({"events": seen["n"], "seconds": dt}))
                os._exit(0)  # the figure is written; Faust's shutdown is not measured

    faust.Worker(app, loglevel="warning", quiet=True).execute_from_commandline()


def run_child(s: Settings, flags: list[str], what: str, out_dir: Path, timeout_s: float) -> dict[str, Any]:
    """This script in a child process with the worker's settings (`worker_env`), `flags` naming
    its part (`--bare-faust-child N`, `--core-child N`); the JSON it writes to `--out`. Raises
    RuntimeError naming `what` and the child's log when it fails, runs out of time or writes
    nothing."""
    out = out_dir / f"child-{uuid.uuid4().hex[:6]}.json"
    log = out.with_suffix(".log")
    with log.open("wb") as fh:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.streams", *flags, "--out", str(out)],
                cwd=ROOT, env=worker_env(s), stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s,
            )  # fmt: skip
        except subprocess.TimeoutExpired:  # killed by `run`
            raise RuntimeError(f"{what}: no result after {timeout_s:.0f}s; see {log}") from None
    if proc.returncode or not out.exists():
        raise RuntimeError(f"{what}: failed (exit {proc.returncode}); see {log}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def bare_faust(s: Settings, expect: int, out_dir: Path, timeout_s: float = 900.0) -> dict[str, float]:
    """The bare-Faust floor: `bare_faust_child` in a child process; its rate."""
    what = f"bare Faust agent counting {expect} records"
    got = run_child(s, ["--bare-faust-child", str(expect)], what, out_dir, timeout_s)
    dt = got["seconds"]
    return {"events": got["events"], "seconds": dt, "events_per_s": got["events"] / dt if dt else 0.0}


def core_floor(
    s: Settings, catalog: list[tuple[str, bytes, bytes]], events: list[tuple[str, bytes, bytes]]
) -> dict[str, Any]:
    """The worker's per-event core in this process, without Kafka, Redis or ClickHouse: each
    fetch (`streams.fetch_records` records) judged as the pipeline judges it (`Pipeline._judge_all`:
    one batch decode, then clock skew and signature per record), folded into user state and
    the label join with the examples made as the bytes the worker produces
    (`Processor.on_batch_json`), and each event turned into its ClickHouse row (`row_of`). The
    rate is events per second of this process's CPU time: what any engine built on this core can
    reach at most on one core, whatever its client does; each stage's share is in CPU µs per
    event as well."""
    from streams.pipeline import Pipeline, RawRecord
    from streams.processor import Processor
    from streams.runtime import GC_GEN0
    from streams.sink import row_of

    pipe = Pipeline(s, None, None, None, lambda handles: None)  # type: ignore[arg-type]  # _judge only
    proc = Processor.from_settings(s)
    physical = {t: topics.topic_name(t, s.topic_prefix) for t in USER_TOPICS}  # records: base topics
    for topic, _, value in catalog:
        proc.on_event(decode(model_for_topic(topic), value))
    stages = dict.fromkeys(("judge", "state + join + examples", "row"), 0.0)
    # each stage in this process's CPU time, as the total: on a shared machine wall-clock stages
    # count the other processes' turns on the cores too
    now, clock = time.time(), time.process_time
    written_ms = int(now * 1000) - 1000  # every record written a second ago, as the broker stamps it
    examples = 0
    # the worker's own garbage collector settings (`Runtime.start`): with the defaults, this
    # process's large heap (every record of the run) made collections a fifth of the time
    saved = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0, 20, 100)
    cpu0 = time.process_time()
    fetch = s.streams.fetch_records
    for start in range(0, len(events), fetch):  # a fetch at a time, as the engines feed the pipeline
        t0 = clock()
        chunk = [
            (None, RawRecord(physical[topic], 0, start + i, value, written_ms), topic)
            for i, (topic, _, value) in enumerate(events[start : start + fetch])
        ]
        judged = pipe._judge_all(chunk, now)  # type: ignore[arg-type]  # no partition state needed
        stages["judge"] += clock() - t0
        batch = []
        for (_, rec, _), verdict in zip(chunk, judged, strict=True):
            if not isinstance(verdict, tuple):
                raise RuntimeError(f"the core refused a valid record at {rec.offset}: {verdict}")
            batch.append((verdict[0], rec.value, verdict[1]))
        t1 = clock()
        out = proc.on_batch_json(batch)  # as `Pipeline._process` folds what the merge releases
        t2 = clock()
        for offset, (event, _, ts) in enumerate(batch, start):
            row_of(event, 0, offset, ts)
        t3 = clock()
        examples += len(out)
        stages["state + join + examples"] += t2 - t1
        stages["row"] += t3 - t2
    cpu_s = time.process_time() - cpu0
    gc.set_threshold(*saved)
    gc.unfreeze()
    n = max(len(events), 1)
    return {
        "events": len(events),
        "examples": examples,
        "cpu_s": round(cpu_s, 3),
        "events_per_s": len(events) / cpu_s if cpu_s else 0.0,
        "cpu_us_per_event": round(cpu_s / n * 1e6, 2),
        "stage_us_per_event": {k: round(v / n * 1e6, 2) for k, v in stages.items()},
    }


def core_child(s: Settings, n: int, seed: int, out_dir: Path, timeout_s: float = 900.0) -> dict[str, Any]:
    """`core_floor` in a fresh child process with the worker's settings (as the engines run: a
    large benchmark process measured it 20 % slower than a fresh one), over the records
    `generate(n, seed)` gives (the same the engines read)."""
    flags = ["--core-child", str(n), "--seed", str(seed)]
    return run_child(s, flags, "the worker core run", out_dir, timeout_s)


def worker_env(s: Settings) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "ADSTREAM_KAFKA__BOOTSTRAP": s.kafka.bootstrap,
            "ADSTREAM_REDIS__URL": s.redis.url,
            "ADSTREAM_CLICKHOUSE__URL": s.clickhouse.url,
            "ADSTREAM_TOPIC_PREFIX": s.topic_prefix,
            "ADSTREAM_REDIS_PREFIX": s.redis_prefix,
            "ADSTREAM_STATE_DIR": str(s.state_dir),
            "ADSTREAM_METRICS__PORT": "0",
        }
    )
    return env


def applied_count(r: Any, s: Settings) -> int:
    raw = r.hgetall(f"{s.redis_prefix}streams:offsets")
    return sum(int(v) + 1 for k, v in raw.items() if not k.startswith(b"stream_ts:"))


positive_int = int_at_least(1)  # argparse type (`--rounds 0` would measure nothing)


def combine_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's row from its rounds: the median rate (and CPU per event), every round's rate,
    the dead letters of all of them, the first round's other fields (its profile)."""
    if len(runs) == 1:
        return {**runs[0], "rounds_events_per_s": [round(runs[0]["events_per_s"], 1)]}
    out = dict(runs[0])
    for key in ("events_per_s", "cpu_us_per_event", "worker_cpu_share", "machine_busy_share"):
        out[key] = statistics.median(r[key] for r in runs)
    out["rounds_events_per_s"] = [round(r["events_per_s"], 1) for r in runs]
    out["dead_letters"] = sum(r["dead_letters"] for r in runs)
    return out


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, every core (Linux /proc/stat)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks[:8]) - idle) / hz, sum(ticks[:8]) / hz


def _launch(s: Settings, engine: str, logs: list[Path]) -> list[subprocess.Popen[bytes]]:
    """One `adstream worker --engine ENGINE` per log file (one consumer group)."""
    procs: list[subprocess.Popen[bytes]] = []
    for path in logs:
        with path.open("wb") as fh:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "deploy.cli", "worker", "--loglevel", "warn", "--engine", engine],
                    cwd=ROOT,
                    env=worker_env(s),
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for pr in procs:
        pr.send_signal(signal.SIGTERM)
    for pr in procs:
        try:
            pr.wait(20)
        except subprocess.TimeoutExpired:
            pr.kill()


def _py_spy(pid: int, profile: Path, idle: bool) -> subprocess.Popen[bytes] | None:
    if not shutil.which("py-spy", path=str(Path(sys.executable).parent)):
        return None
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(pid),
         "-r", "100", "--format", "raw", "-o", str(profile), "--nonblocking",
         *(["--idle"] if idle else [])],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def run_worker(
    s: Settings,
    total: int,
    profile: Path | None,
    log: Path,
    engine: str,
    idle: bool = False,
    workers: int = 1,
) -> dict[str, Any]:
    """`workers` worker processes of `engine` (one consumer group) until `total` records are
    applied; the rate from 5 % to 100 % applied, CPU of the workers and of the machine meanwhile
    (py-spy on the first worker when `profile`)."""
    import redis

    r = redis.Redis.from_url(s.redis.url)
    logs = [log] if workers == 1 else [log.with_suffix(f".{i}.log") for i in range(workers)]
    procs = _launch(s, engine, logs)
    spy: subprocess.Popen[bytes] | None = None
    t_launch = time.perf_counter()
    try:
        start: tuple[float, int] | None = None
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            for pr, path in zip(procs, logs, strict=True):
                if pr.poll() is not None:
                    raise RuntimeError(f"worker exited with {pr.returncode}; see {path}")
            n = applied_count(r, s)
            now = time.perf_counter()
            if start is None and n >= total * 0.05:
                start = (now, n)
                cpus0, box0 = [process_cpu_s(pr.pid) for pr in procs], machine_cpu()
                spy = _py_spy(procs[0].pid, profile, idle) if profile is not None else None
            if n >= total:
                break
            if start is None and now - t_launch > STALL_S:
                raise RuntimeError(f"worker applied {n} of {total} records after {STALL_S:.0f}s; see {log}")
            time.sleep(0.1)
        end = (time.perf_counter(), applied_count(r, s))
        if start is not None:
            cpus1, box1 = [process_cpu_s(pr.pid) for pr in procs], machine_cpu()
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
    finally:
        _stop(procs)
        r.close()
    if start is None or end[1] < total:
        raise RuntimeError(f"workers applied {end[1]} of {total} records; see {logs[0]}")
    dt = end[0] - start[0]
    cpu = [c1 - c0 for c0, c1 in zip(cpus0, cpus1, strict=True)]
    out: dict[str, Any] = {
        "events": end[1] - start[1],
        "seconds": dt,
        "events_per_s": (end[1] - start[1]) / dt,
        "startup_to_5pct_s": start[0] - t_launch,
        "wall_s": end[0] - t_launch,
        # where the measured window's time went: the workers' own CPU (1.0 = one core all the
        # time: CPU-bound) and the whole machine's (broker, Redis, ClickHouse, py-spy included)
        "worker_cpu_share": round(sum(cpu) / dt, 3),
        "cpu_us_per_event": round(sum(cpu) / max(end[1] - start[1], 1) * 1e6, 1),
        "machine_busy_share": round((box1[0] - box0[0]) / max(box1[1] - box0[1], 1e-9), 3),
    }
    if workers > 1:
        out["workers"] = workers
        out["worker_cpu_shares"] = [round(c / dt, 3) for c in cpu]
    return out


def scale_row(scaled: dict[str, Any], one: dict[str, Any], raw_rate: float) -> dict[str, Any]:
    """streams.json's `scale.<engine>`: N workers' machine-level rate, the per-worker rate and
    its ratio to raw, the speed-up over one worker (same round).

    >>> row = scale_row({"events_per_s": 30_000.0, "workers": 2}, {"events_per_s": 20_000.0}, 200_000.0)
    >>> row["per_worker_events_per_s"], row["per_worker_ratio_to_raw"], row["speedup_vs_one_worker"]
    (15000.0, 0.075, 1.5)
    """
    n = int(scaled.get("workers", 1))
    rate = float(scaled["events_per_s"])
    return {
        "workers": n,
        "events_per_s": round(rate, 1),
        "ratio_to_raw": round(rate / raw_rate, 4) if raw_rate else None,
        "per_worker_events_per_s": round(rate / n, 1),
        "per_worker_ratio_to_raw": round(rate / n / raw_rate, 4) if raw_rate else None,
        "speedup_vs_one_worker": round(rate / one["events_per_s"], 3) if one.get("events_per_s") else None,
        **{k: v for k, v in scaled.items() if k not in ("events_per_s", "workers")},
    }


_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")
OURS = ("streams", "schemas", "attribution", "deploy", "workloads")
# frame prefixes (str.startswith takes a tuple) of our main steps, for their inclusive share
STEPS: dict[str, str | tuple[str, ...]] = {
    "validate (pydantic decode + dead letters)": (
        "BatchDecoder.fast (schemas/decode.py",
        "validate (streams/ingest.py",
        "BaseModel.model_validate_json (pydantic/main.py",
    ),
    "merge (time-ordered release)": "PartitionMerge.release (streams/merge.py",
    "state + label join": (
        "Processor.on_batch (streams/processor.py",
        "Processor.on_event (streams/processor.py",
    ),
    "ClickHouse insert": "ClickHouseSink._insert (streams/sink.py",
    "Redis MULTI/EXEC": "RedisStateStore.commit (streams/store.py",
    "encode user records": "encode_state (streams/record.py",
    "encode pending labels": "Pending.to_bytes (streams/join.py",
    "produce examples/DLQ": ("Runtime._send_many (streams/runtime.py", "Runtime._send (streams/runtime.py"),
    "Pipeline.feed (all intake)": "Pipeline.feed (streams/pipeline.py",
    "Pipeline._commit (all output)": (
        "Pipeline._commit (streams/pipeline.py",
        "Pipeline._finish (streams/pipeline.py",
        "_WorkItem.run (concurrent/futures/thread.py",  # the ClickHouse insert's thread
    ),
}


def _package(path: str) -> str:
    """py-spy shortens paths to `package/module.py`: the first component names the package."""
    head = path.split("/", 1)[0].removesuffix(".py") if path else "?"
    return f"{head} (ours)" if head in OURS else head


def summarise_profile(path: Path, top: int = 12) -> dict[str, Any]:
    """Self time by package and by function, and inclusive time of our main steps."""
    by_pkg: Counter[str] = Counter()
    by_func: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        mt = _FRAME.match(frames[-1])
        func, file = (mt.group("func"), mt.group("file")) if mt else (frames[-1], "")
        by_pkg[_package(file)] += n
        by_func[f"{func} ({file})"] += n
        for name, needle in STEPS.items():
            if any(f.startswith(needle) for f in frames):
                inclusive[name] += n
    if not total:
        return {"samples": 0}

    def share(c: Counter[str]) -> dict[str, float]:
        return {k: round(v / total, 4) for k, v in c.most_common(top)}

    return {
        "samples": total,
        "self_by_package": share(by_pkg),
        "self_by_function": share(by_func),
        "inclusive_steps": {k: round(inclusive[k] / total, 4) for k in STEPS},
    }


def cleanup(s: Settings, topics_too: bool = True) -> None:
    import redis

    r = redis.Redis.from_url(s.redis.url)
    keys = list(r.scan_iter(match=f"{s.redis_prefix}*", count=5000))
    for i in range(0, len(keys), 5000):
        r.delete(*keys[i : i + 5000])
    r.close()
    c = clickhouse_client(s)
    c.execute(f"DROP DATABASE IF EXISTS {clickhouse_database(s)}")
    c.disconnect()

    if not topics_too:
        return

    try:
        asyncio.run(delete_topics_async(s))
    except Exception as exc:  # a broker without topic deletion keeps them; not fatal
        print(f"(could not delete bench topics: {exc})")


def scoped(s: Settings, suffix: str, *, topics_too: bool = False) -> Settings:
    """`s` with Redis keys and a ClickHouse database of their own (`suffix`), and topics too
    (then consumer groups, which are named after the topic prefix)."""
    update: dict[str, Any] = {
        "redis_prefix": f"{s.redis_prefix}{suffix}:",
        "clickhouse": s.clickhouse.model_copy(update={"url": f"{s.clickhouse.url}_{suffix}"}),
    }
    if topics_too:
        update["topic_prefix"] = f"{s.topic_prefix}{suffix}."
    return s.model_copy(update=update)


def round_settings(s: Settings, rnd: int) -> Settings:
    """Topics (and so consumer groups), Redis keys and ClickHouse database of round `rnd`."""
    return scoped(s, f"r{rnd}", topics_too=True)


def engine_settings(s: Settings, engine: str) -> Settings:
    """Own Redis keys and ClickHouse database per engine run (same topics)."""
    return scoped(s, engine)


@dataclasses.dataclass
class Measured:
    """What the rounds measured: each engine's runs, the raw-consume floors, the bare-Faust floor
    and the worker core of each round."""

    events: int = 0
    rounds: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    scaled: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)  # N workers
    raws: list[dict[str, float]] = dataclasses.field(default_factory=list)
    faust_floor: dict[str, float] | None = None
    cores: list[dict[str, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Bench:
    """One benchmark run: its flags, settings of its own (topics, Redis keys, database) and files."""

    args: argparse.Namespace
    engines: list[str]
    s: Settings
    tag: str
    out_dir: Path
    console: Console


@dataclasses.dataclass
class Summary:
    """The rates derived from the rounds: per engine, the raw floor, the ratios and the goals."""

    runs: dict[str, dict[str, Any]]
    core: dict[str, Any]
    raw_rate: float
    ratio: dict[str, float]
    paired: list[float]
    faust_vs: float | None
    goals: dict[str, dict[str, Any]]
    scale: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--engines", default="faust,aiokafka", help="comma-separated: faust, aiokafka")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--profile-idle", action="store_true", help="py-spy samples idle threads too")
    ap.add_argument("--no-bare-faust", action="store_true", help="skip the bare-Faust floor")
    ap.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="run the engines this many times, interleaved (a shared machine swings ±20 %% between "
        "runs): each engine's rate is the median, the Faust/aiokafka ratio the median of the "
        "rounds' paired ratios; py-spy samples the first round only",
    )
    ap.add_argument(
        "--workers",
        type=int_at_least(0),
        default=2,
        help="also run this many workers of each engine at once on their shares of the partitions "
        "(the machine-level rate; 0: skip)",
    )
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the result JSON goes")
    ap.add_argument("--bare-faust-child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--core-child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return ap, ap.parse_args()


def child_mode(args: argparse.Namespace) -> bool:
    """Run a child process's part (bare Faust, the worker core) if this is one; True if it was."""
    if args.bare_faust_child:
        bare_faust_child(args.bare_faust_child, args.out)
        return True
    if args.core_child:
        child = Settings()  # the worker's, from worker_env
        args.out.write_text(json.dumps(core_floor(child, *generate(args.core_child, args.seed, child))))
        return True
    return False


def bench_settings(base: Settings, tag: str) -> Settings:
    """Topics, Redis keys and ClickHouse database of this run alone."""
    return base.model_copy(
        update={
            "topic_prefix": f"bench{tag}.",
            "redis_prefix": f"adstream-bench:{tag}:",
            "clickhouse": base.clickhouse.model_copy(
                update={"url": base.clickhouse.url.rsplit("/", 1)[0] + f"/adstream_bench_{tag}"}
            ),
            "state_dir": ROOT / ".adstream" / "bench",
        }
    )


def engine_run(b: Bench, sr: Settings, engine: str, rnd: int, n: int, workers: int = 1) -> dict[str, Any]:
    """One engine's worker(s) over the round's `n` events (py-spy on the first round's single one)."""
    es = engine_settings(sr, engine)
    profiled = not b.args.no_profile and rnd == 0 and workers == 1
    profile = b.out_dir / f"streams-{b.tag}-{engine}.pyspy.txt" if profiled else None
    log = b.out_dir / f"streams-{b.tag}-{engine}{'' if workers == 1 else f'-x{workers}'}.log"
    try:
        dead_before = asyncio.run(dead_letters_so_far(sr))
        run = run_worker(es, n, profile, log, engine, b.args.profile_idle, workers)
        run["dead_letters"] = asyncio.run(dead_letters_so_far(sr)) - dead_before
        run["profile"] = summarise_profile(profile) if profile and profile.exists() else {}
        return run
    finally:
        cleanup(es, topics_too=False)


def measure_round(
    b: Bench,
    m: Measured,
    rnd: int,
    catalog: list[tuple[str, bytes, bytes]],
    events: list[tuple[str, bytes, bytes]],
) -> None:
    """Round `rnd`: the worker core, then per engine a raw-consume floor and the engine's run."""
    # a later round reads the same records from topics of its own: the engines' consumer
    # groups are named after the topic prefix and would resume at the end of the old ones
    sr = b.s if rnd == 0 else round_settings(b.s, rnd)
    if rnd:
        create_topics(sr)
        asyncio.run(produce(sr, catalog))
        asyncio.run(produce(sr, events))
    m.cores.append(core_child(b.s, b.args.events, b.args.seed, b.out_dir))
    b.console.print(f"worker core, no I/O: {m.cores[-1]['events_per_s']:,.0f} events/s of CPU")
    try:
        for engine in b.engines:
            m.raws.append(asyncio.run(raw_consume(sr, len(events))))
            m.rounds[engine].append(engine_run(b, sr, engine, rnd, len(events)))
    finally:
        if rnd:
            cleanup(sr)
    if b.args.workers:
        # topics of their own: each engine's consumer group has committed the round's to the end
        sx = scoped(sr, f"x{b.args.workers}", topics_too=True)
        create_topics(sx)
        try:
            asyncio.run(produce(sx, catalog))
            asyncio.run(produce(sx, events))
            for engine in b.engines:
                got = engine_run(b, sx, engine, rnd, len(events), workers=b.args.workers)
                m.scaled.setdefault(engine, []).append(got)
                b.console.print(
                    f"{engine}, {b.args.workers} workers: {got['events_per_s']:,.0f} events/s "
                    f"(CPU shares {got.get('worker_cpu_shares')})"
                )
        finally:
            cleanup(sx)


def measure(b: Bench) -> Measured:
    """Produce the events (topics created), the floors, then `--rounds` rounds of every engine; cleans
    up after."""
    m = Measured(rounds={e: [] for e in b.engines})
    try:
        catalog, events = generate(b.args.events, b.args.seed, b.s)
        m.events = len(events)
        asyncio.run(produce(b.s, catalog))
        produce_s = asyncio.run(produce(b.s, events))
        b.console.print(f"produced {len(events)} user events ({len(catalog)} ads) in {produce_s:.1f}s")
        if not b.args.no_bare_faust:
            m.faust_floor = bare_faust(b.s, len(events), b.out_dir)
        for rnd in range(b.args.rounds):
            measure_round(b, m, rnd, catalog, events)
        m.raws.append(asyncio.run(raw_consume(b.s, len(events))))
    finally:
        cleanup(b.s)
    return m


def summarize(m: Measured) -> Summary:
    """Median rates over the rounds, the ratios to the raw floor and the goals."""
    runs = {e: combine_rounds(rs) for e, rs in m.rounds.items()}
    core = sorted(m.cores, key=lambda c: float(c["events_per_s"]))[len(m.cores) // 2]  # the median run
    core = {**core, "rounds_events_per_s": [round(c["events_per_s"], 1) for c in m.cores]}

    raw_rates = sorted(r["events_per_s"] for r in m.raws)
    raw_rate = raw_rates[len(raw_rates) // 2]
    ratio = {e: r["events_per_s"] / raw_rate if raw_rate else 0.0 for e, r in runs.items()}
    paired = (
        [
            f["events_per_s"] / a["events_per_s"]
            for f, a in zip(m.rounds["faust"], m.rounds["aiokafka"], strict=True)
        ]
        if "faust" in m.rounds and "aiokafka" in m.rounds
        else []
    )
    faust_vs = statistics.median(paired) if paired else None
    goals: dict[str, dict[str, Any]] = {
        "faust_vs_engine_aiokafka": {"goal": GOAL_FAUST_VS_AIOKAFKA, "measured": _r(faust_vs)},
        **{
            f"{e}_ratio_to_raw": {
                "goal": GOAL_RATIO_TO_RAW,
                "measured": round(ratio[e], 4),
            }
            for e in runs
        },
        "core_ratio_to_raw": {
            "goal": GOAL_CORE_TO_RAW,
            "measured": round(float(core["events_per_s"]) / raw_rate, 4) if raw_rate else None,
        },
    }
    for g in goals.values():
        g["met"] = g["measured"] is not None and g["measured"] >= g["goal"]
    scale = {
        e: scale_row(combine_rounds(rs), runs[e], raw_rate)
        | {
            "speedup_rounds": [
                round(x["events_per_s"] / o["events_per_s"], 3) for x, o in zip(rs, m.rounds[e], strict=True)
            ]
        }
        for e, rs in m.scaled.items()
        if e in runs
    }
    return Summary(runs, core, raw_rate, ratio, paired, faust_vs, goals, scale)


def floors_json(m: Measured, raw_rate: float) -> dict[str, Any]:
    """streams.json's `floors`: the raw-consume loop and, if run, the bare Faust agent."""
    faust_floor = m.faust_floor
    return {
        "aiokafka_getmany": {
            "events_per_s": round(raw_rate, 1),
            "ratio_to_raw": 1.0,
            "runs": m.raws,
            "what": "bare aiokafka getmany loop, no decoding (median of the runs: `raw`)",
        },
        **(
            {
                "faust_agent": {
                    "events_per_s": round(faust_floor["events_per_s"], 1),
                    "ratio_to_raw": round(faust_floor["events_per_s"] / raw_rate, 4) if raw_rate else None,
                    **faust_floor,
                    "what": "bare Faust agent counting raw records' events, acks on",
                }
            }
            if faust_floor
            else {}
        ),
    }


def result_json(b: Bench, m: Measured, sm: Summary, load_start: float) -> dict[str, Any]:
    """streams.json: every engine, the floors, the core ceiling, the goals and the machine."""
    s, core, raw_rate = b.s, sm.core, sm.raw_rate
    return {
        "benchmark": "streams",
        "events": m.events,
        "engines": {
            e: {
                "events_per_s": round(r["events_per_s"], 1),
                "ratio_to_raw": round(sm.ratio[e], 4),
                **{k: v for k, v in r.items() if k != "events_per_s"},
            }
            for e, r in sm.runs.items()
        },
        "faust_vs_engine_aiokafka": _r(sm.faust_vs),
        "faust_vs_aiokafka_rounds": [round(v, 4) for v in sm.paired],
        "rounds": b.args.rounds,
        "floors": floors_json(m, raw_rate),
        "core": {
            **core,
            "events_per_s": round(core["events_per_s"], 1),
            "ratio_to_raw": round(core["events_per_s"] / raw_rate, 4) if raw_rate else None,
            "engines_ratio_to_core": {
                e: round(r["events_per_s"] / core["events_per_s"], 3) for e, r in sm.runs.items()
            },
            "what": "the worker's per-event core in one process, no I/O (core_floor): the most any "
            "engine on it reaches on one core",
        },
        "raw_consume_events_per_s": round(raw_rate, 1),
        "scale": sm.scale,
        "goals": sm.goals,
        "settings": {
            "sink_batch_size": s.sink.batch_size,
            "sink_flush_s": s.sink.flush_s,
            "state_dim": s.state_dim,
            "label_mode": s.online.label_mode,
        },
        "machine": machine() | {"load_avg_1m_start": load_start, "python": platform.python_version()},
    }


def rates_table(m: Measured, sm: Summary) -> Table:
    """One row per floor, the core ceiling and each engine."""
    raw_rate, core, faust_floor = sm.raw_rate, sm.core, m.faust_floor
    table = Table(
        "path",
        "events",
        "seconds",
        "events/s",
        "÷ raw",
        "dead letters",
        "worker CPU",
        "CPU µs/event",
        "box busy",
    )
    table.add_row("floor: aiokafka getmany (median = raw)", str(m.events), "", f"{raw_rate:,.0f}", "1")
    if faust_floor:
        table.add_row(
            "floor: bare Faust agent (acks on)",
            str(faust_floor["events"]),
            f"{faust_floor['seconds']:.2f}",
            f"{faust_floor['events_per_s']:,.0f}",
            f"{faust_floor['events_per_s'] / raw_rate:.3f}",
        )
    table.add_row(
        "ceiling: the worker's core, no I/O (CPU)",
        str(core["events"]),
        f"{core['cpu_s']:.2f}",
        f"{core['events_per_s']:,.0f}",
        f"{core['events_per_s'] / raw_rate:.3f}",
        "",
        "",
        f"{core['cpu_us_per_event']:.0f}",
    )
    for e, r in sm.scale.items():
        table.add_row(
            f"{r['workers']} × adstream worker --engine {e} (machine)",
            str(r["events"]),
            f"{r['seconds']:.2f}",
            f"{r['events_per_s']:,.0f}",
            f"{r['ratio_to_raw']:.3f} ({r['per_worker_ratio_to_raw']:.3f}/worker)",
            f"{r['dead_letters']:,}",
            f"{r['worker_cpu_share']:.0%}",
            f"{r['cpu_us_per_event']:.0f}",
            f"{r['machine_busy_share']:.0%}",
        )
    for e, r in sm.runs.items():
        table.add_row(
            f"adstream worker --engine {e}",
            str(r["events"]),
            f"{r['seconds']:.2f}",
            f"{r['events_per_s']:,.0f}",
            f"{sm.ratio[e]:.3f}",
            f"{r['dead_letters']:,}",
            f"{r['worker_cpu_share']:.0%}",
            f"{r['cpu_us_per_event']:.0f}",
            f"{r['machine_busy_share']:.0%}",
        )
    return table


def print_profiles(console: Console, runs: dict[str, dict[str, Any]]) -> None:
    """py-spy's self time by package and inclusive steps of each profiled engine."""
    for e, r in runs.items():
        prof = r.get("profile") or {}
        if not prof.get("samples"):
            continue
        t2 = Table(f"{e}: self time by package (py-spy)", "share")
        for k, v in prof["self_by_package"].items():
            t2.add_row(k, f"{v:.1%}")
        t3 = Table(f"{e}: step (inclusive)", "share")
        for k, v in prof["inclusive_steps"].items():
            t3.add_row(k, f"{v:.1%}")
        console.print(t2, t3)


def print_report(b: Bench, m: Measured, sm: Summary, result: dict[str, Any]) -> None:
    """The rates table, per-round rates, dead letters, goals, machine and profiles."""
    console, runs = b.console, sm.runs
    console.print(rates_table(m, sm))
    if b.args.rounds > 1:
        for e, r in runs.items():
            console.print(f"{e}: events/s per round {r['rounds_events_per_s']} (median in the table)")
        console.print(f"faust / aiokafka per round: {result['faust_vs_aiokafka_rounds']}")
    for e, r in runs.items():
        if r["dead_letters"]:
            console.print(
                f"[red]{e}: {r['dead_letters']:,} records dead-lettered: not the pipeline's rate[/red]"
            )
    for name, g in sm.goals.items():
        console.print(f"goal {name} ≥ {g['goal']}: {g['measured']} ({'met' if g['met'] else 'NOT met'})")
    mach = result["machine"]
    console.print(f"machine: {mach['cpu']}, {mach['cores']} cores, load {mach['load_avg_1m']:.2f}")
    print_profiles(console, runs)
    console.print(f"wrote {b.args.results}")


def main() -> None:
    ap, args = parse_args()
    if child_mode(args):
        return
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    base = Settings()
    if args.events < COMMITS_MEASURED * base.sink.batch_size:
        # the rate is measured from 5 % applied on, in commits of up to sink.batch_size records:
        # fewer events leave a window of one commit or none (a rate of 0, then a division by it)
        ap.error(
            f"--events must be at least {COMMITS_MEASURED} × sink.batch_size "
            f"({COMMITS_MEASURED * base.sink.batch_size}) to measure a rate (got {args.events})"
        )

    tag = uuid.uuid4().hex[:6]
    out_dir = ROOT / ".adstream" / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    b = Bench(args, engines, bench_settings(base, tag), tag, out_dir, Console())
    create_topics(b.s)
    load_start = machine()["load_avg_1m"]
    m = measure(b)
    sm = summarize(m)
    result = result_json(b, m, sm, load_start)
    write_result(args.results, result)
    print_report(b, m, sm, result)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


if __name__ == "__main__":
    main()
