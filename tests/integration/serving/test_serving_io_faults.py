"""The replica's I/O under faults, on the real Redis and broker (issue 14: H8, M4, M5, M6, M7, M9)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from schemas import codec, topics
from schemas.events import Click, Impression
from schemas.settings import Settings
from serving.io import FCAP_GRACE_S, ImpressionSink, RedisIO, day_of, fcap_expiry, fcap_key, follow

pytestmark = [pytest.mark.redis]

NOW = datetime.now(UTC)


def imp(user: str, ad: str, n: int = 0) -> Impression:
    return Impression(
        event_id=f"r{n}/{ad}", ts=NOW, user_id=user, request_id=f"r{n}", ad_id=ad, campaign_id="c1",
        advertiser_id="v1", slot="feed", position=0, price=0.5,
    )  # fmt: skip


async def _connected(sink: ImpressionSink) -> ImpressionSink:
    """`sink` started, once its producer has connected (at most 30 s)."""
    await sink.start()
    deadline = time.monotonic() + 30
    while sink.producer is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return sink


async def _consume(stack: Settings, topic: str, n: int) -> tuple[list[int], list[tuple[int, bytes, bytes]]]:
    """The topic's partitions and its records from the start, (partition, key, value), until `n`
    came (or 20 s passed)."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=stack.kafka.bootstrap, auto_offset_reset="earliest", group_id=None
    )
    await consumer.start()
    got: list[tuple[int, bytes, bytes]] = []
    try:
        parts = sorted(consumer.partitions_for_topic(topic) or ())
        end = time.monotonic() + 20
        while len(got) < n and time.monotonic() < end:
            batch = await consumer.getmany(timeout_ms=500)
            got += [(tp.partition, r.key, r.value) for tp, recs in batch.items() for r in recs]
    finally:
        await consumer.stop()
    return parts, got


def _isolated(stack: Settings, **extra: object) -> Settings:
    run = uuid.uuid4().hex[:6]
    return Settings(
        **{
            **stack.model_dump(),
            "redis_prefix": f"{stack.redis_prefix}io{run}:",
            "topic_prefix": f"{stack.topic_prefix}io{run}.",
            **extra,
        }
    )


# -- H8: per-user keys ---------------------------------------------------------------------
def test_per_user_keys_are_bounded_and_expire_with_their_day(stack: Settings, redis_client: object) -> None:
    """Random user ids cost one small hash each, gone an hour after their UTC day; spend is one
    hash per day for all campaigns, never per user."""
    s = _isolated(stack)
    io = RedisIO(s, None)
    users = [f"user-{i}-" + "x" * 100 for i in range(50)]

    async def run() -> None:
        for u in users:
            io.record(u, NOW, [imp(u, "a1")], [0.1])
        await io.flush()
        await io.client.aclose()

    asyncio.run(run())
    r = redis_client
    keys = sorted(k.decode() for k in r.scan_iter(match=f"{s.redis_prefix}*", count=1000))  # type: ignore[attr-defined]
    fcap = [k for k in keys if ":fcap:" in k]
    assert len(fcap) == len(users) and len(keys) == len(users) + 1  # + the day's spend hash
    assert all(len(k) == len(s.redis_prefix) + len("fcap:yyyymmdd:") + 32 for k in fcap)
    expiry = fcap_expiry(day_of(NOW))
    for k in fcap:
        ttl = r.ttl(k)  # type: ignore[attr-defined]
        assert 0 < ttl <= expiry - time.time() + 1
    assert expiry - time.time() <= 24 * 3600 + FCAP_GRACE_S
    assert r.ttl(f"{s.redis_prefix}spend:{day_of(NOW)}") > 0  # type: ignore[attr-defined]
    assert fcap_key(s.redis_prefix, day_of(NOW), users[0]) in fcap


# -- M6: a partial EXEC failure is not re-applied ------------------------------------------
def test_partially_failed_exec_never_double_counts(stack: Settings, redis_client: object) -> None:
    """Inside MULTI/EXEC one command can fail (WRONGTYPE) while the others apply: the next
    flush must not send the applied increments again."""
    s = _isolated(stack)
    io = RedisIO(s, None)
    r = redis_client
    day = day_of(NOW)
    r.set(fcap_key(s.redis_prefix, day, "broken"), "not a hash")  # type: ignore[attr-defined]

    async def run() -> tuple[int, int]:
        io.record("good", NOW, [imp("good", "a1")], [0.5])
        io.record("broken", NOW, [imp("broken", "a1")], [0.5])
        first = await io.flush()
        second = await io.flush()
        await io.client.aclose()
        return first, second

    first, second = asyncio.run(run())
    assert first > 0 and second == 0  # nothing left to retry
    good = r.hgetall(fcap_key(s.redis_prefix, day, "good"))  # type: ignore[attr-defined]
    assert {k.decode(): int(v) for k, v in good.items()} == {"a1": 1}
    spend = r.hget(f"{s.redis_prefix}spend:{day}", "c1")  # type: ignore[attr-defined]
    assert float(spend) == pytest.approx(1.0)
    assert io.dropped == 1


