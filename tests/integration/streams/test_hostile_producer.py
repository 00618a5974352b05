"""A hostile producer: every class of bad record on every input topic of the worker, among valid
traffic, and every message accounted for — in ClickHouse (valid, once per event_id) or in ad.dlq
(invalid, with its topic, partition and offset) — while the worker keeps going.

Classes: oversize (800 KB), garbage bytes, not UTF-8, unknown fields, wrong types, missing
fields, floats finite in float64 but not in float32 (1e39) and beyond the money bound (1.7e308),
events in 150 distinct far-past months (valid: into ClickHouse, in INSERT blocks of ≤ 100 months),
and duplicates (the same record produced twice: ClickHouse keeps one row, Redis applies it once).
"""

from __future__ import annotations

import asyncio
import json
import random
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from streams_it import Worker, consume_all, wait_for
from test_streams_worker import all_applied, end_offsets, simulate

from schemas import topics
from schemas.clients import clickhouse_client, clickhouse_database
from schemas.codec import decode, encode, key_of, topic_of
from schemas.events import Conversion, DeadLetter, Impression, Message
from schemas.settings import Settings
from schemas.signing import event_key, seal

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.clickhouse, pytest.mark.timeout(300)]

TABLE = {
    topics.IMPRESSIONS: "impressions",
    topics.CLICKS: "clicks",
    topics.DWELL: "dwell",
    topics.CONVERSIONS: "conversions",
    topics.CATALOG: "ads",
}
FLOATS = {  # per topic: a float field and the model holding it
    topics.IMPRESSIONS: "price",
    topics.CONVERSIONS: "value",
    topics.CATALOG: "bid",
}


def hostile(topic: str, good: dict[str, Any], rng: random.Random) -> list[tuple[str, bytes]]:
    """(class, bytes) of every bad record for one input topic, built from one valid event."""
    out = [
        ("oversize", json.dumps({**good, "title": "x" * 800_000}).encode()),
        ("garbage", bytes(rng.randrange(256) for _ in range(64))),
        ("not_utf8", b'{"event_id": "\xff\xfe"}'),
        ("unknown_field", json.dumps({**good, "admin": True}).encode()),
        ("wrong_type", json.dumps({**good, "event_id": 12345}).encode()),
        ("missing_field", json.dumps({k: v for k, v in good.items() if k != "ts"}).encode()),
        ("json_array", b"[1, 2, 3]"),
        ("empty", b""),
    ]
    if topic in FLOATS:
        out.append(("float32_inf", json.dumps({**good, FLOATS[topic]: 1e39}).encode()))
        out.append(("money_overflow", json.dumps({**good, FLOATS[topic]: 1.7e308}).encode()))
    if topic == topics.DWELL:
        out.append(("int_overflow", json.dumps({**good, "dwell_ms": 10**40}).encode()))
    return out


