"""M14.c: seq lineages (epochs) in the ΔW format: signed, ordered, a replayed old one refused."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
import torch

from schemas import codec
from schemas.delta import (
    AdapterState,
    EpochChangeError,
    StaleDeltaError,
    StaleEpochError,
    apply_delta,
    delta_mac,
    empty_state,
    epoch_order,
    full_parts,
    make_delta,
    new_epoch,
    select_parts,
    verify_delta,
)
from schemas.errors import AdapterError
from schemas.events import MAX_SEQ, AdapterDelta
from trainers.snapshots import parse_seq_record, seq_record

SHAPES = {"lin1": (10, 20), "lin2": (20, 2)}  # the PEFT tiny model, Linear 10→20→2
RANK = 4
KEY = b"k" * 32
T0 = datetime(2026, 12, 1, 12, tzinfo=UTC)
OLD, NEW = new_epoch(T0), new_epoch(T0 + timedelta(hours=1))


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    start = empty_state("feed", "v1", SHAPES, RANK)
    return {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in start.tensors.items()}


def _at(epoch: int | None, seq: int, seed: int = 0) -> AdapterState:
    """A state at `seq` of `epoch`, holding seeded weights."""
    return AdapterState("feed", "v1", RANK, seq, _tensors(seed), epoch)


def _snapshot(epoch: int | None, seq: int, seed: int) -> AdapterDelta:
    tensors = _tensors(seed)
    state = AdapterState("feed", "v1", RANK, seq - 1, tensors, epoch)
    return make_delta(state, full_parts(tensors, RANK), seq, snapshot=True, key=KEY)


def _delta(state: AdapterState, seed: int) -> AdapterDelta:
    new = _tensors(seed)
    return make_delta(state, select_parts(new, {"lin1": torch.tensor([0])}), state.seq + 1, key=KEY)


def test_epochs_are_ordered_by_start_time_and_json_safe() -> None:
    assert OLD < NEW and epoch_order(None) < epoch_order(OLD)
    assert new_epoch(T0, after=NEW) > NEW  # a clock that went back still makes a later epoch
    assert 0 < new_epoch(datetime(2109, 1, 1, tzinfo=UTC)) <= MAX_SEQ
    assert len({new_epoch(T0) for _ in range(50)}) > 1  # the random low bits


def test_the_epoch_is_covered_by_the_signature() -> None:
    snap = _snapshot(NEW, 3, seed=1)
    verify_delta(snap, KEY)
    for forged in (None, OLD, NEW + 1):  # swapped, stripped or moved: the MAC no longer checks out
        with pytest.raises(AdapterError, match="not signed by the trainer's key"):
            verify_delta(snap.model_copy(update={"epoch": forged}), KEY)
    # the wire keeps it: a decoded delta verifies, and carries the epoch
    back = codec.decode(AdapterDelta, codec.encode(snap))
    assert isinstance(back, AdapterDelta) and back.epoch == NEW
    verify_delta(back, KEY)


def test_a_legacy_signature_is_unchanged() -> None:
    """Deltas without an epoch (signed before epochs) still verify: the MAC is the old one."""
    import hashlib
    import hmac

    legacy = _snapshot(None, 2, seed=2)
    fields = [
        "adstream-delta-v1",
        legacy.adapter_id,
        legacy.base_version,
        legacy.seq,
        legacy.rank,
        legacy.snapshot,
        float(legacy.norm).hex(),
        hashlib.sha256(legacy.payload).hexdigest(),
    ]
    assert delta_mac(legacy, KEY) == hmac.new(KEY, json.dumps(fields).encode(), hashlib.sha256).hexdigest()
    verify_delta(legacy, KEY)


def test_a_snapshot_of_a_later_epoch_resets_the_adapter_whatever_the_seqs() -> None:
    held = _at(OLD, 40)
    snap = _snapshot(NEW, 2, seed=3)
    with pytest.raises(StaleDeltaError):  # the same snapshot in the old epoch is a replay
        apply_delta(held, _snapshot(OLD, 2, seed=3), max_norm=10)
    reset = apply_delta(held, snap, max_norm=10)
    assert (reset.epoch, reset.seq) == (NEW, 2)
    assert all(torch.equal(reset.tensors[k], v) for k, v in _tensors(3).items())
    # within the new epoch the seq rules hold as before
    nxt = apply_delta(reset, _delta(reset, seed=4), max_norm=10)
    assert (nxt.epoch, nxt.seq) == (NEW, 3)
    with pytest.raises(StaleDeltaError):
        apply_delta(nxt, _delta(reset, seed=4), max_norm=10)
    # from the legacy lineage too: None is the earliest epoch
    assert apply_delta(_at(None, 9), snap, max_norm=10).epoch == NEW


def test_a_replayed_old_epoch_is_refused() -> None:
    held = _at(NEW, 1)
    for old in (_snapshot(OLD, 500, seed=5), _snapshot(None, 500, seed=5), _delta(_at(OLD, 1), seed=5)):
        with pytest.raises(StaleEpochError, match=r"field 'epoch'.*older than the applied epoch"):
            apply_delta(held, old, max_norm=10)
    assert issubclass(StaleEpochError, StaleDeltaError)  # callers that ignore replays ignore it too


def test_a_plain_delta_of_a_new_epoch_needs_its_snapshot_first() -> None:
    held = _at(OLD, 7)
    first = _delta(replace(empty_state("feed", "v1", SHAPES, RANK), epoch=NEW), seed=6)  # its seq 0
    with pytest.raises(EpochChangeError, match=r"new epoch .* re-sync from its snapshot"):
        apply_delta(held, first, max_norm=10)
    # a replica that holds nothing of this adapter takes the epoch of what comes first
    fresh = apply_delta(empty_state("feed", "v1", SHAPES, RANK), first, max_norm=10)
    assert (fresh.epoch, fresh.seq) == (NEW, 0)


def test_make_delta_carries_the_state_epoch() -> None:
    assert _delta(_at(NEW, 3), seed=7).epoch == NEW
    assert _delta(replace(_at(NEW, 3), epoch=None), seed=7).epoch is None


def test_seq_records_keep_the_epoch_with_the_seq() -> None:
    assert seq_record(5, None) == "5" and seq_record(5, NEW) == f"5@{NEW}"
    assert parse_seq_record(b"5", "feed") == (5, None)  # written before epochs: the legacy lineage
    assert parse_seq_record(f"7@{NEW}".encode(), "feed") == (7, NEW)
    for lost in (None, b"x", b"-1", b"3@", b"3@x", b"3@0", b"@5"):
        assert parse_seq_record(lost, "feed") is None  # treated as lost: a new epoch


def test_the_contract_bounds_the_epoch() -> None:
    snap = _snapshot(NEW, 1, seed=8)
    raw = json.loads(codec.encode(snap))
    for bad in (0, -1, MAX_SEQ + 1, "soon"):
        with pytest.raises(Exception, match="epoch"):
            codec.decode(AdapterDelta, json.dumps({**raw, "epoch": bad}).encode())
