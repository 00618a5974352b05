"""Hot swap of deltas in seq order: applied, stale, gap → resync, poisoned ones rejected."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from safetensors.torch import save

from schemas.delta import AdapterState, empty_state, encode_delta, full_parts, make_delta, select_parts
from schemas.settings import Settings
from serving.adapters import CANDIDATE
from serving.hotswap import DeltaApplier
from serving.ranking import RankModel
from trainers.models.ranker import Ranker, RankerConfig

CFG = RankerConfig(
    state_dim=8,
    emb_dim=4,
    ad_buckets=64,
    advertiser_buckets=16,
    campaign_buckets=32,
    category_buckets=8,
    deep_hidden=16,
)


@pytest.fixture
def applier() -> DeltaApplier:
    torch.manual_seed(0)
    rank = RankModel(
        copy.deepcopy(Ranker(CFG).eval()),
        "v0",
        Settings(lora={"rank": 4, "alpha": 8.0}, serving={"adapter_capacity": 8}),
        torch.device("cpu"),
    )
    return DeltaApplier(rank.bank, "v0", max_norm=5.0)


def _shapes(a: DeltaApplier) -> dict[str, tuple[int, int]]:
    return {n: (s.fan_in, s.fan_out) for n, s in a.bank.shapes.items()}


def _step(state: AdapterState, scale: float, seed: int) -> tuple[AdapterState, object]:
    """The trainer's side: change direction 0 of every module, publish the delta."""
    g = torch.Generator().manual_seed(seed)
    new = {k: v.clone() for k, v in state.tensors.items()}
    for k in new:
        if k.endswith("lora_A"):
            new[k][0] = torch.randn(new[k].shape[1], generator=g) * scale
        else:
            new[k][:, 0] = torch.randn(new[k].shape[0], generator=g) * scale
    parts = select_parts(new, {m: torch.tensor([0]) for m in state.modules})
    delta = make_delta(state, parts, state.seq + 1)
    return AdapterState(state.adapter_id, state.base_version, state.rank, state.seq + 1, new), delta


def test_deltas_apply_in_order_and_versions_advance(applier: DeltaApplier) -> None:
    st = empty_state("slot:feed", "v0", _shapes(applier), 4)
    st1, d1 = _step(st, 0.05, 1)
    st2, d2 = _step(st1, 0.05, 2)
    assert applier.apply(d1) == "applied"
    assert applier.apply(d1) == "stale"
    assert applier.apply(d2) == "applied"
    info = applier.info("slot:feed")
    assert info.version == "seq-1" and info.seq == 1 and info.previous_version == "seq-0"
    m = st2.modules[0]
    assert torch.allclose(applier.bank.weights("slot:feed")[m][0], st2.tensors[f"{m}.lora_A"])


@pytest.mark.parametrize("poison", ["nan", "inf", "huge", "shape", "base", "empty"])
def test_poisoned_delta_is_rejected_and_old_version_keeps_serving(applier: DeltaApplier, poison: str) -> None:
    st = empty_state("adv:v1", "v0", _shapes(applier), 4)
    st1, d1 = _step(st, 0.05, 1)
    assert applier.apply(d1) == "applied"
    before = applier.bank.weights("adv:v1")
    if poison == "huge":
        _, bad = _step(st1, 100.0, 2)
    else:
        tensors = {k: v.clone() for k, v in st1.tensors.items()}
        m = st1.modules[0]
        if poison in ("nan", "inf"):
            good = make_delta(st1, select_parts(tensors, {m: torch.tensor([0])}), st1.seq + 1)
            tensors[f"{m}.lora_A"][0, 0] = float(poison)
            bad = good.model_copy(
                update={"payload": encode_delta(select_parts(tensors, {m: torch.tensor([0])}))}
            )
        elif poison == "shape":
            parts = select_parts(
                {k: v[:, :-1] if k.endswith("lora_A") else v for k, v in tensors.items()},
                {m: torch.tensor([0])},
            )
            bad = make_delta(
                AdapterState(
                    "adv:v1",
                    "v0",
                    4,
                    1,
                    {f"{m}.lora_A": tensors[f"{m}.lora_A"][:, :-1], f"{m}.lora_B": tensors[f"{m}.lora_B"]},
                ),
                parts,
                st1.seq + 1,
            )
        elif poison == "empty":
            # a module that names no direction: must be rejected, not crash the replica's consumer
            good = _step(st1, 0.05, 2)[1]
            fan_in, fan_out = tensors[f"{m}.lora_A"].shape[1], tensors[f"{m}.lora_B"].shape[0]
            empty = {
                f"{m}.dirs": torch.zeros(0, dtype=torch.int64),
                f"{m}.lora_A": torch.zeros(0, fan_in),
                f"{m}.lora_B": torch.zeros(fan_out, 0),
            }
            bad = good.model_copy(update={"payload": save(empty)})
        else:
            bad = _step(st1, 0.05, 2)[1].model_copy(update={"base_version": "other"})
    assert applier.apply(bad) == "rejected"
    after = applier.bank.weights("adv:v1")
    assert all(torch.equal(before[m][0], after[m][0]) for m in before)
    assert applier.info("adv:v1").version == "seq-0" and applier.info("adv:v1").rejected_deltas == 1


