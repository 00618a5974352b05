"""The online trainer on the real broker and Redis: publish, snapshot, restart without reusing seqs."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import pytest
import torch

from schemas import codec, topics
from schemas.delta import AdapterState, SeqGapError, apply_delta, empty_state
from schemas.events import AdapterDelta, DeadLetter, TrainingExample
from schemas.settings import LoraSettings, OnlineSettings, Settings
from trainers.models.lora import AdapterBank
from trainers.models.ranker import Ranker, RankerConfig
from trainers.online import OnlineTrainer
from trainers.service import TrainerService
from trainers.snapshots import SnapshotStore

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.timeout(180)]

CFG = RankerConfig(
    state_dim=8, ad_buckets=64, advertiser_buckets=16, campaign_buckets=16, category_buckets=8, deep_hidden=16
)
ADAPTERS = ("feed", "search")


def _examples(n: int, seed: int) -> list[TrainingExample]:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "trainers"))
    from helpers_trainers import make_examples

    return make_examples(n, seed=seed, dim=8, adapters=ADAPTERS)


def _service(s: Settings) -> TrainerService:
    torch.manual_seed(0)
    bank = AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8), "ranker-it")
    return TrainerService(s, OnlineTrainer(bank, OnlineSettings(lr=0.01, min_step_examples=16)))


async def _produce(s: Settings, exs: list[TrainingExample]) -> None:
    from aiokafka import AIOKafkaProducer

    p = AIOKafkaProducer(bootstrap_servers=s.kafka.bootstrap, acks="all")
    await p.start()
    try:
        topic = topics.topic_name(topics.TRAINING_EXAMPLES, s.topic_prefix)
        for e in exs:
            await p.send(topic, codec.encode(e), key=e.adapter_id.encode())
        await p.send(topic, b"{not json", key=b"feed")  # dead-lettered, never fatal
        await p.flush()
    finally:
        await p.stop()


async def _deltas(s: Settings) -> list[AdapterDelta]:
    return [codec.decode(AdapterDelta, r.value) for r in await _records(s, topics.ADAPTER_DELTAS)]  # type: ignore[misc]


async def _records(s: Settings, base_topic: str) -> list[Any]:
    from aiokafka import AIOKafkaConsumer

    c = AIOKafkaConsumer(
        topics.topic_name(base_topic, s.topic_prefix),
        bootstrap_servers=s.kafka.bootstrap,
        auto_offset_reset="earliest",
    )
    await c.start()
    out: list[Any] = []
    try:
        idle = 0
        while idle < 4:
            batch = await c.getmany(timeout_ms=500)
            got = [r for recs in batch.values() for r in recs]
            idle = 0 if got else idle + 1
            out += got
    finally:
        await c.stop()
    return out


async def _run(svc: TrainerService, n: int, graceful: bool = True) -> None:
    await svc.start()
    try:
        await asyncio.wait_for(svc.run(max_examples=n), timeout=90)
    finally:
        if graceful:
            await svc.stop()
        else:  # a crash: no final snapshot, no offset commit
            assert svc.consumer is not None and svc.producer is not None
            await svc.consumer.stop()
            await svc.producer.stop()
            await svc._redis.aclose()


def _replica_follow(
    deltas: list[AdapterDelta], shapes: dict[str, tuple[int, int]]
) -> dict[str, AdapterState]:
    states: dict[str, AdapterState] = {}
    for d in deltas:
        st = states.get(d.adapter_id) or empty_state(d.adapter_id, "ranker-it", shapes, 4)
        states[d.adapter_id] = apply_delta(st, d, max_norm=10.0)  # raises on any gap or bad delta
    return states


def _assert_unique_contiguous(deltas: list[AdapterDelta]) -> dict[str, int]:
    seqs: dict[str, list[int]] = defaultdict(list)
    for d in deltas:
        seqs[d.adapter_id].append(d.seq)
    for aid, ss in seqs.items():
        assert ss == list(range(len(ss))), f"{aid}: seqs {ss} not unique and contiguous"
    return {a: ss[-1] for a, ss in seqs.items()}


def test_publish_snapshot_and_graceful_restart(deployment: Settings, redis_client: Any) -> None:
    s = deployment
    asyncio.run(_produce(s, _examples(400, seed=1)))
    first = _service(s)
    asyncio.run(_run(first, 400))
    assert first.learned == 400
    deltas = asyncio.run(_deltas(s))
    last = _assert_unique_contiguous(deltas)
    assert set(last) == set(ADAPTERS) and deltas[-1].snapshot
    states = _replica_follow(deltas, first.trainer.bank.shapes)
    for aid in ADAPTERS:  # a replica following the topic holds exactly the trainer's weights
        full = first.trainer.bank.get_state(aid)
        assert all(torch.equal(states[aid].tensors[k], full[k]) for k in full)

    store = SnapshotStore(None, s.redis_prefix, "")
    import redis.asyncio as aredis

    async def read() -> dict[str, Any]:
        client = aredis.Redis.from_url(s.redis.url)
        store.client = client
        try:
            return {a: await store.read(a) for a in ADAPTERS}
        finally:
            await client.aclose()

    dlq = asyncio.run(_records(s, topics.DLQ))
    assert len(dlq) == 1 and b"not json" in codec.decode(DeadLetter, dlq[0].value).raw  # type: ignore[attr-defined]

    known = asyncio.run(read())
    for aid in ADAPTERS:
        assert known[aid].snapshot is not None and known[aid].snapshot.seq == last[aid] == known[aid].last_seq
    assert (
        redis_client.hget(f"{s.redis_prefix}adapter-meta:feed", "version") == f"seq-{last['feed']}".encode()
    )

    # restart: only the new examples are learned, seqs continue after the last one
    asyncio.run(_produce(s, _examples(200, seed=2)))
    second = _service(s)
    asyncio.run(_run(second, 200))
    assert second.learned == 200
    all_deltas = asyncio.run(_deltas(s))
    _assert_unique_contiguous(all_deltas)
    _replica_follow(all_deltas, second.trainer.bank.shapes)
    assert len(all_deltas) > len(deltas)


def test_crash_restart_realigns_without_reusing_seqs(deployment: Settings, redis_client: Any) -> None:
    s = deployment
    asyncio.run(_produce(s, _examples(300, seed=3)))
    asyncio.run(_run(_service(s), 300))  # graceful: snapshot at seq N, offsets committed
    asyncio.run(_produce(s, _examples(300, seed=4)))
    crashed = _service(s)
    asyncio.run(_run(crashed, 300, graceful=False))  # deltas N+1… published, no snapshot
    before = asyncio.run(_deltas(s))
    last_before = _assert_unique_contiguous(before)
    snap_seq = {a: int(redis_client.hget(f"{s.redis_prefix}adapter-meta:{a}", "seq")) for a in ADAPTERS}
    assert any(last_before[a] > snap_seq[a] for a in ADAPTERS)

    survivor = _service(s)
    asyncio.run(_run(survivor, 300))  # re-learns the 300 uncommitted examples from the snapshot
    assert survivor.learned == 300
    after = asyncio.run(_deltas(s))
    _assert_unique_contiguous(after)  # no seq published twice
    new = after[len(before) :]
    for aid in ADAPTERS:
        first_new = next(d for d in new if d.adapter_id == aid)
        assert first_new.snapshot and first_new.seq == last_before[aid] + 1  # re-align replicas
    states = _replica_follow(after, survivor.trainer.bank.shapes)
    for aid in ADAPTERS:
        full = survivor.trainer.bank.get_state(aid)
        assert all(torch.equal(states[aid].tensors[k], full[k]) for k in full)
    with pytest.raises(SeqGapError):  # and a replica that missed a delta is told to re-sync
        st = empty_state("feed", "ranker-it", survivor.trainer.bank.shapes, 4)
        feed = [d for d in after if d.adapter_id == "feed" and not d.snapshot]
        apply_delta(apply_delta(st, feed[0], 10.0), feed[2], 10.0)


def test_cli_trainer_live_until_max_examples(deployment: Settings, tmp_path: Any) -> None:
    import os
    import subprocess
    import sys

    from trainers.models.ranker import save_checkpoint

    s = deployment
    torch.manual_seed(0)
    save_checkpoint(Ranker(CFG), tmp_path / "ranker")
    asyncio.run(_produce(s, _examples(300, seed=6)))
    env = {
        **os.environ,
        "ADSTREAM_KAFKA__BOOTSTRAP": s.kafka.bootstrap,
        "ADSTREAM_REDIS__URL": s.redis.url,
        "ADSTREAM_TOPIC_PREFIX": s.topic_prefix,
        "ADSTREAM_REDIS_PREFIX": s.redis_prefix,
        "ADSTREAM_ONLINE__GROUP": s.online.group,
        "ADSTREAM_ONLINE__MICRO_BATCH": "64",
        "ADSTREAM_LORA__RANK": "4",
        "ADSTREAM_MODEL_DIR": str(tmp_path),
        "ADSTREAM_ONLINE__HOLD_LABELS": "false",
    }
    port = 19000 + os.getpid() % 1000
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "trainer", "--max-examples", "300", "--metrics-port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.decode()
    assert proc.returncode == 0, text
    assert "learned 300 examples" in text
    deltas = asyncio.run(_deltas(s))
    _assert_unique_contiguous(deltas)
    assert {d.adapter_id for d in deltas if d.snapshot} == set(ADAPTERS)


def test_held_labels_are_learned_in_impression_order_and_not_committed_early(deployment: Settings) -> None:
    from datetime import timedelta

    s = deployment.model_copy(
        update={
            "online": deployment.online.model_copy(update={"hold_labels": True}),
            "streams": deployment.streams.model_copy(update={"attribution_window_s": 1800.0}),
        }
    )
    exs = _examples(300, seed=8)
    far = exs[0].ts + timedelta(seconds=1950)
    # one far-future example moves no watermark (schemas.watermark): a full window of them does;
    # one adapter, so they are consecutive on one partition
    late = [
        exs[-1].model_copy(update={"event_id": f"late{k}", "impression_id": f"late{k}", "ts": far})
        for k in range(32)
    ]
    asyncio.run(_produce(s, [*exs, *late]))
    svc = _service(s)

    async def go() -> tuple[int, int, dict[int, int | None]]:
        await svc.start()
        try:
            stop = asyncio.Event()
            task = asyncio.create_task(svc.run(stop))
            for _ in range(200):
                await asyncio.sleep(0.1)
                # partitions arrive in any order: wait until every example was read, not just
                # until the release point was learned
                if svc.learned >= 151 and svc.held is not None and len(svc.held) >= 181:
                    break
            stop.set()
            await task
            learned_mid = svc.learned
            assert svc.held is not None
            held = len(svc.held)
            await svc.snapshot_all()
            assert svc.consumer is not None
            parts = svc.consumer.assignment()
            committed = {tp.partition: await svc.consumer.committed(tp) for tp in parts}
            low = svc.held.low_offsets()
            for p, c in committed.items():
                if p in low:
                    assert c == low[p]  # never past an example that was not learned yet
            return learned_mid, held, committed
        finally:
            await svc.stop()

    learned_mid, held, _ = asyncio.run(go())
    # impressions up to ts(late) - window = T0 + 150 s are released: 151 of 300, plus none later
    assert learned_mid == 151 and held == 149 + 32
    assert svc.learned == 332  # shutdown drains the rest
    assert set(svc.trainer.runs) == set(ADAPTERS)
