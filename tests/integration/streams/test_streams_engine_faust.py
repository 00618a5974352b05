"""The Faust engine's batched intake (`streams.engine_faust`) on the real broker, Redis and ClickHouse.

Records reach the pipeline in whole fetches through Faust's own consumer and are acked with
"through" acks; these tests hold what that must keep: Faust's Kafka commits never pass what Redis
holds and do reach the end, and a rebalance (a second worker joining) and a kill -9 in the middle
of the stream (its partitions taken over by the other worker) still give every record exactly
once — the same ClickHouse rows and Redis state as one uninterrupted offline replay.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import pytest
import redis
from streams_it import Worker, wait_for
from test_streams_worker import (
    TABLE,
    all_applied,
    applied,
    ch_counts,
    check_state,
    end_offsets,
    produce_run,
    simulate,
    user_partitions,
)

from schemas.codec import encode, key_of, topic_of
from schemas.settings import Settings
from schemas.signing import event_key
from streams.in_memory import replay

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.clickhouse, pytest.mark.timeout(300)]


def kafka_committed(s: Settings) -> dict[str, int]:
    """`{topic}:{partition}` → the Faust worker group's committed offset (the next to read),
    fetched by a consumer of that group that assigns partitions itself (it does not join)."""
    from aiokafka import AIOKafkaConsumer

    async def go() -> dict[str, int]:
        c = AIOKafkaConsumer(
            bootstrap_servers=s.kafka.bootstrap,
            group_id=f"{s.topic_prefix}adstream-streams",
            enable_auto_commit=False,
        )
        await c.start()
        try:
            tps = user_partitions(s)
            c.assign(tps)
            out = {}
            for tp in tps:
                off = await c.committed(tp)
                if off is not None and off >= 0:
                    out[f"{tp.topic}:{tp.partition}"] = off
            return out
        finally:
            await c.stop()

    return asyncio.run(go())


def test_faust_commits_never_pass_redis_and_reach_the_end(deployment: Settings, worker: Worker) -> None:
    s = deployment
    catalog, valid = simulate(20_000, seed=41, key=event_key(s))
    produce_run(s, catalog, [(topic_of(e), key_of(e), encode(e)) for e in valid])
    ends = end_offsets(s)
    worker.engine = "faust"
    worker.start()
    r = redis.Redis.from_url(s.redis.url)
    samples = 0
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            kafka = kafka_committed(s)  # first Kafka, then Redis: Redis only grows meanwhile
            done = applied(r, s)
            ahead = {k: (off, done.get(k)) for k, off in kafka.items() if off > done.get(k, -1) + 1}
            assert not ahead, f"Kafka commits past Redis (committed, applied): {ahead}"
            samples += bool(kafka)
            # at the end Faust commits exactly what Redis holds (the broker's offsets may have gaps)
            if all_applied(r, s, ends) and all(kafka.get(k) == done[k] + 1 for k in ends):
                break
            assert worker.alive(), worker.tail()
            time.sleep(0.2)
        else:
            raise AssertionError(
                f"Kafka commits never reached Redis: {kafka_committed(s)} vs {applied(r, s)}"
            )
        assert samples >= 2  # commits were seen on the way, not only at the end
        counts = ch_counts(s)
        for table, n in Counter(TABLE[type(e).__name__] for e in valid).items():
            assert counts[table][:2] == (n, n), (table, counts[table], n)
    finally:
        r.close()


def test_a_rebalance_and_a_kill_9_mid_stream_keep_every_record_exactly_once(
    deployment: Settings, worker: Worker, tmp_path: Path
) -> None:
    """A second worker joins while the first is mid-stream (partitions revoked from the first,
    the merge's held records forgotten and read again by their new owner); then the first is
    killed mid-stream and the second takes all of them over from Redis's offsets."""
    s = deployment
    catalog, valid = simulate(40_000, seed=43, key=event_key(s))
    produce_run(s, catalog, [(topic_of(e), key_of(e), encode(e)) for e in valid])
    ends = end_offsets(s)
    total = sum(v + 1 for v in ends.values())
    second = Worker(s, tmp_path / "worker2.log", "faust")
    worker.engine = "faust"
    worker.start()
    r = redis.Redis.from_url(s.redis.url)

    def progress() -> int:
        return sum(v + 1 for v in applied(r, s).values())

    try:
        wait_for(lambda: progress() >= total * 0.02, 120, "2% applied", worker, every=0.02)
        second.start()  # a rebalance while the first worker is mid-stream
        mid = progress()
        wait_for(lambda: progress() >= mid + total * 0.05, 120, "progress after the join", worker, every=0.05)
        worker.kill9()  # mid-stream: the second worker takes every partition over
        assert progress() < total, "the stream ended before the kill; the test needs a longer one"
        wait_for(lambda: all_applied(r, s, ends), 180, "every record applied by the second worker", second)
        counts = ch_counts(s)
        for table, n in Counter(TABLE[type(e).__name__] for e in valid).items():
            assert counts[table][:2] == (n, n), (table, counts[table], n)
        check_state(r, s, replay([*catalog, *valid], s).states)
    finally:
        second.stop()
        r.close()