# -- M4: the pinned weights travel with the pin ----------------------------------------------
def test_pin_carries_the_pinned_weights(stack: Settings) -> None:
    from schemas.delta import empty_state, full_parts, make_delta

    s = _isolated(stack)
    io = RedisIO(s, None)
    st = empty_state("feed/adv:x", "v0", {"head": (4, 1)}, 2)
    snap = make_delta(st, full_parts(st.tensors, 2), 3, snapshot=True)

    async def run() -> None:
        await io.set_pin("feed/adv:x", 3, snap)
        assert await io.pins() == {"feed/adv:x": 3}
        got = await io.pin_snapshots(["feed/adv:x", "other"])
        assert got["other"] is None and got["feed/adv:x"] == snap
        assert await io.clear_pin("feed/adv:x")
        assert await io.pins() == {} and (await io.pin_snapshots(["feed/adv:x"]))["feed/adv:x"] is None
        await io.client.aclose()

    asyncio.run(run())


# -- M5: background loops survive errors ---------------------------------------------------
def test_background_loops_restart_and_housekeeping_survives_redis_timeouts() -> None:
    """A loop that dies is logged, counted and restarted; a housekeeping step that hits a Redis
    timeout is counted and the loop goes on."""
    import redis.exceptions

    from serving.loops import ReplicaLoops
    from serving.metrics import ServingMetrics

    class Loops(ReplicaLoops):
        def __init__(self) -> None:
            # supervision and the housekeeping loop read only settings and metrics
            unused: Any = None
            super().__init__(
                Settings(canary={"eval_s": 100.0}),
                ServingMetrics(),
                rank=unused,
                catalog=unused,
                pipe=unused,
                towers=None,
                applier=unused,
                canary=unused,
                redis=unused,
            )
            self.runs = 0
            self.steps = 0

        async def dies_twice(self) -> None:
            self.runs += 1
            if self.runs <= 2:
                raise TimeoutError("Redis timed out")
            await asyncio.sleep(3600)

        async def _housekeeping_step(self, day, next_eval):  # type: ignore[no-untyped-def]
            self.steps += 1
            if self.steps <= 2:
                raise redis.exceptions.TimeoutError("Timeout reading from socket")
            return day, next_eval

    async def run() -> Loops:
        loops = Loops()
        loops._supervise("flaky", loops.dies_twice)
        loops._supervise("housekeeping", loops._housekeeping)
        await asyncio.sleep(4.5)
        for t in loops._tasks.values():
            t.cancel()
        return loops

    loops = asyncio.run(run())
    assert loops.runs == 3
    assert loops.metrics.task_restarts.labels("flaky")._value.get() == 2
    assert loops.steps >= 3  # it kept stepping after two timeouts
    assert loops.metrics.task_errors.labels("housekeeping")._value.get() == 2
    assert loops.metrics.task_restarts.labels("housekeeping")._value.get() == 0


