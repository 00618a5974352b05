"""Operating a deployment: `adstream init` (the one-shot first step), `adstream probe` (liveness
on progress) and `adstream schedule` (rollups and attribution runs on a timer)."""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
import sys
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from schemas.settings import Settings

console = Console()
err = Console(stderr=True)


class Role(StrEnum):
    """Which consumer `adstream probe` checks."""

    streams = "streams"
    trainer = "trainer"


# the counters that move when a role consumes anything, and its own pending-work gauge
PROGRESS: dict[Role, tuple[str, ...]] = {
    Role.streams: ("adstream_streams_events_in_total",),
    Role.trainer: (
        "adstream_trainers_examples_total",
        "adstream_trainers_skipped_examples_total",
        "adstream_trainers_duplicate_examples_total",
        "adstream_trainers_invalid_examples_total",
        "adstream_trainers_held_examples",
    ),
}
PENDING: dict[Role, str | None] = {Role.streams: "adstream_streams_lag_events", Role.trainer: None}
DEFAULT_PORT: dict[Role, int] = {Role.streams: 9464, Role.trainer: 9465}


def metric_sum(text: str, names: tuple[str, ...]) -> float | None:
    """The sum of every sample of these metrics in a Prometheus text page (None: none present)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            seen = True
    return total if seen else None


async def group_lag(settings: Settings, group: str, topic_bases: list[str]) -> int:
    """Records the consumer group has not committed yet on these topics (end offset − committed)."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.admin import AIOKafkaAdminClient

    from schemas import topics
    from schemas.clients import kafka_args

    names = {topics.topic_name(t, settings.topic_prefix) for t in topic_bases}
    admin = AIOKafkaAdminClient(**kafka_args(settings), request_timeout_ms=5000)
    consumer = AIOKafkaConsumer(**kafka_args(settings), enable_auto_commit=False)
    await admin.start()
    await consumer.start()
    try:
        committed = await admin.list_consumer_group_offsets(group)
        parts = [tp for tp in committed if tp.topic in names]
        if not parts:
            return 0
        ends = await consumer.end_offsets(parts)
        return sum(max(0, ends[tp] - max(committed[tp].offset, 0)) for tp in parts)
    finally:
        await consumer.stop()
        await admin.close()


def default_group(role: Role, settings: Settings) -> tuple[str, list[str]]:
    """The consumer group of a role and the contract topics it consumes."""
    from schemas import topics

    if role is Role.trainer:
        return f"{settings.topic_prefix}{settings.online.group}", [topics.TRAINING_EXAMPLES]
    user = list(topics.USER_INPUTS)  # what the worker's pipeline consumes (`streams.pipeline.INPUTS`)
    return f"{settings.topic_prefix}adstream-streams-aiokafka", user


def judge(
    state: dict[str, Any], progress: float, pending: float, now: float, stall_s: float
) -> tuple[bool, str, dict[str, Any]]:
    """Alive or not, why, and the state to keep: alive while the progress counters move, or while
    nothing waits; dead once work has waited `stall_s` seconds with no progress."""
    last, since = state.get("progress"), state.get("since", now)
    if last is None or progress != last or pending <= 0:
        why = "idle: nothing pending" if pending <= 0 and progress == last else "progressing"
        return True, why, {"progress": progress, "since": now}
    stalled = now - since
    if stalled > stall_s:
        return False, f"no progress for {stalled:.0f}s with {pending:.0f} records pending", state
    return True, f"no progress for {stalled:.0f}s (limit {stall_s:.0f}s), {pending:.0f} pending", state


def register(app: typer.Typer) -> None:
    """Add the operations commands to the `adstream` CLI."""
    app.command()(init)
    app.command()(probe)
    app.command()(schedule)


def init(
    retrain: Annotated[bool, typer.Option(help="Train the base model again even when one exists")] = False,
    min_examples: Annotated[
        int, typer.Option(help="Impressions in ClickHouse needed to train from history")
    ] = 2_000,
    min_clicks: Annotated[int, typer.Option(help="Clicks in ClickHouse needed to train from history")] = 20,
    cold_start_impressions: Annotated[
        int, typer.Option(min=100, help="Simulated impressions of the cold-start model")
    ] = 12_000,
    epochs: Annotated[int, typer.Option(min=1, help="Ranker epochs")] = 3,
    threads: Annotated[int, typer.Option(min=1, help="Torch CPU threads")] = 2,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the result here")] = None,
) -> None:
    """Create topics, migrate ClickHouse and provision the base model (from ClickHouse's history,
    else the documented cold-start model): the deployment's one-shot first step."""
    from deploy.bootstrap import InitSpec
    from deploy.bootstrap import init as run_init

    spec = InitSpec(
        min_examples=min_examples,
        min_clicks=min_clicks,
        retrain=retrain,
        cold_start_impressions=cold_start_impressions,
        epochs=epochs,
        threads=threads,
    )
    result = run_init(Settings(), spec, lambda line: console.print(line, markup=False, highlight=False))
    console.print("init done: the loop's services can start")
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=2, default=str) + "\n")