def test_gap_marks_resync_and_a_snapshot_catches_up(applier: DeltaApplier) -> None:
    st = empty_state("slot:search", "v0", _shapes(applier), 4)
    st1, d1 = _step(st, 0.05, 1)
    st2, _lost = _step(st1, 0.05, 2)
    st3, d3 = _step(st2, 0.05, 3)
    assert applier.apply(d1) == "applied"
    assert applier.apply(d3) == "gap" and "slot:search" in applier.needs_resync
    snap = make_delta(st3, full_parts(st3.tensors, 4), st3.seq, snapshot=True)

    async def source(adapter_id: str) -> object:
        return snap if adapter_id == "slot:search" else None

    assert asyncio.run(applier.resync("slot:search", source)) == "applied"  # type: ignore[arg-type]
    assert applier.info("slot:search").seq == 2 and not applier.needs_resync
    assert asyncio.run(applier.resync("nope", source)) == "missing"  # type: ignore[arg-type]


def test_rollback_restores_previous(applier: DeltaApplier) -> None:
    st = empty_state("slot:feed", "v0", _shapes(applier), 4)
    st1, d1 = _step(st, 0.05, 1)
    _, d2 = _step(st1, 0.05, 2)
    applier.apply(d1)
    applier.apply(d2)
    info = applier.rollback("slot:feed")
    assert info.version == "seq-0"
    m = st1.modules[0]
    assert torch.allclose(applier.bank.weights("slot:feed")[m][0], st1.tensors[f"{m}.lora_A"])


def test_rollback_pins_until_unpinned_and_a_gap_cannot_undo_it(applier: DeltaApplier) -> None:
    st = empty_state("slot:feed", "v0", _shapes(applier), 4)
    st1, d1 = _step(st, 0.05, 1)
    st2, d2 = _step(st1, 0.05, 2)
    st3, d3 = _step(st2, 0.05, 3)
    st4, d4 = _step(st3, 0.05, 4)
    applier.apply(d1)
    applier.apply(d2)
    info = applier.rollback("slot:feed")
    assert info.pinned and info.version == "seq-0"
    m = st1.modules[0]
    pinned_a = st1.tensors[f"{m}.lora_A"]
    # the trainer goes on publishing: neither the next delta nor a later one (a gap) moves the pin
    assert applier.apply(d3) == "pinned" and applier.apply(d4) == "pinned"
    assert torch.allclose(applier.bank.weights("slot:feed")[m][0], pinned_a)
    assert applier.outcomes["pinned"] == 2 and not applier.needs_resync
    snap = make_delta(st4, full_parts(st4.tensors, 4), st4.seq, snapshot=True)

    async def source(adapter_id: str) -> object:
        return snap

    assert asyncio.run(applier.resync("slot:feed", source)) == "pinned"  # type: ignore[arg-type]
    assert applier.info("slot:feed").seq == 0
    # unpinned: it re-syncs from the newest snapshot and follows deltas again
    assert applier.unpin("slot:feed") and "slot:feed" in applier.needs_resync
    assert asyncio.run(applier.resync("slot:feed", source)) == "applied"  # type: ignore[arg-type]
    info = applier.info("slot:feed")
    assert not info.pinned and info.seq == st4.seq
    assert torch.allclose(applier.bank.weights("slot:feed")[m][0], st4.tensors[f"{m}.lora_A"])
    assert not applier.unpin("slot:feed")