# -- M7: impressions when Kafka is down at start ---------------------------------------------
class _Gate:
    """A TCP forwarder to the broker that refuses connections until opened (Kafka 'down')."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.server: asyncio.AbstractServer | None = None

    async def open(self) -> None:
        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            writer.close()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            up_r, up_w = await asyncio.open_connection(*self.target)
            await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

        self.server = await asyncio.start_server(handle, "127.0.0.1", self.port)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


@pytest.mark.kafka
def test_impressions_wait_for_a_broker_that_is_down_at_start_and_count_on_delivery(stack: Settings) -> None:

    from deploy.stack import create_topics

    host, port = stack.kafka.bootstrap.split(",")[0].rsplit(":", 1)
    gate = _Gate((host, int(port)))
    s = _isolated(
        stack,
        kafka={**stack.kafka.model_dump(), "bootstrap": f"127.0.0.1:{gate.port}"},
        serving={**stack.serving.model_dump(), "impressions_pending": 50},
    )
    create_topics(_isolated(stack, topic_prefix=s.topic_prefix))
    outcomes: dict[str, int] = {}

    def count(outcome: str, n: int) -> None:
        outcomes[outcome] = outcomes.get(outcome, 0) + n

    async def run() -> list[bytes]:
        sink = ImpressionSink(s, count)
        t0 = time.monotonic()
        await sink.start()
        assert time.monotonic() - t0 < 1.0  # start never waits for the broker
        sink.emit([imp("u", f"a{i}", i) for i in range(40)])  # queued while the broker is "down"
        sink.emit([imp("u", f"b{i}", i) for i in range(20)])  # 10 over the bound: dropped
        await asyncio.sleep(1.5)
        assert outcomes == {"dropped": 10} and sink.pending == 50 and sink.connect_attempts >= 1
        await gate.open()
        deadline = time.monotonic() + 30
        while outcomes.get("sent", 0) < 50 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        sink.emit([imp("u", f"c{i}", i) for i in range(5)])
        await sink.stop()  # flushes what is queued
        try:
            _, got = await _consume(stack, topics.topic_name(topics.IMPRESSIONS, s.topic_prefix), 55)
        finally:
            await gate.close()
        return [value for _, _, value in got]

    got = asyncio.run(run())
    assert outcomes == {"dropped": 10, "sent": 55}
    assert len(got) == 55
    assert {codec.decode(Impression, v).ad_id for v in got} >= {"a0", "a39", "b9", "c4"}  # type: ignore[union-attr]


@pytest.mark.kafka
def test_impressions_of_one_linger_window_go_to_the_producer_without_waiting_for_acks(
    stack: Settings,
) -> None:
    """Every impression of a linger window goes to the producer in one closed record batch per
    partition, handed over without waiting for the previous window's acknowledgements (it used to
    await every acknowledgement first, so with a linger each request's impressions went in a
    produce request of their own: ~1 ms of replica CPU each; then each record went through
    `send` on its own: a coroutine, a future and an accumulator entry each, ~20 µs a record)."""
    from aiokafka.partitioner import DefaultPartitioner

    from deploy.stack import create_topics

    s = _isolated(stack, serving={**stack.serving.model_dump(), "impression_linger_ms": 400})
    create_topics(s)
    events: list[tuple[str, float, int]] = []
    parts: list[int] = []

    async def run() -> None:
        sink = await _connected(ImpressionSink(s, lambda what, n: events.append((what, time.monotonic(), n))))
        parts.extend(sorted(await sink.producer.partitions_for(sink.topic)))
        real_send = sink.producer.send_batch

        async def send_batch(batch: Any, *args: object, **kwargs: object) -> object:
            events.append(("handed", time.monotonic(), batch.record_count()))
            return await real_send(batch, *args, **kwargs)

        sink.producer.send_batch = send_batch
        sink.emit([imp("u1", f"a{i}", i) for i in range(10)])
        await asyncio.sleep(0.1)
        assert sink.pending == 10  # in the window (400 ms), not handed yet
        sink.emit([imp("u2", f"b{i}", i) for i in range(10)])
        await asyncio.sleep(0.1)
        await sink.stop()

    asyncio.run(run())
    handed = [(t, n) for name, t, n in events if name == "handed"]
    sent = [(t, n) for name, t, n in events if name == "sent"]
    pick = DefaultPartitioner()
    partitions = {pick(user, parts, parts) for user in (b"u1", b"u2")}
    assert len(handed) == len(partitions)  # one batch per partition for the whole window
    assert sum(n for _, n in handed) == 20 and sum(n for _, n in sent) == 20
    assert max(t for t, _ in handed) < min(t for t, _ in sent)  # all handed before any ack


@pytest.mark.kafka
def test_a_window_larger_than_a_record_batch_goes_in_several_all_delivered_in_order(
    stack: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window whose impressions of one partition pass the batch size goes in as many full
    batches as it takes, each counted by its own acknowledgement: every impression delivered
    once, in the order served."""

    import serving.io as sio
    from deploy.stack import create_topics

    monkeypatch.setattr(sio, "IMPRESSION_BATCH_BYTES", 4096)  # ~8 impressions a batch
    s = _isolated(stack)
    create_topics(s)
    topic = topics.topic_name(topics.IMPRESSIONS, s.topic_prefix)
    outcomes: dict[str, int] = {}
    sizes: list[int] = []

    def count(outcome: str, n: int) -> None:
        outcomes[outcome] = outcomes.get(outcome, 0) + n

    async def run() -> list[bytes]:
        sink = await _connected(ImpressionSink(s, count))
        real_send = sink.producer.send_batch

        async def send_batch(batch: Any, *args: object, **kwargs: object) -> object:
            sizes.append(batch.record_count())
            return await real_send(batch, *args, **kwargs)

        sink.producer.send_batch = send_batch
        sink.emit([imp("one-user", f"a{i}", i) for i in range(100)])
        await sink.stop()
        return [value for _, _, value in (await _consume(stack, topic, 100))[1]]

    got = asyncio.run(run())
    assert len(sizes) > 5 and sum(sizes) == 100  # several batches, every impression in one
    assert outcomes == {"sent": 100}
    assert [codec.decode(Impression, v).ad_id for v in got] == [f"a{i}" for i in range(100)]  # type: ignore[union-attr]


