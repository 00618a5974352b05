"""M14.c: a Redis that lost the trainer's keys starts a new seq lineage (epoch); running replicas
follow it without a restart, and refuse an old lineage replayed at them."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from schemas.delta import resolve_signing_key
from schemas.settings import LoraSettings, OnlineSettings, Settings
from serving.adapters import CANDIDATE, AdapterStack
from serving.banked import target_layers
from serving.hotswap import DeltaApplier
from trainers.models.lora import AdapterBank
from trainers.models.ranker import Ranker
from trainers.online import OnlineTrainer
from trainers.service import TrainerService
from trainers.snapshots import meta_key, offsets_key, seq_key, snapshot_key

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_trainers_service import ADAPTERS, CFG, _deltas, _examples, _produce, _run

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.timeout(240)]


def _service(s: Settings) -> TrainerService:
    """The trainer of `test_trainers_service`, signing what it publishes with the stack's key."""
    torch.manual_seed(0)
    bank = AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8), "ranker-it")
    spec = OnlineSettings(lr=0.01, min_step_examples=16)
    return TrainerService(s, OnlineTrainer(bank, spec, signing_key=resolve_signing_key(s)))


def _replica(s: Settings) -> DeltaApplier:
    """A serving replica's applier for the trainer's adapters (same layers, rank 4, alpha 8), with
    the stack's signing key: it applies only what the trainer signed."""
    layers = target_layers(Ranker(CFG), list(LoraSettings().targets))
    bank = AdapterStack(layers, 4, 8.0, 8, s.serving.adapter_max_norm)
    return DeltaApplier(bank, "ranker-it", max_norm=s.online.delta_max_norm, key=resolve_signing_key(s))


def _wipe_trainer_keys(client: Any, s: Settings) -> int:
    """What a Redis wipe (or a new Redis) leaves of the trainer: nothing. Only this test's keys."""
    from schemas import topics

    keys = [
        seq_key(s.redis_prefix),
        offsets_key(s.redis_prefix, topics.topic_name(topics.TRAINING_EXAMPLES, s.topic_prefix)),
    ]
    for aid in ADAPTERS:
        keys += [snapshot_key(s.redis_prefix, aid), meta_key(s.redis_prefix, aid)]
    gone = int(client.delete(*keys))
    assert not list(client.scan_iter(match=f"{s.redis_prefix}*"))  # the trainer's keys were all of them
    return gone


def _serves(replica: DeltaApplier, trainer_state: dict[str, torch.Tensor], aid: str) -> bool:
    weights = replica.bank.weights(aid, CANDIDATE)
    return all(
        torch.equal(weights[m][0], trainer_state[f"{m}.lora_A"])
        and torch.equal(weights[m][1], trainer_state[f"{m}.lora_B"])
        for m in weights
    )


def test_replica_follows_a_new_lineage_after_the_trainers_redis_keys_are_wiped(
    deployment: Settings, redis_client: Any
) -> None:
    s = deployment
    asyncio.run(_produce(s, _examples(400, seed=11)))
    first = _service(s)
    asyncio.run(_run(first, 400))  # deltas 0…N and a final snapshot per adapter
    old = asyncio.run(_deltas(s))
    replica = _replica(s)
    assert {replica.apply(d) for d in old} == {"applied"}
    for aid in ADAPTERS:
        assert _serves(replica, first.trainer.bank.get_state(aid), aid)
    held = {aid: replica.states[aid].seq for aid in ADAPTERS}

    assert _wipe_trainer_keys(redis_client, s) >= 5
    asyncio.run(_produce(s, _examples(100, seed=12)))
    second = _service(s)
    asyncio.run(_run(second, 100))  # no record in Redis: seqs start again at 0
    new = asyncio.run(_deltas(s))[len(old) :]
    assert new and all(d.seq < held[d.adapter_id] for d in new)  # the new lineage's seqs repeat the old
    outcomes = [replica.apply(d) for d in new]

    # the same replica, not restarted, serves the new lineage's final snapshot
    for aid in ADAPTERS:
        assert _serves(replica, second.trainer.bank.get_state(aid), aid), (aid, outcomes)
        assert replica.states[aid].seq == max(d.seq for d in new if d.adapter_id == aid)
    assert "stale" not in outcomes
    # the new lineage is a later epoch; its deltas before its first snapshot were refused, counted
    # and marked for a re-sync, and each adapter was reset once, at that snapshot
    for aid in ADAPTERS:
        (was,) = {d.epoch for d in old if d.adapter_id == aid}
        (now,) = {d.epoch for d in new if d.adapter_id == aid}
        assert was is not None and now is not None and now > was
    assert "new_epoch" in outcomes and replica.outcomes["epoch_reset"] == len(ADAPTERS)
    assert not replica.needs_resync  # the snapshot that reset them cleared it

    # a replica that got only a delta of the new epoch re-syncs from the new Redis snapshot
    # (what `ReplicaLoops._on_delta` does on `new_epoch`), without a restart
    lagging = _replica(s)
    assert {lagging.apply(d) for d in old} == {"applied"}
    first_new = next(d for d in new if d.adapter_id == "feed" and not d.snapshot)
    assert lagging.apply(first_new) == "new_epoch" and "feed" in lagging.needs_resync

    async def resync() -> str:
        from serving.io import RedisIO

        io = RedisIO(s, None)
        try:
            return await lagging.resync("feed", io.snapshot)
        finally:
            await io.client.aclose()

    assert asyncio.run(resync()) == "applied"
    assert _serves(lagging, second.trainer.bank.get_state("feed"), "feed")

    # the old lineage replayed at the replica (an attacker, a stale mirror) is refused
    replayed = [d for d in old if d.snapshot]
    assert {replica.apply(d) for d in replayed} == {"stale_epoch"}
    for aid in ADAPTERS:
        assert _serves(replica, second.trainer.bank.get_state(aid), aid)
