"""The streams worker end to end on the real broker, Redis and ClickHouse."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from typing import Any

import pytest
import redis
from streams_it import Worker, consume_all, free_port, produce, scrape, wait_for

from schemas import topics
from schemas.clients import clickhouse_client, clickhouse_database
from schemas.codec import decode, encode, key_of, topic_of
from schemas.events import AdCreative, DeadLetter, Message, TrainingExample
from schemas.settings import Settings
from schemas.signing import event_key
from schemas.user_record import read_user_state
from streams.in_memory import replay
from streams.state import same_state
from workloads.config import MarketConfig
from workloads.market import Market

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.clickhouse]

TABLE = {"Impression": "impressions", "Click": "clicks", "Dwell": "dwell", "Conversion": "conversions"}
USER_TOPICS = (topics.IMPRESSIONS, topics.CLICKS, topics.DWELL, topics.CONVERSIONS)


def simulate(n_user_events: int, seed: int, key: bytes | None) -> tuple[list[AdCreative], list[Message]]:
    """The simulator's history, signed with `key` (the stack's event key: the worker verifies it)."""
    market = Market(MarketConfig(seed=seed, n_users=400, n_ads=80, rate=20.0), signing_key=key)
    catalog: list[AdCreative] = []
    events: list[Message] = []
    for e in market.open_loop(n_user_events):
        if isinstance(e, AdCreative):
            catalog.append(e)
        else:
            events.append(e)
        if len(events) >= n_user_events:
            break
    return catalog, events


def malformed(valid: list[Message], n: int, rng: random.Random) -> list[tuple[str, bytes, bytes]]:
    """n invalid records of every kind: garbage, wrong types, unknown fields, bad ranges, naive ts."""
    out = []
    for i in range(n):
        e = rng.choice(valid)
        topic = topic_of(e)
        obj: dict[str, Any] = json.loads(encode(e))
        kind = i % 5
        if kind == 0:
            value = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
        elif kind == 1:
            obj["user_id"] = 12345
            value = json.dumps(obj).encode()
        elif kind == 2:
            obj["surprise"] = "field"
            value = json.dumps(obj).encode()
        elif kind == 3:
            obj["ts"] = "2026-01-01T00:00:00"  # no offset
            value = json.dumps(obj).encode()
        else:
            obj["event_id"] = ""  # out of range (min length 1)
            value = json.dumps(obj).encode()
        out.append((topic, f"bad{i}".encode(), value))
    return out


def user_partitions(s: Settings) -> list[Any]:
    """Every partition of the four user-event topics of `s` (aiokafka TopicPartitions)."""
    from aiokafka import TopicPartition

    return [
        TopicPartition(topics.topic_name(t, s.topic_prefix), p)
        for t in USER_TOPICS
        for p in range(s.kafka.topic_partitions or 8)
    ]


def end_offsets(s: Settings) -> dict[str, int]:
    """`{physical topic}:{partition}` → last offset, for every non-empty user-topic partition."""
    from aiokafka import AIOKafkaConsumer

    async def go() -> dict[str, int]:
        c = AIOKafkaConsumer(bootstrap_servers=s.kafka.bootstrap)
        await c.start()
        try:
            tps = user_partitions(s)
            ends = await c.end_offsets(tps)
        finally:
            await c.stop()
        return {f"{tp.topic}:{tp.partition}": off - 1 for tp, off in ends.items() if off > 0}

    return asyncio.run(go())


def applied(r: redis.Redis, s: Settings) -> dict[str, int]:
    raw = r.hgetall(f"{s.redis_prefix}streams:offsets")
    return {k.decode(): int(v) for k, v in raw.items() if not k.startswith(b"stream_ts:")}


def all_applied(r: redis.Redis, s: Settings, ends: dict[str, int]) -> bool:
    got = applied(r, s)
    return all(got.get(k, -1) >= v for k, v in ends.items())


def ch_counts(s: Settings) -> dict[str, tuple[int, int, int]]:
    """Per table: rows read with FINAL, distinct event ids, raw rows."""
    c = clickhouse_client(s, clickhouse_database(s))
    try:
        out = {}
        for t in TABLE.values():
            final = c.execute(f"SELECT count() FROM {t} FINAL")[0][0]
            uniq = c.execute(f"SELECT uniqExact(event_id) FROM {t}")[0][0]
            raw = c.execute(f"SELECT count() FROM {t}")[0][0]
            out[t] = (final, uniq, raw)
        return out
    finally:
        c.disconnect()


def produce_run(s: Settings, catalog: list[AdCreative], records: list[tuple[str, bytes, bytes]]) -> None:
    produce(s, [(topics.CATALOG, key_of(a), encode(a)) for a in catalog])
    produce(s, records)


def check_state(r: redis.Redis, s: Settings, expected: dict[str, Any]) -> None:
    mismatched = []
    for uid, want in expected.items():
        got = read_user_state(r, s.redis_prefix, uid)
        if got is None or not same_state(got, want, rtol=1e-5, atol=1e-6):
            mismatched.append((uid, _brief(got), _brief(want)))
    assert not mismatched, f"{len(mismatched)} of {len(expected)} users differ (got, want): {mismatched[:3]}"


def _brief(st: Any) -> Any:
    if st is None:
        return None
    return (
        st.events,
        st.impressions,
        st.clicks,
        st.late,
        st.sessions,
        round(st.last_ts, 3),
        st.top_intents(2),
    )


@pytest.mark.parametrize("engine", ["faust", "aiokafka"])
def test_ten_thousand_events_with_one_percent_malformed(
    deployment: Settings, worker: Worker, engine: str
) -> None:
    s = deployment
    worker.engine = engine
    port = free_port()
    worker.s = s.model_copy(update={"metrics": s.metrics.model_copy(update={"port": port})})
    rng = random.Random(7)
    catalog, valid = simulate(9_900, seed=11, key=event_key(s))
    bad = malformed(valid, 100, rng)
    records: list[tuple[str, bytes, bytes]] = [(topic_of(e), key_of(e), encode(e)) for e in valid]
    for rec in bad:  # interleave the malformed ones at random places
        records.insert(rng.randrange(len(records) + 1), rec)
    assert len(records) == 10_000
    # producer retries: 50 valid events sent a second time right after the first
    for i in sorted(rng.sample(range(len(records)), 50), reverse=True):
        if not records[i][1].startswith(b"bad"):
            records.insert(i + 1, records[i])
    produce_run(s, catalog, records)
    ends = end_offsets(s)

    worker.start()
    r = redis.Redis.from_url(s.redis.url)
    try:
        wait_for(lambda: all_applied(r, s, ends), 120, "every record applied", worker)
        # ClickHouse holds exactly the valid events
        want = Counter(TABLE[type(e).__name__] for e in valid)
        counts = ch_counts(s)
        for table, n in want.items():
            assert counts[table][:2] == (n, n), (table, counts[table], n)
        # ad.dlq holds exactly the malformed records, with where they came from
        dlq = [decode(DeadLetter, rec.value) for rec in consume_all(s, topics.DLQ, expect=100)]
        assert isinstance(dlq[0], DeadLetter)
        assert sorted(d.raw for d in dlq) == sorted(v for _, _, v in bad)  # type: ignore[attr-defined]
        assert len({(d.source_topic, d.partition, d.offset) for d in dlq}) == 100  # type: ignore[attr-defined]
        # Redis holds what the pure offline computation gives
        expected = replay([*catalog, *valid], s)
        check_state(r, s, expected.states)
        assert sum(st.events for st in expected.states.values()) == len(valid)
        # every example the worker emitted is the offline one; positives are all there
        got = [decode(TrainingExample, rec.value) for rec in consume_all(s, topics.TRAINING_EXAMPLES)]
        want_ex = {e.event_id: e for e in expected.examples}
        assert got and all(g == want_ex[g.event_id] for g in got)
        positives = {e.event_id for e in expected.examples if e.click}
        assert positives and positives <= {g.event_id for g in got}
        # the worker's metrics saw the same: 100 invalid by reason, every record in, batches
        metrics = scrape(port)
        invalid = {k: v for k, v in metrics.items() if k.startswith("adstream_streams_invalid_events_total{")}
        assert sum(invalid.values()) == 100 and len(invalid) >= 4, invalid
        ins = sum(v for k, v in metrics.items() if k.startswith("adstream_streams_events_in_total{"))
        assert ins >= len(records)
        assert metrics["adstream_streams_events_out_total{topic=ad.dlq}"] >= 100
        assert metrics["adstream_streams_batch_size_events_count{}"] > 0
        assert metrics["adstream_streams_join_events_total{outcome=duplicate}"] >= 1
        assert any(k.startswith("adstream_streams_lag_events{") for k in metrics)
    finally:
        r.close()


@pytest.mark.parametrize("engine", ["faust", "aiokafka"])
def test_crash_recovery_kill_9_mid_stream(deployment: Settings, worker: Worker, engine: str) -> None:
    s = deployment
    worker.engine = engine
    catalog, valid = simulate(30_000, seed=23, key=event_key(s))
    records = [(topic_of(e), key_of(e), encode(e)) for e in valid]
    produce_run(s, catalog, records)
    ends = end_offsets(s)
    total = len(records)

    worker.start()
    r = redis.Redis.from_url(s.redis.url)
    try:

        def progress() -> int:
            return sum(v + 1 for v in applied(r, s).values())

        # kill as soon as a few batches are in: the fast engine needs only seconds for all of it
        seen: list[int] = []

        def started() -> bool:
            seen.append(progress())
            return seen[-1] >= total * 0.05

        wait_for(started, 120, "5% applied", worker, every=0.02)
        worker.kill9()
        mid = progress()
        assert mid < total, f"the worker finished before it could be killed: {seen[-5:]} of {total}"
        worker.start()
        wait_for(lambda: all_applied(r, s, ends), 180, "every record applied after restart", worker)
        want = Counter(TABLE[type(e).__name__] for e in valid)
        counts = ch_counts(s)
        for table, n in want.items():
            assert counts[table][:2] == (n, n), (table, counts[table], n)
        expected = replay([*catalog, *valid], s)
        check_state(r, s, expected.states)
    finally:
        r.close()


@pytest.mark.parametrize("engine", ["aiokafka", "faust"])
def test_two_workers_share_the_partitions(
    deployment: Settings, worker: Worker, engine: str, tmp_path: Any
) -> None:
    """Two workers in one group: co-partitioned assignment, the same states as one worker."""
    s = deployment
    catalog, valid = simulate(20_000, seed=31, key=event_key(s))
    produce_run(s, catalog, [(topic_of(e), key_of(e), encode(e)) for e in valid])
    ends = end_offsets(s)
    ports = free_port(), free_port()
    second = Worker(
        s.model_copy(update={"metrics": s.metrics.model_copy(update={"port": ports[1]})}),
        tmp_path / "worker2.log",
        engine,
    )
    worker.s = s.model_copy(update={"metrics": s.metrics.model_copy(update={"port": ports[0]})})
    worker.engine = engine
    worker.start()
    second.start()
    r = redis.Redis.from_url(s.redis.url)
    try:
        wait_for(lambda: all_applied(r, s, ends), 180, "every record applied by two workers", worker)
        assert second.alive()

        def applied_by() -> list[float]:
            return [
                sum(v for k, v in scrape(p).items() if k.startswith("adstream_streams_batch_size_events_sum"))
                for p in ports
            ]

        # a batch's size is observed just after its Redis commit, so the last one may lag the offsets
        wait_for(lambda: sum(applied_by()) >= len(valid), 30, "both workers' batch metrics", worker)
        assert min(applied_by()) > 0, applied_by()
        want = Counter(TABLE[type(e).__name__] for e in valid)
        counts = ch_counts(s)
        for table, n in want.items():
            assert counts[table][:2] == (n, n), (table, counts[table], n)
        check_state(r, s, replay([*catalog, *valid], s).states)
    finally:
        second.stop()
        r.close()


def test_malformed_catalog_record_is_dead_lettered(deployment: Settings, worker: Worker) -> None:
    s = deployment
    worker.engine = "aiokafka"
    catalog, valid = simulate(200, seed=5, key=event_key(s))
    broken = encode(catalog[0]).replace(b'"bid":', b'"bid":-', 1)  # a negative bid
    produce(s, [(topics.CATALOG, b"bad-ad", broken)])
    produce_run(s, catalog, [(topic_of(e), key_of(e), encode(e)) for e in valid])
    worker.start()
    # the worker starts after this begins waiting (seconds, on a loaded machine): it returns at the
    # first dead letter, so only a failure waits the whole idle time
    dlq = [decode(DeadLetter, rec.value) for rec in consume_all(s, topics.DLQ, expect=1, idle_s=30)]
    assert len(dlq) == 1
    d = dlq[0]
    assert isinstance(d, DeadLetter)
    assert d.source_topic == topics.topic_name(topics.CATALOG, s.topic_prefix)
    assert d.raw == broken and "bid" in d.error