@pytest.mark.kafka
def test_each_users_impressions_go_to_the_partition_the_producer_would_pick(stack: Settings) -> None:
    """The sink names each impression's partition itself (the producer's murmur2 of the user
    key, remembered per user): every impression lands where `send` without a partition would
    have put it, across the topic's partitions, all of them delivered."""
    from aiokafka.partitioner import DefaultPartitioner

    from deploy.stack import create_topics

    s = _isolated(stack)
    create_topics(s)
    topic = topics.topic_name(topics.IMPRESSIONS, s.topic_prefix)
    outcomes: dict[str, int] = {}

    def count(outcome: str, n: int) -> None:
        outcomes[outcome] = outcomes.get(outcome, 0) + n

    async def run() -> tuple[list[int], list[tuple[int, bytes, bytes]]]:
        sink = ImpressionSink(s, count)
        await sink.start()
        for round_ in range(3):  # the same users again: their remembered partitions
            sink.emit([imp(f"user-{u}", f"a{round_}", u) for u in range(40)])
            await asyncio.sleep(0.05)
        await sink.stop()
        return await _consume(stack, topic, 120)

    parts, got = asyncio.run(run())
    assert outcomes == {"sent": 120} and len(got) == 120 and len(parts) > 1
    pick = DefaultPartitioner()
    assert all(p == pick(key, parts, parts) for p, key, _ in got)
    assert len({p for p, _, _ in got}) > 1  # 40 users spread over the topic's partitions
    assert all(codec.decode(Impression, v).user_id.encode() == key for _, key, v in got)  # type: ignore[union-attr]


@pytest.mark.kafka
def test_impressions_being_handed_to_the_producer_are_pending_and_counted_when_stop_cuts_them(
    stack: Settings,
) -> None:
    """Impressions the sender took from the queue count as pending until the producer has them
    (they used to count nowhere while the hand-over waited: `pending` read 0 with 10 not yet
    sent, and the bound let that many more in), and those a stop cuts off mid-hand-over are
    counted dropped (they used to vanish from every count)."""
    from deploy.stack import create_topics

    s = _isolated(stack)
    create_topics(s)
    outcomes: dict[str, int] = {}
    hold = asyncio.Event()
    first: list[int] = []

    def count(outcome: str, n: int) -> None:
        outcomes[outcome] = outcomes.get(outcome, 0) + n

    async def run() -> int:
        sink = await _connected(ImpressionSink(s, count))
        real_send = sink.producer.send_batch

        async def send_batch(batch: Any, *args: object, **kwargs: object) -> object:
            if first:  # a producer that stops taking after one batch (a hung broker)
                await hold.wait()
            first.append(batch.record_count())
            return await real_send(batch, *args, **kwargs)

        sink.producer.send_batch = send_batch
        # users on several partitions: one batch each
        sink.emit([imp(f"user-{i}", f"a{i}", i) for i in range(10)])
        await asyncio.sleep(0.3)
        pending = sink.pending
        await sink.stop(timeout_s=0.3)
        return pending

    pending = asyncio.run(run())
    assert pending == 10 and 0 < first[0] < 10
    assert outcomes == {"sent": first[0], "dropped": 10 - first[0]}


# -- M9: no replay from offset 0 on reconnect ------------------------------------------------
@pytest.mark.kafka
def test_follow_resumes_where_it_left_off_and_deltas_replay_a_window_only(stack: Settings) -> None:
    from aiokafka import AIOKafkaProducer

    from deploy.stack import create_topics

    s = _isolated(stack)
    create_topics(s)
    topic = topics.topic_name(topics.CLICKS, s.topic_prefix)

    def click(i: int) -> bytes:
        return codec.encode(
            Click(event_id=f"c{i}", ts=NOW, user_id="u", impression_id=f"i{i}", ad_id="a", campaign_id="c")
        )

    async def consume(until: int, **kw: object) -> list[str]:
        seen: list[str] = []

        def handle(msg: object) -> None:
            seen.append(msg.event_id)  # type: ignore[attr-defined]

        task = asyncio.create_task(follow(s, topics.CLICKS, handle, True, lambda _: None, **kw))  # type: ignore[arg-type]
        end = time.monotonic() + 20
        while len(seen) < until and time.monotonic() < end:
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # anything extra (a replay) would arrive now
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return seen

    async def run() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=stack.kafka.bootstrap)
        await producer.start()
        old_ms = int((time.time() - 7200) * 1000)
        for i in range(5):  # two hours old
            await producer.send_and_wait(topic, click(i), key=b"u", timestamp_ms=old_ms)
        for i in range(5, 10):
            await producer.send_and_wait(topic, click(i), key=b"u")
        positions: dict[int, int] = {}
        first = await consume(10, positions=positions)
        assert first == [f"c{i}" for i in range(10)]
        for i in range(10, 13):
            await producer.send_and_wait(topic, click(i), key=b"u")
        again = await consume(3, positions=positions)  # a reconnect: only what is new
        assert again == ["c10", "c11", "c12"]
        window = await consume(8, replay_s=3600.0)  # a fresh start one hour back: the old 5 skipped
        assert window == [f"c{i}" for i in range(5, 13)]
        await producer.stop()

    asyncio.run(run())