def far_past(e: Message, n: int, key: bytes) -> list[Message]:
    """`n` copies of a valid event, each in its own month from January 2000 on (signed anew)."""
    return [
        seal(
            e.model_copy(
                update={
                    "event_id": f"past-{e.event_id}-{i}",
                    "ts": datetime(2000 + i // 12, 1 + i % 12, 2, tzinfo=UTC),
                }
            ),
            key,
        )
        for i in range(n)
    ]


def produce_all(s: Settings, records: list[tuple[str, bytes | None, bytes]]) -> list[tuple[str, int, int]]:
    """Produce in order; (physical topic, partition, offset) of each record."""
    from aiokafka import AIOKafkaProducer

    async def go() -> list[tuple[str, int, int]]:
        p = AIOKafkaProducer(bootstrap_servers=s.kafka.bootstrap, acks="all", linger_ms=5)
        await p.start()
        try:
            futs = [await p.send(topics.topic_name(t, s.topic_prefix), value=v, key=k) for t, k, v in records]
            metas = await asyncio.gather(*futs)
        finally:
            await p.stop()
        return [(m.topic, m.partition, m.offset) for m in metas]

    return asyncio.run(go())


def stored_ids(s: Settings) -> dict[str, tuple[set[str], int]]:
    """Per table: the event ids read with FINAL, and the FINAL row count."""
    c = clickhouse_client(s, clickhouse_database(s))
    try:
        out = {}
        for table in TABLE.values():
            rows = c.execute(f"SELECT event_id FROM {table} FINAL")
            out[table] = ({r[0] for r in rows}, len(rows))
        return out
    finally:
        c.disconnect()


@pytest.mark.parametrize("engine", ["faust", "aiokafka"])
def test_every_hostile_record_is_dead_lettered_and_every_valid_one_stored(
    deployment: Settings, tmp_path: Any, engine: str
) -> None:
    s = deployment
    rng = random.Random(14)
    catalog, valid = simulate(1500, seed=14, key=event_key(s))
    imps = [e for e in valid if isinstance(e, Impression)]
    valid += [  # the simulator's open loop has few conversions: some of ours
        Conversion(
            event_id=f"cv-{i}", ts=imp.ts, user_id=imp.user_id, campaign_id=imp.campaign_id,
            advertiser_id=imp.advertiser_id, value=12.5, ad_id=imp.ad_id,
        )
        for i, imp in enumerate(imps[:30])
    ]  # fmt: skip
    by_topic: dict[str, Message] = {topic_of(e): e for e in valid}
    assert set(by_topic) == set(TABLE) - {topics.CATALOG}
    valid = [
        *valid,
        *far_past(by_topic[topics.IMPRESSIONS], 150, event_key(s)),
        *far_past(by_topic[topics.CONVERSIONS], 20, event_key(s)),
    ]
    records: list[tuple[str, bytes | None, bytes]] = [(topic_of(e), key_of(e), encode(e)) for e in valid]
    expect_valid = [True] * len(records)
    for i in sorted(rng.sample(range(len(records)), 40), reverse=True):  # duplicates, right after
        records.insert(i + 1, records[i])
        expect_valid.insert(i + 1, True)
    bad_classes: list[str] = []
    for topic, e in [*by_topic.items(), (topics.CATALOG, catalog[0])]:
        good = json.loads(encode(e))
        for cls, raw in hostile(topic, good, rng):
            at = rng.randrange(len(records) + 1)
            key = key_of(e) if topic != topics.CATALOG else b"hostile"
            records.insert(at, (topic, key, raw))
            expect_valid.insert(at, False)
            bad_classes.append(f"{topic}:{cls}")
    # the catalog first (the worker reads it to its end before user events), then the rest
    is_cat = [t == topics.CATALOG for t, _, _ in records]
    cat_records = [(topics.CATALOG, key_of(a), encode(a)) for a in catalog]
    order = [*cat_records, *(r for r, c in zip(records, is_cat, strict=True) if c)]
    order += [r for r, c in zip(records, is_cat, strict=True) if not c]
    flags = [True] * len(cat_records) + [v for v, c in zip(expect_valid, is_cat, strict=True) if c]
    flags += [v for v, c in zip(expect_valid, is_cat, strict=True) if not c]
    where = produce_all(s, order)
    ends = end_offsets(s)

    worker = Worker(s, tmp_path / "worker.log", engine)
    worker.start()
    r = redis.Redis.from_url(s.redis.url)
    n_bad = flags.count(False)
    try:
        wait_for(lambda: all_applied(r, s, ends), 180, "every record applied", worker)
        dlq = [decode(DeadLetter, rec.value) for rec in consume_all(s, topics.DLQ, expect=n_bad, idle_s=5.0)]
        assert worker.alive(), worker.tail()
    finally:
        r.close()
        worker.stop()
    letters = {(d.source_topic, d.partition, d.offset): d for d in dlq if isinstance(d, DeadLetter)}
    stored = stored_ids(s)
    missing, wrongly_dead = [], []
    for (topic, _key, raw), ok, pos in zip(order, flags, where, strict=True):
        if ok:
            eid = json.loads(raw)["event_id"]
            if eid not in stored[TABLE[topic]][0]:
                missing.append((topic, eid))
            if pos in letters:
                wrongly_dead.append(pos)
        elif pos not in letters:
            missing.append((topic, raw[:60]))
    assert not missing, f"{len(missing)} records neither stored nor dead-lettered: {missing[:5]}"
    assert not wrongly_dead, wrongly_dead[:5]
    assert len(letters) == n_bad == len(bad_classes), (len(letters), n_bad)
    # every event once: FINAL rows == distinct ids == the valid events (duplicates collapse)
    want = {"ads": {a.event_id for a in catalog}}
    for e in valid:
        want.setdefault(TABLE[topic_of(e)], set()).add(e.event_id)
    for table, ids in want.items():
        assert stored[table][0] == ids, table
        assert stored[table][1] == len(ids), (table, stored[table][1], len(ids))
    # dead letters always fit the producer; the oversize ones say what they cut
    assert all(len(encode(d)) < 1024 * 1024 for d in letters.values())
    cut = [d for d in letters.values() if d.raw_size is not None]
    assert len(cut) == len(TABLE) and all(d.raw_sha256 and "truncated" in d.error for d in cut)