def probe(
    role: Annotated[Role, typer.Argument(help="streams or trainer")],
    port: Annotated[int | None, typer.Option(help="Its metrics port (default 9464 / 9465)")] = None,
    host: Annotated[str, typer.Option(help="Its metrics host")] = "127.0.0.1",
    stall_s: Annotated[
        float, typer.Option(min=1, help="Fail after this long with work pending and no progress")
    ] = 180.0,
    state: Annotated[Path | None, typer.Option(help="Where the probe keeps the last progress seen")] = None,
    group: Annotated[str | None, typer.Option(help="Consumer group (default: the role's)")] = None,
) -> None:
    """Liveness on progress: exit 1 when the process's metrics do not answer, or when records
    wait for it (its lag, its group's uncommitted records) and its consumed-records counters
    have not moved for --stall-s seconds. Idle with nothing pending is alive."""
    import httpx

    settings = Settings()
    url = f"http://{host}:{port or DEFAULT_PORT[role]}/metrics"
    try:
        text = httpx.get(url, timeout=5).text
    except httpx.HTTPError as exc:
        err.print(f"dead: {url} does not answer ({type(exc).__name__})", markup=False)
        raise typer.Exit(1) from exc
    progress = metric_sum(text, PROGRESS[role]) or 0.0
    own = PENDING[role]
    pending = (metric_sum(text, (own,)) or 0.0) if own else 0.0
    gname, bases = default_group(role, settings)
    try:
        pending = max(pending, asyncio.run(group_lag(settings, group or gname, bases)))
    except Exception as exc:  # the broker is down: not this process's fault, judge on its own lag
        err.print(f"(group lag unknown: {type(exc).__name__}: {exc})", markup=False)
    path = state or Path(f"/tmp/adstream-probe-{role.value}-{port or DEFAULT_PORT[role]}.json")
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        kept = {}
    kept = kept if isinstance(kept, dict) else {}
    alive, why, keep = judge(kept, progress, pending, time.time(), stall_s)
    path.write_text(json.dumps(keep))
    (console if alive else err).print(f"{'alive' if alive else 'dead'}: {why}", markup=False)
    if not alive:
        raise typer.Exit(1)


def schedule(
    job: Annotated[
        list[str],
        typer.Option(
            help="EVERY=COMMAND: run `adstream COMMAND` every EVERY (30s, 15m, 1h, 1d), e.g. "
            "'1h=attribution rollup'; repeat for more jobs"
        ),
    ],
    once: Annotated[bool, typer.Option(help="Run each job once and exit (its worst exit code)")] = False,
) -> None:
    """Run adstream commands on a timer (rollups, attribution runs): each job first at start,
    then every EVERY; a failing run is logged and retried at its next time."""
    jobs = [parse_job(j) for j in job]
    from deploy.cli_serving import stop_requested

    worst = 0
    stopped = stop_requested()
    due = [time.monotonic()] * len(jobs)
    while not stopped():
        for i, (every, argv) in enumerate(jobs):
            if time.monotonic() >= due[i]:
                worst = max(worst, run_job(argv))
                due[i] = time.monotonic() + every
        if once:
            break
        time.sleep(min(1.0, max(0.0, min(due) - time.monotonic())))
    if once and worst:
        raise typer.Exit(worst)


UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_job(text: str) -> tuple[float, list[str]]:
    """'1h=attribution rollup' → (3600, ['attribution', 'rollup']); the command must be one the
    CLI has and parse as it would (a typo stops the scheduler at start, not at 3 a.m.)."""
    every, sep, command = text.partition("=")
    every = every.strip()
    if not sep or not every or every[-1] not in UNITS or not every[:-1].replace(".", "", 1).isdigit():
        raise typer.BadParameter(f"{text!r}: want EVERY=COMMAND with EVERY like 30s, 15m, 1h, 1d")
    seconds = float(every[:-1]) * UNITS[every[-1]]
    if seconds <= 0:
        raise typer.BadParameter(f"{text!r}: EVERY must be > 0")
    argv = shlex.split(command)
    check_command(argv, text)
    return seconds, argv


def check_command(argv: list[str], shown: str) -> None:
    """Parse `adstream ARGV` with the CLI's own parser, without running it."""
    import typer.main

    from deploy.cli import app

    root: Any = typer.main.get_command(app)
    command, rest = root, list(argv)
    while rest and rest[0] in getattr(command, "commands", {}):
        command = command.commands[rest.pop(0)]
    if command is root or (rest and not rest[0].startswith("-") and getattr(command, "commands", None)):
        raise typer.BadParameter(f"{shown!r}: `adstream {' '.join(argv)}` is not an adstream command")
    try:
        command.make_context(f"adstream {' '.join(argv)}", rest, resilient_parsing=False)
    except Exception as exc:  # Typer's vendored click: UsageError (bad option/value), Exit (--help)
        names = {c.__name__ for c in type(exc).__mro__}
        if "UsageError" in names:
            raise typer.BadParameter(f"{shown!r}: {exc}") from exc
        if "Exit" not in names:
            raise


def run_job(argv: list[str]) -> int:
    """Run `adstream ARGV` as its own process; its exit code."""
    t0 = time.monotonic()
    console.print(f"$ adstream {shlex.join(argv)}", markup=False, highlight=False)
    code = subprocess.run([sys.executable, "-m", "deploy.cli", *argv], check=False).returncode
    console.print(f"  exit {code} after {time.monotonic() - t0:.1f}s", markup=False)
    return code


app = typer.Typer(help="Operations: init, liveness probe, scheduler.")
register(app)
