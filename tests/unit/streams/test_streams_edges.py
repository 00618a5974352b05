"""Edge pieces of the worker without services: validation/dead letters, the merge rule, the
Redis record's corruption check, migration parsing and sink rows."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from redis import exceptions as redis_errors
from streams_helpers import click, creative, dwell, impression

from attribution.migrate import migration_files, statements
from schemas.codec import encode
from schemas.errors import StoreError
from schemas.events import DeadLetter
from schemas.retry import Backoff
from schemas.settings import Settings
from schemas.user_record import UserState, decode_state, encode_state
from streams.ingest import Invalid, dead_letter_id, validate
from streams.merge import Item, PartitionMerge
from streams.pipeline import Pipeline, RawRecord
from streams.sink import COLUMNS, row_of
from streams.store import RedisStateStore

INPUTS = ("ad.impressions", "ad.clicks", "ad.dwell", "ad.conversions")


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"\x00\xff garbage", "bad_json"),
        (None, "empty"),
        (b"[1, 2]", "wrong_type"),
        (b"{}", "missing_field"),
    ],
)
def test_invalid_records_become_dead_letters(value: bytes | None, reason: str) -> None:
    out = validate("ad.clicks", "p.ad.clicks", 3, 17, value, 1_767_225_600_000)
    assert isinstance(out, Invalid) and out.reason == reason
    dl = out.dead_letter
    assert isinstance(dl, DeadLetter)
    assert (dl.source_topic, dl.partition, dl.offset, dl.raw) == ("p.ad.clicks", 3, 17, value or b"")
    assert dl.event_id == dead_letter_id("p.ad.clicks", 3, 17) and dl.error


def test_contract_violations_are_named() -> None:
    good = json.loads(encode(dwell("d1", 1, "i1", 500)))
    cases = {
        "unknown_field": {**good, "extra": 1},
        "out_of_range": {**good, "dwell_ms": 3_600_001},
        "wrong_type": {**good, "dwell_ms": "long"},
        "naive_timestamp": {**good, "ts": "2026-01-01T00:00:00"},
    }
    for reason, obj in cases.items():
        out = validate("ad.dwell", "ad.dwell", 0, 0, json.dumps(obj).encode(), 0)
        assert isinstance(out, Invalid), reason
        assert out.reason == reason, (reason, out.dead_letter.error)
    ok = validate("ad.dwell", "ad.dwell", 0, 0, json.dumps(good).encode(), 0)
    assert not isinstance(ok, Invalid) and ok.event_id == "d1"


def _item(topic: str, offset: int, t: float) -> Item:
    ev = impression(f"{topic}{offset}", t) if topic == "ad.impressions" else click(f"c{offset}", t, "i")
    return Item(topic, offset, ev, ev.ts.timestamp())


def test_merge_waits_for_an_input_that_is_not_caught_up() -> None:
    m = PartitionMerge()
    m.push(_item("ad.impressions", 0, 10))
    m.push(_item("ad.impressions", 1, 30))
    # clicks may still bring something older: nothing can be released
    assert list(m.release(lambda topic, last: topic != "ad.clicks", INPUTS)) == []
    m.push(_item("ad.clicks", 0, 20))
    out = [(i.topic, i.offset) for i in m.release(lambda topic, last: topic != "ad.clicks", INPUTS)]
    # the impression at t=10 and the click at t=20 are certain; t=30 waits for more clicks
    assert out == [("ad.impressions", 0), ("ad.clicks", 0)]
    out = [(i.topic, i.offset) for i in m.release(lambda topic, last: True, INPUTS)]
    assert out == [("ad.impressions", 1)] and m.buffered() == 0


def test_merge_keeps_offset_order_within_an_input_and_releases_invalid_at_once() -> None:
    m = PartitionMerge()
    m.push(_item("ad.impressions", 0, 50))
    m.push(Item("ad.impressions", 1, None, 0.0))  # invalid: no time
    m.push(_item("ad.impressions", 2, 5))  # out of order inside the input: still after offset 0
    m.push(_item("ad.clicks", 0, 40))
    out = [(i.topic, i.offset) for i in m.release(lambda topic, last: True, INPUTS)]
    assert out == [("ad.clicks", 0), ("ad.impressions", 0), ("ad.impressions", 1), ("ad.impressions", 2)]


@pytest.mark.parametrize("prefix", ["", "t1234."])
def test_merge_puts_an_impression_before_its_click_at_the_same_time(prefix: str) -> None:
    # the worker pushes physical (prefixed) topic names: the tie-break must still know them
    m = PartitionMerge()
    m.push(_item(prefix + "ad.clicks", 0, 10))
    m.push(_item(prefix + "ad.impressions", 5, 10))  # a later offset must not decide the tie
    inputs = tuple(prefix + t for t in INPUTS)
    out = [i.topic for i in m.release(lambda topic, last: True, inputs)]
    assert out == [prefix + "ad.impressions", prefix + "ad.clicks"]


def test_corrupt_record_is_a_store_error() -> None:
    data = encode_state(UserState.empty("u", 8))
    with pytest.raises(StoreError, match="truncated or corrupt"):
        decode_state("u", data[:20])
    with pytest.raises(StoreError, match="bad magic"):
        decode_state("u", b"XX" + data[2:])


def test_migrations_parse_into_statements() -> None:
    files = migration_files()
    assert files and files[0].stem == "001_raw_events"
    stmts = statements(files[0].read_text())
    assert len(stmts) == 5
    assert all(s.startswith("CREATE TABLE IF NOT EXISTS") and "ReplacingMergeTree" in s for s in stmts)
    assert statements("-- only a comment\n;\n") == []


def test_sink_rows_follow_the_columns() -> None:
    for ev in (impression("i1", 0), click("c1", 1, "i1"), dwell("d1", 2, "i1", 10), creative()):
        table, row = row_of(ev, 4, 99)
        _, cols = COLUMNS[type(ev)]
        assert len(row) == len(cols) + 2 and row[-2:] == (4, 99) and row[0] == ev.event_id
        assert table in {"impressions", "clicks", "dwell", "ads"}


async def test_retrying_repeats_a_failing_step_until_it_succeeds() -> None:
    from streams.pipeline import retrying

    calls: list[int] = []

    async def flaky() -> None:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("store down")

    await retrying(flaky, "test step", Backoff(0.001, 0.01))
    assert len(calls) == 3


async def test_retrying_raises_a_bug_at_once_instead_of_retrying_it_for_ever() -> None:
    """A step that fails with a bug (not a service down) surfaces, it does not loop as "store down"."""
    from streams.pipeline import retrying

    calls: list[int] = []

    async def buggy() -> None:
        calls.append(1)
        raise KeyError("user_id")

    with pytest.raises(KeyError):
        await asyncio.wait_for(retrying(buggy, "test step", Backoff(0.001, 0.01)), timeout=2.0)
    assert len(calls) == 1


class _Redis:
    """A redis.asyncio client whose MGET raises `exc` the first `times` calls, then finds nothing."""

    def __init__(self, exc: BaseException, times: int = 1) -> None:
        self.exc, self.times, self.calls = exc, times, 0

    async def mget(self, keys: list[str]) -> list[None]:
        self.calls += 1
        if self.calls <= self.times:
            raise self.exc
        return [None] * len(keys)

    async def hmget(self, key: str, fields: list[str]) -> list[None]:
        return [None] * len(fields)

    async def hgetall(self, key: str) -> dict[bytes, bytes]:
        return {}


class _BuggySink:
    """An event sink with a bug: every write raises KeyError."""

    def __init__(self) -> None:
        self.calls = 0

    async def write(self, rows: object) -> None:
        self.calls += 1
        raise KeyError("impressions")


def _pipeline(redis: _Redis, sink: object = None) -> Pipeline:
    s = Settings(
        streams={
            "verify_impressions": False,
            "verify_clicks": False,
            "retry_first_s": 0.001,
            "retry_max_s": 0.01,
        }
    )

    async def send(topic: str, key: bytes, value: bytes) -> None:
        return None

    return Pipeline(s, RedisStateStore(redis, "t:", 60), sink, send, lambda handles: None)  # type: ignore[arg-type]


def _record(pipe: Pipeline) -> RawRecord:
    event = impression("i1", 1.0)
    return RawRecord(pipe.inputs[0], 0, 0, encode(event), int(event.ts.timestamp() * 1000))


async def test_a_bug_in_a_user_read_surfaces_instead_of_being_retried_as_redis_down() -> None:
    redis = _Redis(AttributeError("'NoneType' object has no attribute 'decode'"), times=10**9)
    pipe = _pipeline(redis)
    with pytest.raises(AttributeError):
        await asyncio.wait_for(pipe.feed([_record(pipe)]), timeout=2.0)
    assert redis.calls == 1


async def test_a_dropped_redis_connection_is_retried_and_a_command_error_is_not() -> None:
    redis = _Redis(redis_errors.ConnectionError("Connection reset by peer"), times=3)
    pipe = _pipeline(redis)
    await asyncio.wait_for(pipe.feed([_record(pipe)]), timeout=5.0)
    assert redis.calls == 4 and "u1" in pipe.parts[0].proc.states

    wrong = _Redis(redis_errors.ResponseError("WRONGTYPE Operation against a key"), times=10**9)
    pipe = _pipeline(wrong)
    with pytest.raises(StoreError, match="WRONGTYPE"):
        await asyncio.wait_for(pipe.feed([_record(pipe)]), timeout=2.0)
    assert wrong.calls == 1


def test_metric_names_follow_the_house_style() -> None:
    from prometheus_client import REGISTRY

    import streams.metrics  # noqa: F401  (registers the metrics)

    names = {m.name for m in REGISTRY.collect() if "streams" in m.name}
    assert names and all(n.startswith("adstream_streams_") for n in names)
    labels = {
        label
        for metric in REGISTRY.collect()
        if metric.name.startswith("adstream_streams_")
        for sample in metric.samples
        for label in sample.labels
    }
    assert not labels & {"user_id", "ad_id", "event_id", "impression_id"}


def test_event_dated_far_after_its_record_is_dead_lettered() -> None:
    from streams.ingest import ahead_of_record

    ev = impression("far", 0.0)
    record_ms = int(ev.ts.timestamp() * 1000)
    assert ahead_of_record(ev, "t.ad.impressions", 3, 7, b"{}", record_ms, 86400.0) is None
    assert ahead_of_record(ev, "t.ad.impressions", 3, 7, b"{}", -1, 86400.0) is None  # no record time
    late_record = record_ms - 2 * 86400 * 1000  # the event claims a time two days after its record
    bad = ahead_of_record(ev, "t.ad.impressions", 3, 7, b"{}", late_record, 86400.0)
    assert bad is not None and bad.reason == "future_timestamp"
    assert bad.dead_letter.source_topic == "t.ad.impressions" and bad.dead_letter.offset == 7
    assert "field 'ts'" in bad.dead_letter.error and bad.dead_letter.raw == b"{}"


async def test_a_batch_write_that_fails_with_a_bug_stops_the_commits_after_it() -> None:
    """A bug in a batch's write is raised (not retried as "store down"); nothing is committed
    after the lost batch (its offsets would pass it), until the worker restarts from Redis."""
    sink = _BuggySink()
    pipe = _pipeline(_Redis(ConnectionError(), times=0), sink)
    pipe.caught_up = lambda topic, partition, last: True
    await pipe.feed([_record(pipe)])
    with pytest.raises(KeyError):
        await asyncio.wait_for(pipe.flush(), timeout=2.0)
    assert sink.calls == 1
    event = impression("i2", 2.0)
    later = RawRecord(pipe.inputs[0], 0, 1, encode(event), int(event.ts.timestamp() * 1000))
    with pytest.raises(StoreError, match="until the worker restarts") as info:
        await pipe.feed([later])
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(StoreError, match="until the worker restarts"):
        await pipe.flush()
    assert sink.calls == 1


async def test_the_faust_engine_crashes_the_worker_once_the_pipeline_is_broken() -> None:
    """A broken pipeline (a batch write failed for good) refuses every later feed; the Faust
    intake must not retry that feed every second for ever (a stall): it crashes the app, so the
    worker exits non-zero and its supervisor restarts it from what Redis holds."""
    from types import SimpleNamespace
    from unittest.mock import AsyncMock

    from streams.engine_faust import BatchConsumer
    from streams.pipeline import PipelineBroken

    calls: list[int] = []

    async def feed(batch: list[object]) -> None:
        calls.append(1)
        raise PipelineBroken("a batch write failed (KeyError: 'x'); nothing more is committed")

    crash = AsyncMock()
    fake = SimpleNamespace(
        app=SimpleNamespace(consumer_generation_id=1, crash=crash), flow_active=True, sleep=AsyncMock()
    )
    await asyncio.wait_for(BatchConsumer._deliver(fake, feed, [object()]), 5)  # type: ignore[arg-type]
    assert calls == [1] and crash.await_count == 1
    assert isinstance(crash.await_args.args[0], PipelineBroken)


def test_the_worker_reads_its_fetch_sizes_from_the_settings(tmp_path: Path) -> None:
    from streams.app import create_app

    s = Settings(state_dir=tmp_path, streams={"fetch_records": 123, "fetch_bytes": 65_536})
    app = create_app(s)
    assert app.conf.broker_max_poll_records == 123 and app.conf.consumer_max_fetch_size == 65_536


def test_the_pipeline_judges_event_times_as_ahead_of_record_does() -> None:
    """The feed's shortcut (record time not after the feed began, event within the skew of it)
    decides every record as `ahead_of_record` does, with its dead letter otherwise."""
    import time

    from streams.ingest import ahead_of_record

    pipe = _pipeline(_Redis(ConnectionError(), times=0))
    skew = pipe.max_skew_s
    now = time.time()
    for event_s in (now - 86400, now - 1, now, now + skew - 1, now + skew + 5, now + 3 * skew):
        event = impression("i1", 0.0).model_copy(update={"ts": datetime.fromtimestamp(event_s, tz=UTC)})
        raw = encode(event)
        for record_s in (None, now - 2 * skew, now - 10, now - 0.001, now + 10, now + 2 * skew):
            ts_ms = 0 if record_s is None else int(record_s * 1000)
            rec = RawRecord(pipe.inputs[0], 0, 5, raw, ts_ms)
            got = pipe._judge("ad.impressions", rec, now)
            want = ahead_of_record(event, rec.topic, 0, 5, raw, ts_ms, skew)
            if want is None:
                assert not isinstance(got, Invalid) and got == (event, event.ts.timestamp())
            else:
                assert isinstance(got, Invalid) and got.reason == "future_timestamp" == want.reason
                assert got.dead_letter.event_id == want.dead_letter.event_id


def test_the_faust_worker_runs_on_uvloop_as_the_aiokafka_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvloop

    from streams import app as app_mod

    class Started(Exception):
        pass

    policies = []

    def create_app(settings: Settings) -> None:
        policies.append(asyncio.get_event_loop_policy())
        raise Started

    monkeypatch.setattr(app_mod, "create_app", create_app)
    before = asyncio.get_event_loop_policy()
    try:
        with pytest.raises(Started):
            app_mod.run_worker(Settings())
    finally:
        asyncio.set_event_loop_policy(before)
    assert isinstance(policies[0], uvloop.EventLoopPolicy)
