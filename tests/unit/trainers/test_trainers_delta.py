"""ΔW wire format and guarded apply: round trips, sequencing and poisoned deltas rejected."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save

from schemas.delta import (
    AdapterState,
    DeltaPart,
    SeqGapError,
    StaleDeltaError,
    apply_delta,
    decode_delta,
    empty_state,
    encode_delta,
    full_parts,
    make_delta,
    select_parts,
)
from schemas.errors import AdapterError

SHAPES = {"lin1": (10, 20), "lin2": (20, 2)}  # (in, out): the PEFT tiny model, Linear 10→20→2
RANK = 4


def _state() -> AdapterState:
    return empty_state("slot:feed", "ranker-v1", SHAPES, RANK)


def _trained(seed: int = 0, scale: float = 0.1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * scale for k, v in _state().tensors.items()}


def test_encode_decode_round_trip() -> None:
    tensors = _trained()
    parts = select_parts(tensors, {"lin1": torch.tensor([0, 3]), "lin2": torch.tensor([], dtype=torch.int64)})
    assert list(parts) == ["lin1"]
    back = decode_delta(encode_delta(parts))
    assert list(back) == ["lin1"]
    assert back["lin1"].dirs.tolist() == [0, 3]
    assert torch.equal(back["lin1"].lora_A, tensors["lin1.lora_A"][[0, 3]])
    assert torch.equal(back["lin1"].lora_B, tensors["lin1.lora_B"][:, [0, 3]])


def test_apply_sequence_and_snapshot_reproduce_trainer_state() -> None:
    replica = _state()
    published = _state()
    tensors = _trained()
    d0 = make_delta(published, select_parts(tensors, {"lin1": torch.tensor([1])}), seq=0)
    replica = apply_delta(replica, d0, max_norm=10)
    assert replica.seq == 0
    assert torch.equal(replica.tensors["lin1.lora_A"][1], tensors["lin1.lora_A"][1])
    assert replica.tensors["lin1.lora_A"][0].abs().sum() == 0  # unlisted directions kept
    snap = make_delta(replica, full_parts(tensors, RANK), seq=1, snapshot=True)
    fresh = apply_delta(_state(), snap, max_norm=10)
    assert fresh.seq == 1
    for k in tensors:
        assert torch.equal(fresh.tensors[k], tensors[k])
    assert math.isclose(
        snap.norm, math.sqrt(sum(float(t.pow(2).sum()) for t in tensors.values())), rel_tol=1e-5
    )


def test_apply_does_not_mutate_input_state() -> None:
    state = _state()
    before = {k: v.clone() for k, v in state.tensors.items()}
    apply_delta(state, make_delta(state, select_parts(_trained(), {"lin2": [0]}), seq=0), max_norm=10)
    assert all(torch.equal(before[k], state.tensors[k]) for k in before)


def test_json_round_trip_of_delta_message() -> None:
    from schemas.codec import decode, encode
    from schemas.events import AdapterDelta

    d = make_delta(_state(), select_parts(_trained(), {"lin1": [2]}), seq=0)
    back = decode(AdapterDelta, encode(d))
    assert back == d
    assert apply_delta(_state(), back, max_norm=10).seq == 0


def _poison(parts: dict[str, torch.Tensor], norm: float = 0.1, seq: int = 0) -> object:
    from datetime import UTC, datetime

    from schemas.events import AdapterDelta

    now = datetime.now(UTC)
    return AdapterDelta(
        event_id="x",
        ts=now,
        adapter_id="slot:feed",
        base_version="ranker-v1",
        seq=seq,
        rank=RANK,
        payload=save(parts),
        norm=norm,
        created_at=now,
    )


@pytest.mark.parametrize(
    "tensors,match",
    [
        (
            {
                "lin1.dirs": torch.tensor([0]),
                "lin1.lora_A": torch.full((1, 10), float("nan")),
                "lin1.lora_B": torch.zeros(20, 1),
            },
            "non-finite",
        ),
        (
            {
                "lin1.dirs": torch.tensor([0]),
                "lin1.lora_A": torch.zeros(1, 11),
                "lin1.lora_B": torch.zeros(20, 1),
            },
            "do not fit",
        ),
        (
            {
                "lin1.dirs": torch.tensor([0]),
                "lin1.lora_A": torch.zeros(2, 10),
                "lin1.lora_B": torch.zeros(20, 1),
            },
            "1 dirs but lora_A has 2 rows",
        ),
        (
            {
                "lin1.dirs": torch.tensor([7]),
                "lin1.lora_A": torch.zeros(1, 10),
                "lin1.lora_B": torch.zeros(20, 1),
            },
            "outside 0",
        ),
        (
            {
                "lin1.dirs": torch.tensor([0]),
                "lin1.lora_A": torch.zeros(1, 10, dtype=torch.float64),
                "lin1.lora_B": torch.zeros(20, 1),
            },
            "must be float32|expected F32",
        ),
        ({"lin1.dirs": torch.tensor([0]), "lin1.lora_A": torch.zeros(1, 10)}, "lacks tensor"),
        (
            {
                "other.dirs": torch.tensor([0]),
                "other.lora_A": torch.zeros(1, 10),
                "other.lora_B": torch.zeros(20, 1),
            },
            "not a target",
        ),
        (
            {
                "lin1.dirs": torch.tensor([0, 0]),
                "lin1.lora_A": torch.zeros(2, 10),
                "lin1.lora_B": torch.zeros(20, 2),
            },
            "repeated",
        ),
    ],
)
def test_poisoned_payloads_rejected(tensors: dict[str, torch.Tensor], match: str) -> None:
    with pytest.raises(AdapterError, match=match):
        apply_delta(_state(), _poison(tensors, norm=0.0), max_norm=10)


def test_huge_norm_rejected_and_state_kept() -> None:
    state = _state()
    big = {k: v * 1000 for k, v in _trained(scale=1.0).items()}
    delta = make_delta(state, full_parts(big, RANK), seq=0)
    with pytest.raises(AdapterError, match=r"max_norm 10"):
        apply_delta(state, delta, max_norm=10)
    assert state.seq == -1


def test_declared_norm_must_match() -> None:
    parts = select_parts(_trained(), {"lin1": [0]})
    p = parts["lin1"]
    payload = {"lin1.dirs": p.dirs, "lin1.lora_A": p.lora_A, "lin1.lora_B": p.lora_B}
    with pytest.raises(AdapterError, match="field 'norm': declared"):
        apply_delta(_state(), _poison(payload, norm=5.0), max_norm=10)


def test_seq_gap_stale_and_identity_checks() -> None:
    state = _state()
    tensors = _trained()
    d0 = make_delta(state, select_parts(tensors, {"lin1": [0]}), seq=0)
    s0 = apply_delta(state, d0, max_norm=10)
    with pytest.raises(StaleDeltaError):
        apply_delta(s0, d0, max_norm=10)
    d2 = make_delta(s0, select_parts(_trained(1), {"lin1": [1]}), seq=2)
    with pytest.raises(SeqGapError, match="expected 1, got 2"):
        apply_delta(s0, d2, max_norm=10)
    other = AdapterState("slot:search", "ranker-v1", RANK, -1, state.tensors)
    with pytest.raises(AdapterError, match="field 'adapter_id'"):
        apply_delta(other, d0, max_norm=10)
    old_base = AdapterState("slot:feed", "ranker-v0", RANK, -1, state.tensors)
    with pytest.raises(AdapterError, match="field 'base_version'"):
        apply_delta(old_base, d0, max_norm=10)
    partial = make_delta(state, select_parts(tensors, {"lin1": [0, 1, 2, 3]}), seq=5, snapshot=True)
    with pytest.raises(AdapterError, match="snapshot lacks"):
        apply_delta(state, partial, max_norm=10)


def test_garbage_payload_and_empty_delta() -> None:
    with pytest.raises(AdapterError, match=r"not valid safetensors|header"):
        decode_delta(b"\x00\x01garbage")
    with pytest.raises(AdapterError, match="at least one"):
        encode_delta({})
    one = DeltaPart(torch.tensor([0]), torch.zeros(1, 10), torch.zeros(20, 1))
    assert list(decode_delta(encode_delta({"lin1": one}))) == ["lin1"]


def test_encode_delta_writes_the_bytes_safetensors_torch_writes() -> None:
    """The numpy path of `encode_delta` is the library's torch format byte for byte."""
    from safetensors.torch import save

    from schemas.delta import FORMAT, DeltaPart, encode_delta

    gen = torch.Generator().manual_seed(3)
    shapes = [("head", [0, 5], 155, 1), ("wide.category", [2], 256, 1), ("cross.0", [1, 3, 7], 38, 38)]
    parts = {
        m: DeltaPart(
            torch.tensor(d), torch.randn(len(d), n, generator=gen), torch.randn(o, len(d), generator=gen)
        )
        for m, d, n, o in shapes
    }
    flat = {}
    for m, p in parts.items():
        flat |= {f"{m}.dirs": p.dirs, f"{m}.lora_A": p.lora_A, f"{m}.lora_B": p.lora_B}
    assert encode_delta(parts) == save(flat, metadata={"format": FORMAT})