# -- M2: adapter snapshots expire ----------------------------------------------------------
def test_adapter_snapshots_expire_unless_rewritten(stack: Settings, redis_client: object) -> None:
    import redis.asyncio as aredis

    from schemas.delta import empty_state, full_parts, make_delta
    from trainers.snapshots import SnapshotStore, meta_key, seq_key, snapshot_key

    s = _isolated(stack)
    st = empty_state("adv:gone", "v0", {"head": (4, 1)}, 2)
    snap = make_delta(st, full_parts(st.tensors, 2), 0, snapshot=True)

    async def run() -> None:
        client = aredis.Redis.from_url(s.redis.url)
        store = SnapshotStore(client, s.redis_prefix, "in", ttl_s=1234)
        await store.reserve({"adv:gone": 0})
        await store.write([(snap, {0: 5})], {0: 5})
        await client.aclose()

    asyncio.run(run())
    r = redis_client
    for key in (snapshot_key(s.redis_prefix, "adv:gone"), meta_key(s.redis_prefix, "adv:gone")):
        assert 1200 < r.ttl(key) <= 1234  # type: ignore[attr-defined]
    assert r.ttl(seq_key(s.redis_prefix)) == -1  # type: ignore[attr-defined]  # seqs are never reused


# -- suites: hostile records on a replica's input topics -------------------------------------
@pytest.mark.kafka
def test_follow_counts_every_bad_record_and_goes_on(stack: Settings) -> None:
    """The hostile producer's classes on a topic a replica follows (garbage, not UTF-8, unknown
    field, wrong type, JSON array, empty value, a tombstone) and a message its handler raises
    on: each is counted once as invalid, every valid message is handled, nothing is re-read."""
    from aiokafka import AIOKafkaProducer

    from deploy.stack import create_topics

    s = _isolated(stack)
    create_topics(s)
    topic = topics.topic_name(topics.CLICKS, s.topic_prefix)

    def click(i: int) -> bytes:
        return codec.encode(
            Click(event_id=f"c{i}", ts=NOW, user_id="u", impression_id=f"i{i}", ad_id="a", campaign_id="c")
        )

    good = click(0)
    bad: list[bytes | None] = [
        bytes(range(7, 71)),
        b'{"event_id": "\xff\xfe"}',
        good.replace(b'"kind"', b'"admin":true,"kind"'),
        good.replace(b'"user_id":"u"', b'"user_id":7'),
        b"[1, 2, 3]",
        b"",
        None,
    ]
    values = [click(i) for i in range(3)] + bad + [click(i) for i in range(3, 6)]

    async def run() -> tuple[list[str], list[str]]:
        producer = AIOKafkaProducer(bootstrap_servers=stack.kafka.bootstrap)
        await producer.start()
        for v in values:
            await producer.send_and_wait(topic, v, key=b"u")
        await producer.stop()
        seen: list[str] = []
        invalid: list[str] = []

        def handle(msg: object) -> None:
            event_id = msg.event_id  # type: ignore[attr-defined]
            seen.append(event_id)
            if event_id == "c4":
                raise RuntimeError("a message this replica cannot use")

        task = asyncio.create_task(follow(s, topics.CLICKS, handle, True, invalid.append))  # type: ignore[arg-type]
        end = time.monotonic() + 20
        while len(seen) < 6 and time.monotonic() < end:
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)  # a reconnect (re-reading the topic) would show now
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return seen, invalid

    seen, invalid = asyncio.run(run())
    assert seen == [f"c{i}" for i in range(6)]
    assert len(invalid) == len(bad) + 1 and sum("handler failed" in why for why in invalid) == 1
