"""The trainer against a real Redis that fails: retries, give-up, commits, refused snapshots.

Failures are real: `FlakyRedis` sends chosen calls to a redis-py client of a port where nothing
listens (connection refused) or where nothing answers (timeout), and every other call to the
real server.
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from prometheus_client import REGISTRY
from test_trainers_service import (
    ADAPTERS,
    _assert_unique_contiguous,
    _deltas,
    _examples,
    _produce,
    _replica_follow,
    _service,
)

from schemas import codec
from schemas.delta import full_parts, make_delta
from schemas.errors import StoreError
from schemas.events import AdapterDelta
from schemas.retry import Backoff
from schemas.settings import Settings
from trainers.service import TrainerService
from trainers.snapshots import SnapshotStore, check_snapshot, delta_w_norm

pytestmark = [pytest.mark.redis, pytest.mark.timeout(240)]
FAST = Backoff(first_s=0.01, max_s=0.1, give_up_s=30.0)


def _client(url: str, **kw: Any) -> Any:
    import redis.asyncio as aredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return aredis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **kw)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers (every command times out)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock.getsockname()[1]
    sock.close()


def _closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    sock.close()
    return port


class FlakyRedis:
    """The real client, except that the next `plan[op]` calls of `op` go to a client of a dead port.

    ops: `hset`, `hgetall`, `get`, `pipeline` (plain, the store's reads), `multi` (MULTI/EXEC writes),
    `mget` (the per-user corrections, `trainers.corrections`).
    """

    def __init__(self, url: str, plan: dict[str, int], dead_port: int | None = None) -> None:
        self.real = _client(url)
        self.dead = _client(f"redis://127.0.0.1:{dead_port or _closed_port()}/0", socket_timeout=0.2)
        self.plan = dict(plan)
        self.failed: Counter[str] = Counter()

    def _pick(self, op: str) -> Any:
        if self.plan.get(op, 0) > 0:
            self.plan[op] -= 1
            self.failed[op] += 1
            return self.dead
        return self.real

    def hset(self, *a: Any, **kw: Any) -> Any:
        return self._pick("hset").hset(*a, **kw)

    def hgetall(self, *a: Any, **kw: Any) -> Any:
        return self._pick("hgetall").hgetall(*a, **kw)

    def get(self, *a: Any, **kw: Any) -> Any:
        return self._pick("get").get(*a, **kw)

    def mget(self, *a: Any, **kw: Any) -> Any:
        return self._pick("mget").mget(*a, **kw)

    def pipeline(self, transaction: bool = True) -> Any:
        return self._pick("multi" if transaction else "pipeline").pipeline(transaction=transaction)

    async def aclose(self) -> None:
        await self.real.aclose()
        await self.dead.aclose()


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _snap(seq: int, adapter_id: str = "feed") -> AdapterDelta:
    from schemas.delta import AdapterState

    tensors = {"m.lora_A": torch.ones(2, 3), "m.lora_B": torch.zeros(4, 2)}
    return make_delta(
        AdapterState(adapter_id, "v", 2, seq - 1, tensors), full_parts(tensors, 2), seq, snapshot=True
    )


# -- the store alone -----------------------------------------------------------------------------
def test_store_rides_out_refused_connections(stack: Settings, redis_client: Any) -> None:
    prefix = f"{stack.redis_prefix}store1:"
    events: list[tuple[str, str]] = []

    async def go() -> Any:
        flaky = FlakyRedis(stack.redis.url, {"hset": 3, "multi": 2, "pipeline": 2, "hgetall": 1})
        store = SnapshotStore(flaky, prefix, "in", FAST, lambda op, outcome: events.append((op, outcome)))
        try:
            await store.reserve({"feed": 4})
            await store.write([(_snap(4), {0: 17})], {0: 17})
            return await store.read("feed"), await store.partition_offsets(), flaky.failed
        finally:
            await flaky.aclose()

    known, offsets, failed = asyncio.run(go())
    assert failed == {"hset": 3, "multi": 2, "pipeline": 2, "hgetall": 1}  # every planned failure happened
    assert Counter(events) == {
        ("reserve", "retried"): 3,
        ("write", "retried"): 2,
        ("read", "retried"): 2,
        ("offsets", "retried"): 1,
    }
    assert known.snapshot is not None and known.snapshot.seq == 4 and known.last_seq == 4
    assert known.offsets == {0: 17} and offsets == {0: 17}
    assert redis_client.hget(f"{prefix}adapter-seq", "feed") == b"4"


def test_store_rides_out_timeouts(stack: Settings, silent_port: int) -> None:
    events: list[tuple[str, str]] = []

    async def go() -> None:
        flaky = FlakyRedis(stack.redis.url, {"hset": 2}, dead_port=silent_port)
        store = SnapshotStore(
            flaky, f"{stack.redis_prefix}store2:", "in", FAST, lambda op, o: events.append((op, o))
        )
        try:
            await store.reserve({"feed": 1})
        finally:
            await flaky.aclose()

    asyncio.run(go())
    assert events == [("reserve", "retried")] * 2


def test_store_gives_up_after_its_budget_or_at_once_when_aborted(stack: Settings, redis_client: Any) -> None:
    prefix = f"{stack.redis_prefix}store3:"
    events: list[tuple[str, str]] = []

    async def go(abort: bool) -> None:
        flaky = FlakyRedis(stack.redis.url, {"hset": 10**9})
        store = SnapshotStore(
            flaky,
            prefix,
            "in",
            Backoff(first_s=0.02, max_s=0.05, give_up_s=0.3),
            lambda op, o: events.append((op, o)),
        )
        if abort:
            store.abort = asyncio.Event()
            store.abort.set()
        try:
            await store.reserve({"feed": 1})
        finally:
            await flaky.aclose()

    with pytest.raises(StoreError, match=r"Redis reserve failed \d+ time"):
        asyncio.run(go(abort=False))
    retried = events.count(("reserve", "retried"))
    assert 3 <= retried <= 15 and events[-1] == ("reserve", "gave_up")  # 0.3 s of 0.02 … 0.05 s waits
    events.clear()
    with pytest.raises(StoreError, match="failed 1 time"):
        asyncio.run(go(abort=True))
    assert events == [("reserve", "gave_up")]
    assert redis_client.hget(f"{prefix}adapter-seq", "feed") is None


def test_store_does_not_retry_a_command_error(stack: Settings, redis_client: Any) -> None:
    prefix = f"{stack.redis_prefix}store4:"
    redis_client.set(f"{prefix}adapter-seq", b"not a hash")
    events: list[tuple[str, str]] = []

    async def go() -> None:
        client = _client(stack.redis.url)
        try:
            await SnapshotStore(client, prefix, "in", FAST, lambda op, o: events.append((op, o))).reserve(
                {"a": 1}
            )
        finally:
            await client.aclose()

    with pytest.raises(StoreError, match="WRONGTYPE"):
        asyncio.run(go())
    assert events == []


def test_read_survives_corrupt_records(stack: Settings, redis_client: Any) -> None:
    prefix = f"{stack.redis_prefix}store5:"
    redis_client.set(f"{prefix}adapter:feed", b"\x00garbage")
    redis_client.hset(f"{prefix}adapter-meta:feed", mapping={"seq": "7", "offsets": "{"})
    redis_client.hset(f"{prefix}adapter-seq", mapping={"feed": "5", "search": "x"})
    redis_client.set(f"{prefix}adapter:search", codec.encode(_snap(3, "search")))
    redis_client.hset(f"{prefix}adapter-meta:search", mapping={"seq": "3", "offsets": "[1, 2]"})

    async def go() -> Any:
        client = _client(stack.redis.url)
        try:
            store = SnapshotStore(client, prefix, "in")
            return await store.read("feed"), await store.read("search")
        finally:
            await client.aclose()

    feed, search = asyncio.run(go())
    assert feed.snapshot is None and feed.last_seq == 7 and feed.offsets == {}  # the meta seq counts
    assert feed.invalid is not None and "not a valid AdapterDelta" in feed.invalid
    assert (
        search.snapshot is not None
        and search.last_seq == 3
        and search.offsets == {}
        and search.invalid is None
    )


# -- the service ---------------------------------------------------------------------------------
def _flaky_service(
    s: Settings, plan: dict[str, int], retry: Backoff = FAST
) -> tuple[TrainerService, FlakyRedis]:
    flaky = FlakyRedis(s.redis.url, plan)
    svc = _service(s)
    return TrainerService(s, svc.trainer, redis=flaky, retry=retry), flaky


async def _go(svc: TrainerService, n: int) -> None:
    await svc.start()
    try:
        await asyncio.wait_for(svc.run(max_examples=n), timeout=120)
    finally:
        await svc.stop()


async def _committed(s: Settings) -> dict[int, int]:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    c = AIOKafkaConsumer(bootstrap_servers=s.kafka.bootstrap, group_id=f"{s.topic_prefix}{s.online.group}")
    await c.start()
    try:
        topic = f"{s.topic_prefix}ad.training-examples"
        parts = c.partitions_for_topic(topic) or set()
        got = {p: await c.committed(TopicPartition(topic, p)) for p in sorted(parts)}
        return {p: o for p, o in got.items() if o is not None}  # partitions no example went to
    finally:
        await c.stop()


def _redis_offsets(redis_client: Any, s: Settings) -> dict[int, int]:
    raw = redis_client.hgetall(f"{s.redis_prefix}trainer-offsets:{s.topic_prefix}ad.training-examples")
    return {int(k): int(v) for k, v in raw.items()}


@pytest.mark.kafka
def test_trainer_rides_out_redis_errors(deployment: Settings, redis_client: Any) -> None:
    s = deployment
    before = {
        o: _metric("adstream_trainers_redis_errors_total", op=o, outcome="retried")
        for o in ("reserve", "write", "read")
    }
    gave_up = sum(
        _metric("adstream_trainers_redis_errors_total", op=o, outcome="gave_up")
        for o in ("reserve", "write", "read", "offsets")
    )
    asyncio.run(_produce(s, _examples(300, seed=11)))
    svc, flaky = _flaky_service(s, {"hset": 3, "multi": 2, "pipeline": 2})
    asyncio.run(_go(svc, 300))
    assert flaky.failed == {"hset": 3, "multi": 2, "pipeline": 2}
    assert svc.learned == 300 and svc.failure is None
    after = {o: _metric("adstream_trainers_redis_errors_total", op=o, outcome="retried") for o in before}
    assert {o: after[o] - before[o] for o in before} == {"reserve": 3, "write": 2, "read": 2}
    assert (
        sum(
            _metric("adstream_trainers_redis_errors_total", op=o, outcome="gave_up")
            for o in ("reserve", "write", "read", "offsets")
        )
        == gave_up
    )
    deltas = asyncio.run(_deltas(s))
    last = _assert_unique_contiguous(deltas)
    states = _replica_follow(deltas, svc.trainer.bank.shapes)
    for aid in ADAPTERS:
        assert int(redis_client.hget(f"{s.redis_prefix}adapter-meta:{aid}", "seq")) == last[aid]
        full = svc.trainer.bank.get_state(aid)
        assert all(torch.equal(states[aid].tensors[k], full[k]) for k in full)
    committed = asyncio.run(_committed(s))
    assert committed == {p: o + 1 for p, o in _redis_offsets(redis_client, s).items()}


@pytest.mark.kafka
def test_a_failed_corrections_read_learns_without_them(deployment: Settings) -> None:
    """The per-user corrections (`online.correction_offset`) are read once per micro-batch; when
    Redis does not answer that read, the step learns without them instead of stalling."""
    s = deployment
    skipped = _metric("adstream_trainers_redis_errors_total", op="corrections", outcome="skipped")
    asyncio.run(_produce(s, _examples(300, seed=13)))
    svc, flaky = _flaky_service(s, {"mget": 2})
    asyncio.run(_go(svc, 300))
    assert flaky.failed == {"mget": 2}
    assert svc.learned == 300 and svc.failure is None
    assert _metric("adstream_trainers_redis_errors_total", op="corrections", outcome="skipped") == skipped + 2


@pytest.mark.kafka
def test_failed_snapshot_write_commits_nothing_and_a_restart_resumes(
    deployment: Settings, redis_client: Any
) -> None:
    s = deployment
    asyncio.run(_produce(s, _examples(300, seed=12)))
    asyncio.run(_go(_service(s), 300))
    offsets_1, committed_1 = _redis_offsets(redis_client, s), asyncio.run(_committed(s))
    seq_1 = {a: redis_client.hget(f"{s.redis_prefix}adapter-meta:{a}", "seq") for a in ADAPTERS}
    assert committed_1 == {p: o + 1 for p, o in offsets_1.items()}

    # Redis takes reservations but every snapshot write fails: after give_up_s the loop stops
    asyncio.run(_produce(s, _examples(300, seed=13)))
    eager = s.model_copy(update={"online": s.online.model_copy(update={"snapshot_every_s": 1e-3})})
    svc, flaky = _flaky_service(eager, {"multi": 10**9}, Backoff(first_s=0.02, max_s=0.1, give_up_s=0.5))
    gave_up = _metric("adstream_trainers_redis_errors_total", op="write", outcome="gave_up")
    with pytest.raises(StoreError, match="Redis write failed"):
        asyncio.run(_go(svc, 300))
    assert flaky.failed["multi"] >= 2 and svc.failure is not None
    assert _metric("adstream_trainers_redis_errors_total", op="write", outcome="gave_up") == gave_up + 1
    assert asyncio.run(_committed(s)) == committed_1  # nothing committed past what Redis holds
    assert _redis_offsets(redis_client, s) == offsets_1
    assert {a: redis_client.hget(f"{s.redis_prefix}adapter-meta:{a}", "seq") for a in ADAPTERS} == seq_1
    before = asyncio.run(_deltas(s))
    last_before = _assert_unique_contiguous(before)  # what it published was reserved first

    # a healthy restart re-learns the 300 examples from the snapshot, after every reserved seq
    survivor = _service(s)
    asyncio.run(_go(survivor, 300))
    assert survivor.learned == 300
    after = asyncio.run(_deltas(s))
    _assert_unique_contiguous(after)
    published_past = {a for a in ADAPTERS if last_before[a] > int(seq_1[a])}
    assert published_past  # the failed run did publish past the Redis snapshot
    for aid in ADAPTERS:
        first_new = next(d for d in _new(after, before) if d.adapter_id == aid)
        assert first_new.seq == last_before[aid] + 1
        assert first_new.snapshot == (aid in published_past)  # re-align replicas where they may be ahead
    _replica_follow(after, survivor.trainer.bank.shapes)
    assert asyncio.run(_committed(s)) == {p: o + 1 for p, o in _redis_offsets(redis_client, s).items()}


def _oversized(snap: AdapterDelta, svc: TrainerService) -> AdapterDelta:
    """The same snapshot, B scaled so ΔW is twice `serving.adapter_max_norm` (declared norm correct)."""
    from schemas.delta import apply_delta, empty_state

    bank = svc.trainer.bank
    st = apply_delta(empty_state(snap.adapter_id, snap.base_version, bank.shapes, bank.spec.rank), snap, 10.0)
    factor = 2 * svc.bound.max_norm / delta_w_norm(st.tensors, bank.spec.scaling)
    big = {k: v * factor if k.endswith("lora_B") else v for k, v in st.tensors.items()}
    return make_delta(st, full_parts(big, bank.spec.rank), snap.seq, snapshot=True)


@pytest.mark.kafka
def test_restart_does_not_resume_from_a_corrupt_or_oversized_snapshot(
    deployment: Settings, redis_client: Any
) -> None:
    s = deployment
    asyncio.run(_produce(s, _examples(300, seed=14)))
    first = _service(s)
    asyncio.run(_go(first, 300))
    key = f"{s.redis_prefix}adapter:"
    good = codec.decode(AdapterDelta, redis_client.get(f"{key}feed"))
    assert isinstance(good, AdapterDelta)
    redis_client.set(f"{key}feed", codec.encode(_oversized(good, first)))
    redis_client.set(f"{key}search", b'{"truncated')
    before = asyncio.run(_deltas(s))
    last_before = _assert_unique_contiguous(before)
    refused = {
        r: _metric("adstream_trainers_refused_snapshots_total", stage="restore", reason=r)
        for r in ("norm", "invalid")
    }

    asyncio.run(_produce(s, _examples(200, seed=15)))
    second = _service(s)
    asyncio.run(_go(second, 200))
    assert second.learned == 200
    assert {
        r: _metric("adstream_trainers_refused_snapshots_total", stage="restore", reason=r) - refused[r]
        for r in refused
    } == {"norm": 1, "invalid": 1}
    after = asyncio.run(_deltas(s))
    _assert_unique_contiguous(after)  # no old seq republished
    states = _replica_follow(after, second.trainer.bank.shapes)
    for aid in ADAPTERS:
        first_new = next(d for d in _new(after, before) if d.adapter_id == aid)
        assert first_new.snapshot and first_new.seq == last_before[aid] + 1
        fresh = _replica_follow([first_new], second.trainer.bank.shapes)[aid]
        assert delta_w_norm(fresh.tensors, second.trainer.bank.spec.scaling) == 0.0  # started from zero
        stored = codec.decode(AdapterDelta, redis_client.get(f"{key}{aid}"))
        assert isinstance(stored, AdapterDelta)
        check_snapshot(stored, aid, second.bound)  # Redis holds a valid snapshot again
        full = second.trainer.bank.get_state(aid)
        assert all(torch.equal(states[aid].tensors[k], full[k]) for k in full)


@pytest.mark.kafka
def test_refused_snapshot_rolls_back_to_the_last_snapshot_or_zero(
    deployment: Settings, redis_client: Any
) -> None:
    s = deployment
    asyncio.run(_produce(s, _examples(300, seed=16)))
    asyncio.run(_go(_service(s), 300))
    key = f"{s.redis_prefix}adapter:"
    good = codec.decode(AdapterDelta, redis_client.get(f"{key}feed"))
    assert isinstance(good, AdapterDelta)
    asyncio.run(_produce(s, _examples(200, seed=17)))
    before = asyncio.run(_deltas(s))
    refused = _metric("adstream_trainers_refused_snapshots_total", stage="publish", reason="norm")
    rollbacks = {
        t: _metric("adstream_trainers_adapter_rollbacks_total", to=t) for t in ("last_snapshot", "zero")
    }
    svc = _service(s)

    async def go() -> dict[str, int]:
        await svc.start()
        try:
            await asyncio.wait_for(svc.run(max_examples=200), timeout=120)
            made: dict[str, int] = {}
            for aid in ADAPTERS:  # both adapters diverge; search's Redis snapshot is lost meanwhile
                state = svc.trainer.bank.get_state(aid)
                factor = 2 * svc.bound.max_norm / max(delta_w_norm(state, svc.bound.scale), 1e-3)
                svc.trainer.bank.set_state(
                    aid, {k: v * factor if k.endswith("lora_B") else v for k, v in state.items()}
                )
                made[aid] = svc.trainer.runs[aid].seq
            redis_client.set(f"{key}search", b"garbage")
            await svc.snapshot_all()
            return made
        finally:
            await svc.stop()

    seq_at_divergence = asyncio.run(go())
    assert _metric("adstream_trainers_refused_snapshots_total", stage="publish", reason="norm") == refused + 2
    assert {
        t: _metric("adstream_trainers_adapter_rollbacks_total", to=t) - rollbacks[t] for t in rollbacks
    } == {"last_snapshot": 1, "zero": 1}
    everything = asyncio.run(_deltas(s))
    new = _new(everything, before)
    states = _replica_follow(everything, svc.trainer.bank.shapes)  # snapshots bridge the skipped seqs
    for aid in ADAPTERS:
        mine = [d for d in new if d.adapter_id == aid]
        seqs = [d.seq for d in mine]
        assert seqs == sorted(set(seqs))  # increasing, never reused (refused seqs are skipped)
        last = mine[-1]
        assert last.snapshot and last.seq > seq_at_divergence[aid]
        check_snapshot(last, aid, svc.bound)  # nothing serving would refuse went out
        stored = codec.decode(AdapterDelta, redis_client.get(f"{key}{aid}"))
        assert isinstance(stored, AdapterDelta) and stored.seq == last.seq
        full = svc.trainer.bank.get_state(aid)
        assert all(torch.equal(states[aid].tensors[k], full[k]) for k in full)
    feed = [d for d in new if d.adapter_id == "feed"][-1]
    assert _same_weights(feed, good, svc)  # back to the last snapshot
    search = [d for d in new if d.adapter_id == "search"][-1]
    assert delta_w_norm(_weights(search, svc), svc.bound.scale) == 0.0  # no valid snapshot: zero
    assert asyncio.run(_committed(s)) == {p: o + 1 for p, o in _redis_offsets(redis_client, s).items()}


def _new(after: list[AdapterDelta], before: list[AdapterDelta]) -> list[AdapterDelta]:
    """Messages of `after` not in `before` (a topic read interleaves partitions differently each time;
    each adapter's messages stay in order)."""
    seen = {(d.adapter_id, d.seq) for d in before}
    return [d for d in after if (d.adapter_id, d.seq) not in seen]


def _weights(snap: AdapterDelta, svc: TrainerService) -> dict[str, torch.Tensor]:
    from schemas.delta import apply_delta, empty_state

    bank = svc.trainer.bank
    start = empty_state(snap.adapter_id, snap.base_version, bank.shapes, bank.spec.rank)
    return dict(apply_delta(start, snap, 10.0).tensors)


def _same_weights(a: AdapterDelta, b: AdapterDelta, svc: TrainerService) -> bool:
    wa, wb = _weights(a, svc), _weights(b, svc)
    return all(torch.equal(wa[k], wb[k]) for k in wa)
