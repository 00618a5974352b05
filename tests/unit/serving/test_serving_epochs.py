"""M14.c on a replica: a new seq lineage (epoch) resets an adapter at its snapshot; old epochs,
new-epoch deltas without a snapshot, pins and the drift bound."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
import torch

from schemas.delta import AdapterState, empty_state, full_parts, make_delta, new_epoch, select_parts
from schemas.events import AdapterDelta
from schemas.settings import Settings
from serving.adapters import CANDIDATE, STABLE
from serving.hotswap import DeltaApplier
from serving.ranking import RankModel
from trainers.models.ranker import Ranker, RankerConfig

CFG = RankerConfig(
    state_dim=8, emb_dim=4, ad_buckets=64, advertiser_buckets=16, campaign_buckets=32, category_buckets=8
)
KEY = b"s" * 32
T0 = datetime(2026, 12, 1, 12, tzinfo=UTC)
OLD, NEW = new_epoch(T0), new_epoch(T0 + timedelta(hours=1))
AID = "slot:feed"


def _applier(**kw: float) -> DeltaApplier:
    torch.manual_seed(0)
    rank = RankModel(
        copy.deepcopy(Ranker(CFG).eval()),
        "v0",
        Settings(lora={"rank": 4, "alpha": 8.0}, serving={"adapter_capacity": 8}),
        torch.device("cpu"),
    )
    return DeltaApplier(rank.bank, "v0", max_norm=5.0, key=KEY, **kw)


def _start(a: DeltaApplier, epoch: int | None) -> AdapterState:
    shapes = {n: (s.fan_in, s.fan_out) for n, s in a.bank.shapes.items()}
    return replace(empty_state(AID, "v0", shapes, 4), epoch=epoch)


def _weights(state: AdapterState, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in state.tensors.items()}


def _lineage(a: DeltaApplier, epoch: int | None, n: int, seed: int) -> list[AdapterDelta]:
    """What a trainer publishes in one epoch: deltas 0 … n-2 on direction 0, then a snapshot."""
    state, out = _start(a, epoch), []
    for i in range(n - 1):
        new = _weights(state, seed + i)
        parts = select_parts(new, {m: torch.tensor([0]) for m in state.modules})
        out.append(make_delta(state, parts, state.seq + 1, key=KEY))
        merged = {k: v.clone() for k, v in state.tensors.items()}
        for m, p in parts.items():
            merged[f"{m}.lora_A"][p.dirs] = p.lora_A
            merged[f"{m}.lora_B"][:, p.dirs] = p.lora_B
        state = replace(state, seq=state.seq + 1, tensors=merged)
    full = _weights(state, seed + 100)
    out.append(make_delta(state, full_parts(full, 4), state.seq + 1, snapshot=True, key=KEY))
    return out


def _serves(a: DeltaApplier, snap: AdapterDelta, arm: int = CANDIDATE) -> bool:
    fresh = _applier()
    assert fresh.apply(snap) == "applied"
    mine, theirs = a.bank.weights(AID, arm), fresh.bank.weights(AID, CANDIDATE)
    return all(torch.equal(mine[m][0], theirs[m][0]) and torch.equal(mine[m][1], theirs[m][1]) for m in mine)


def test_a_new_epochs_snapshot_resets_the_adapter_and_its_deltas_follow() -> None:
    a = _applier()
    old = _lineage(a, OLD, 6, seed=1)
    assert [a.apply(d) for d in old] == ["applied"] * 6
    new = _lineage(a, NEW, 4, seed=50)  # seqs 0 … 3: all below the held seq 5
    # deltas of the new epoch before its snapshot: refused, counted, re-sync asked for
    assert [a.apply(d) for d in new[:-1]] == ["new_epoch"] * 3 and AID in a.needs_resync
    assert a.apply(new[-1]) == "applied" and a.outcomes["epoch_reset"] == 1
    assert _serves(a, new[-1]) and (a.states[AID].epoch, a.states[AID].seq) == (NEW, 3)
    assert AID not in a.needs_resync
    assert a.bank.meta[AID].epoch == NEW and a.bank.meta[AID].previous_epoch == OLD
    # and the old lineage, replayed, changes nothing
    assert {a.apply(d) for d in old} == {"stale_epoch"}
    assert _serves(a, new[-1])


def test_resync_after_a_new_epoch_delta_loads_the_new_snapshot() -> None:
    a = _applier()
    for d in _lineage(a, OLD, 4, seed=2):
        a.apply(d)
    new = _lineage(a, NEW, 3, seed=60)
    assert a.apply(new[0]) == "new_epoch"

    async def redis_snapshot(adapter_id: str) -> AdapterDelta | None:
        return new[-1]

    assert asyncio.run(a.resync(AID, redis_snapshot)) == "applied" and _serves(a, new[-1])


def test_a_new_epoch_is_still_bound_by_the_drift_from_the_promoted_version() -> None:
    a = _applier(max_drift=1e-6)
    for d in _lineage(a, OLD, 3, seed=3):
        a.apply(d, initial=True)  # the start-up load: promoted, no drift bound
    new = _lineage(a, NEW, 2, seed=70)
    assert a.apply(new[-1]) == "drift"  # the canary's candidate arm: bounded as any update
    assert a.states[AID].epoch == OLD
    assert a.apply(new[-1], arms=(STABLE, CANDIDATE)) == "applied"  # a full rollout: not bounded


def test_the_signature_covers_the_epoch_on_a_replica() -> None:
    a = _applier()
    for d in _lineage(a, OLD, 3, seed=4):
        a.apply(d)
    old_snap = _lineage(a, OLD, 9, seed=5)[-1]
    bumped = old_snap.model_copy(update={"epoch": NEW})  # an old snapshot passed off as a new epoch
    assert a.apply(bumped) == "unsigned"
    assert a.states[AID].epoch == OLD


def test_a_pin_holds_across_an_epoch_change_and_unpin_follows_the_new_epoch() -> None:
    a = _applier()
    for d in _lineage(a, OLD, 4, seed=6):
        a.apply(d)
    a.rollback(AID)  # pinned at seq 2 of the old epoch
    pinned = a.pinned_snapshot(AID)
    assert a.pinned == {AID: 2} and pinned.epoch == OLD
    new = _lineage(a, NEW, 3, seed=80)
    assert [a.apply(d) for d in new] == ["pinned"] * 3
    assert a.sync_pins({AID: 2}, {AID: pinned}) == [] and a.pinned == {AID: 2}
    assert _serves(a, pinned, STABLE) and _serves(a, pinned, CANDIDATE)
    # the admin lifts the pin: the re-sync takes the new epoch's snapshot (seq 2, not above the pin)
    assert a.sync_pins({}, {}) == [AID] and AID in a.needs_resync

    async def redis_snapshot(adapter_id: str) -> AdapterDelta | None:
        return new[-1]

    assert asyncio.run(a.resync(AID, redis_snapshot)) == "applied" and _serves(a, new[-1])


def test_a_new_replica_does_not_take_its_own_seq_of_another_epoch_for_the_pinned_version() -> None:
    """The pin stores a seq; seqs repeat across epochs. A replica started after the epoch change
    holds seq 2 of the new epoch, the pin is seq 2 of the old one: it installs the pinned weights."""
    old_replica = _applier()
    for d in _lineage(old_replica, OLD, 4, seed=7):
        old_replica.apply(d)
    old_replica.rollback(AID)
    pinned = old_replica.pinned_snapshot(AID)
    assert pinned.seq == 2

    fresh = _applier()
    new = _lineage(fresh, NEW, 3, seed=90)
    assert fresh.apply(new[-1], initial=True) == "applied" and fresh.states[AID].seq == 2
    assert fresh.missing_pins({AID: 2}) == [AID]  # its seq 2 may be another version: fetch them
    fresh.sync_pins({AID: 2}, {AID: pinned})
    assert fresh.pinned == {AID: 2} and fresh.outcomes["pin_installed"] == 1
    assert _serves(fresh, pinned, STABLE) and _serves(fresh, pinned, CANDIDATE)
    assert fresh.states[AID].epoch == OLD


@pytest.mark.parametrize("epoch", [None, OLD])
def test_a_pin_of_the_same_epoch_is_followed_by_seq_as_before(epoch: int | None) -> None:
    a, b = _applier(), _applier()
    lineage = _lineage(a, epoch, 4, seed=8)
    for d in lineage:
        a.apply(d)
        b.apply(d)
    a.rollback(AID)
    b.sync_pins({AID: 2}, {AID: a.pinned_snapshot(AID)})
    assert b.pinned == {AID: 2} and b.outcomes["pin_installed"] == 0  # its own previous version
    assert b.bank.meta[AID].seq == 2 and b.states[AID].epoch == epoch