def test_sync_pins_follows_other_replicas(applier: DeltaApplier) -> None:
    st = empty_state("adv:v9", "v0", _shapes(applier), 4)
    st1, d1 = _step(st, 0.05, 1)
    _, d2 = _step(st1, 0.05, 2)
    applier.apply(d1)
    applier.apply(d2)
    # another replica rolled adv:v9 back to seq 0, which this replica keeps as its previous version
    assert applier.sync_pins({"adv:v9": 0}) == []
    assert applier.pinned == {"adv:v9": 0} and applier.info("adv:v9").version == "seq-0"
    # a pin on a version this replica does not hold is counted, not guessed
    assert applier.sync_pins({"adv:v9": 0, "adv:other": 7}) == []
    assert applier.outcomes["pin_unavailable"] == 1 and "adv:other" not in applier.pinned
    # lifted elsewhere: unpinned here and returned for a re-sync
    assert applier.sync_pins({}) == ["adv:v9"] and not applier.pinned
    assert "adv:v9" in applier.needs_resync


def test_malformed_pins_are_skipped_not_followed() -> None:
    from serving.io import parse_pins

    raw = {b"feed": b"3", b"adv:x": b"soon", "adv:y": "-1", b"adv:z": b""}
    assert parse_pins(raw) == {"feed": 3}


def test_prepare_off_the_loop_then_commit_equals_apply_and_redoes_a_moved_state(
    applier: DeltaApplier,
) -> None:
    """A replica verifies and decodes a large delta in a worker thread (`prepare`) and swaps it
    on the loop (`commit`): the same outcomes as `apply`, and a delta prepared against a state
    that another delta moved meanwhile is prepared again on the loop (never applied to a stale
    base)."""
    st = empty_state("slot:feed", "v0", _shapes(applier), 4)
    st1, d1 = _step(st, 0.05, 1)
    st2, d2 = _step(st1, 0.05, 2)
    early = asyncio.run(asyncio.to_thread(applier.prepare, d2))  # against the empty state: a gap
    assert early.outcome == "gap"
    assert applier.commit(d1, asyncio.run(asyncio.to_thread(applier.prepare, d1))) == "applied"
    assert applier.commit(d2, early) == "applied"  # the state moved: prepared again, applies now
    m = st2.modules[0]
    assert torch.allclose(applier.bank.weights("slot:feed")[m][0], st2.tensors[f"{m}.lora_A"])
    assert applier.commit(d1, applier.prepare(d1)) == "stale"
    assert applier.outcomes["gap"] == 0 and "slot:feed" not in applier.needs_resync


def test_the_swap_on_the_loop_only_copies_what_prepare_checked_and_folded(applier: DeltaApplier) -> None:
    """A replica prepares a delta off the event loop (signature, decode, checks, the slot's
    fold) and commits it on the loop: the commit must not check or fold again (that work held
    every request on the loop), and what it swaps in is the checked weights with their fold."""
    st = empty_state("feed", "v0", _shapes(applier), 4)
    st1, d1 = _step(st, 0.05, 1)
    bank, folder = applier.bank, applier.bank.folder
    assert folder is not None
    prep = applier.prepare(d1)
    assert prep.write is not None and prep.write.folded is not None

    def not_on_the_loop(*args: object) -> None:
        raise AssertionError("checked or folded again at commit")

    bank.check, folder.fold = not_on_the_loop, not_on_the_loop  # type: ignore[method-assign,assignment]
    assert applier.commit(d1, prep) == "applied"
    row = bank.row("feed", CANDIDATE)
    assert row in folder.rows()  # type: ignore[attr-defined]
    m = st1.modules[0]
    assert torch.equal(bank.weights("feed")[m][0], st1.tensors[f"{m}.lora_A"])
