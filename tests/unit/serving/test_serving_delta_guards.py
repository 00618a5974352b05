"""Forged, oversized and unbounded model updates (issue 14: M1, M2, M4, M13, H7)."""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path

import pytest
import torch

from schemas import codec
from schemas.delta import (
    AdapterState,
    check_header,
    decode_delta,
    empty_state,
    full_parts,
    make_delta,
    resolve_signing_key,
    select_parts,
    verify_delta,
)
from schemas.errors import AdapterError
from schemas.events import MAX_DELTA_BYTES, AdapterDelta
from schemas.settings import Settings
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
KEY = b"k" * 32


def _applier(key: bytes | None = KEY, capacity: int = 8, max_drift: float = 1e9) -> DeltaApplier:
    torch.manual_seed(0)
    rank = RankModel(
        copy.deepcopy(Ranker(CFG).eval()),
        "v0",
        Settings(lora={"rank": 4, "alpha": 8.0}, serving={"adapter_capacity": capacity}),
        torch.device("cpu"),
    )
    return DeltaApplier(rank.bank, "v0", max_norm=5.0, key=key, max_drift=max_drift)


def _shapes(a: DeltaApplier) -> dict[str, tuple[int, int]]:
    return {n: (s.fan_in, s.fan_out) for n, s in a.bank.shapes.items()}


def _step(state: AdapterState, scale: float, seed: int, key: bytes | None = KEY):  # type: ignore[no-untyped-def]
    """The trainer's side: change direction 0 of every module, publish the (signed) delta."""
    g = torch.Generator().manual_seed(seed)
    new = {k: v.clone() for k, v in state.tensors.items()}
    for k in new:
        if k.endswith("lora_A"):
            new[k][0] = torch.randn(new[k].shape[1], generator=g) * scale
        else:
            new[k][:, 0] = torch.randn(new[k].shape[0], generator=g) * scale
    parts = select_parts(new, {m: torch.tensor([0]) for m in state.modules})
    delta = make_delta(state, parts, state.seq + 1, key=key)
    return AdapterState(state.adapter_id, state.base_version, state.rank, state.seq + 1, new), delta


# -- M1: signatures ------------------------------------------------------------------------
def test_signed_delta_verifies_and_any_change_breaks_it() -> None:
    a = _applier()
    st = empty_state("feed", "v0", _shapes(a), 4)
    _, d = _step(st, 0.05, 1)
    assert d.signature is not None and len(d.signature) == 64
    verify_delta(d, KEY)
    again = codec.decode(AdapterDelta, codec.encode(d))  # survives the wire
    verify_delta(again, KEY)  # type: ignore[arg-type]
    for change in (
        {"seq": 5},
        {"norm": d.norm + 1e-9},
        {"adapter_id": "search"},
        {"payload": d.payload + b" "},
    ):
        with pytest.raises(AdapterError, match="signature"):
            verify_delta(d.model_copy(update=change), KEY)
    with pytest.raises(AdapterError, match="signature"):
        verify_delta(d, b"x" * 32)


def test_replica_with_a_key_refuses_unsigned_and_forged_deltas() -> None:
    a = _applier()
    st = empty_state("feed", "v0", _shapes(a), 4)
    _, unsigned = _step(st, 0.05, 1, key=None)
    _, forged = _step(st, 0.05, 1, key=b"attacker-key-attacker-key-000000")
    assert a.apply(unsigned) == "unsigned"
    assert a.apply(forged) == "unsigned"
    assert "feed" not in a.bank.meta  # nothing installed
    _, good = _step(st, 0.05, 1)
    assert a.apply(good) == "applied"
    # a replica without a key (unit tests, an explicitly open setup) takes unsigned deltas
    open_ = _applier(key=None)
    assert open_.apply(unsigned) == "applied"


def _step_dir(state: AdapterState, direction: int, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    new = {k: v.clone() for k, v in state.tensors.items()}
    for k in new:
        if k.endswith("lora_A"):
            new[k][direction] = torch.randn(new[k].shape[1], generator=g) * 0.2
        else:
            new[k][:, direction] = torch.randn(new[k].shape[0], generator=g) * 0.2
    parts = select_parts(new, {m: torch.tensor([direction]) for m in state.modules})
    delta = make_delta(state, parts, state.seq + 1, key=KEY)
    return AdapterState(state.adapter_id, state.base_version, state.rank, state.seq + 1, new), delta


def test_cumulative_change_since_the_promoted_version_is_bounded() -> None:
    """M1: chained deltas each under the per-delta bound would walk an adapter anywhere; the
    candidate may move at most `max_drift` from what was promoted (rejected: `drift`)."""
    probe = _applier()
    _, first = _step_dir(empty_state("feed", "v0", _shapes(probe), 4), 0, 0)
    a = _applier(max_drift=1.5 * first.norm)  # each delta moves one of 4 directions by ~norm
    st = empty_state("feed", "v0", _shapes(a), 4)
    outcomes = []
    for i in range(4):
        nxt, d = _step_dir(st, i, 0)  # same values: every delta moves it by the same norm
        assert d.norm < a.max_norm
        outcomes.append(a.apply(d))
        if outcomes[-1] == "applied":
            st = nxt
    assert outcomes[:2] == ["applied", "applied"] and outcomes[2] == "drift"
    assert a.states["feed"].seq == 1
    # after a promotion the candidate is the new reference: the next delta applies again
    a.promote()
    _, d = _step_dir(st, 2, 0)
    assert a.apply(d) == "applied"


def test_snapshot_far_from_the_promoted_version_is_refused_live() -> None:
    a = _applier(max_drift=1.0)
    st = empty_state("feed", "v0", _shapes(a), 4)
    big = {k: torch.full_like(v, 0.5) for k, v in st.tensors.items()}
    snap = make_delta(AdapterState("feed", "v0", 4, 0, big), full_parts(big, 4), 0, snapshot=True, key=KEY)
    assert a.apply(snap) == "drift"
    # the start-up load (what trainers last snapshotted) is the promoted starting point
    assert a.apply(snap, initial=True) == "applied"


def test_signing_key_resolution(tmp_path: Path) -> None:
    s = Settings(state_dir=tmp_path, delta_signing_key="")
    key = resolve_signing_key(s)
    assert key is not None and len(key) >= 32
    assert (tmp_path / "delta-signing.key").stat().st_mode & 0o077 == 0  # owner only
    assert resolve_signing_key(s) == key  # every process of the stack reads the same key
    explicit = Settings(state_dir=tmp_path, delta_signing_key="z" * 40)
    assert resolve_signing_key(explicit) == b"z" * 40
    with pytest.raises(Exception, match="delta_signing_key"):
        resolve_signing_key(Settings(state_dir=tmp_path, delta_signing_key="short"))


# -- M13: safetensors header before decoding -----------------------------------------------
def _raw_safetensors(header: dict[str, object], data: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def test_header_declaring_thousands_of_tensors_is_refused_before_decoding() -> None:
    header: dict[str, object] = {
        f"m{i}.dirs": {"dtype": "I64", "shape": [0], "data_offsets": [0, 0]} for i in range(5000)
    }
    with pytest.raises(AdapterError, match="header declares"):  # 5,000 entries: ~400 KB of header
        check_header(_raw_safetensors(header), modules=["head"])
    with pytest.raises(AdapterError, match="header declares"):
        decode_delta(_raw_safetensors(header))
    few = dict(list(header.items())[:40])
    with pytest.raises(AdapterError, match="40 tensors"):
        check_header(_raw_safetensors(few), modules=["head"])


@pytest.mark.parametrize(
    "header, match",
    [
        ({"evil.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, "evil.weight"),
        ({"head.lora_A": {"dtype": "F64", "shape": [1, 1], "data_offsets": [0, 8]}}, "dtype"),
        ({"head.lora_A": {"dtype": "F32", "shape": [100000, 100000], "data_offsets": [0, 4]}}, "shape"),
        ({"other.lora_A": {"dtype": "F32", "shape": [1, 1], "data_offsets": [0, 4]}}, "other"),
    ],
)
def test_header_names_dtypes_and_shapes_are_checked(header: dict[str, object], match: str) -> None:
    with pytest.raises(AdapterError, match=match):
        check_header(_raw_safetensors(header, b"\0" * 8), modules=["head"])


def test_header_length_is_bounded() -> None:
    with pytest.raises(AdapterError, match="header"):
        check_header(struct.pack("<Q", 2**40) + b"{}", modules=None)
    with pytest.raises(AdapterError, match="header"):
        check_header(b"\x01\x02", modules=None)


def test_a_largest_delta_fits_the_producer_limit() -> None:
    """M13: the contract's payload bound fits one Kafka request (aiokafka's 1 MiB default)."""
    import datetime as dt

    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    msg = AdapterDelta(
        event_id="e" * 64,
        ts=now,
        adapter_id="a" * 64,
        base_version="v" * 64,
        seq=2**53 - 1,
        rank=256,
        payload=b"\xff" * MAX_DELTA_BYTES,
        norm=1.0,
        created_at=now,
        signature="f" * 64,
    )
    assert len(codec.encode(msg)) < 1024 * 1024


# -- M2: bounded bank ----------------------------------------------------------------------
def test_bank_evicts_the_least_recently_updated_adapter_when_full() -> None:
    a = _applier(capacity=4)
    states = {}
    for i in range(6):
        st = empty_state(f"adv:{i}", "v0", _shapes(a), 4)
        states[i], d = _step(st, 0.05, i)
        assert a.apply(d) == "applied"
    assert len(a.bank.meta) == 4 and a.outcomes["evicted"] == 2
    assert "adv:0" not in a.bank.meta and "adv:1" not in a.bank.meta
    assert "adv:0" not in a.states
    slots = sorted(m.slot for m in a.bank.meta.values())
    assert slots == [1, 2, 3, 4]  # freed slots were reused; rows stay inside the bank
    m = states[5].modules[0]
    assert torch.allclose(a.bank.weights("adv:5")[m][0], states[5].tensors[f"{m}.lora_A"])
    # an evicted adapter that comes back starts over (its next delta gaps → re-sync)
    _, d = _step(states[0], 0.05, 50)
    assert a.apply(d) == "gap"


def test_pinned_adapters_are_not_evicted() -> None:
    a = _applier(capacity=2)
    st0 = empty_state("adv:0", "v0", _shapes(a), 4)
    st0, d = _step(st0, 0.05, 0)
    a.apply(d)
    _, d = _step(st0, 0.05, 1)
    a.apply(d)
    a.rollback("adv:0")
    for i in (1, 2, 3):
        _, d = _step(empty_state(f"adv:{i}", "v0", _shapes(a), 4), 0.05, i)
        a.apply(d)
    assert "adv:0" in a.bank.meta and a.pinned["adv:0"] == 0


# -- M4: rollback racing a delta -----------------------------------------------------------
def test_a_held_adapter_takes_no_delta_until_released() -> None:
    """The rollback route holds the adapter while it stores the pin (an await): a delta that
    arrives meanwhile is not applied, so the seq stored is the one rolled back to."""
    a = _applier()
    st = empty_state("feed", "v0", _shapes(a), 4)
    for i in range(2):
        st, d = _step(st, 0.05, i)
        a.apply(d)
    seq = a.hold("feed")
    assert seq == 0  # the previous version's seq, what the pin will store
    st, d = _step(st, 0.05, 9)
    assert a.apply(d) == "pinned"
    info = a.rollback("feed", expect_seq=seq)
    assert info.seq == 0 and info.pinned
    with pytest.raises(AdapterError, match="seq"):
        b = _applier()
        s2 = empty_state("feed", "v0", _shapes(b), 4)
        for i in range(3):
            s2, d = _step(s2, 0.05, i)
            b.apply(d)
        b.rollback("feed", expect_seq=0)  # previous is seq 1 now: refuse, never pin another seq


def test_pin_from_another_replica_at_a_seq_not_held_loads_the_pinned_weights() -> None:
    """Replica A rolled back to seq 1; replica B is at seq 3 (previous 2): B installs the weights
    A pinned (shared with the pin) instead of ignoring the pin or rolling back to seq 2."""
    a, b = _applier(), _applier()
    st = empty_state("feed", "v0", _shapes(a), 4)
    for i in range(4):
        st, d = _step(st, 0.05, i)
        if i < 3:
            a.apply(d)
        b.apply(d)
    seq = a.hold("feed")
    a.rollback("feed", expect_seq=seq)
    pinned = a.pinned_snapshot("feed")
    assert pinned.seq == 1 and pinned.snapshot and pinned.signature is not None
    b.sync_pins({"feed": 1}, {"feed": pinned})
    assert b.pinned["feed"] == 1 and b.bank.meta["feed"].seq == 1
    m = st.modules[0]
    assert torch.equal(b.bank.weights("feed", 0)[m][0], a.bank.weights("feed", 0)[m][0])


# -- M1/M2 on the trainer's side: what it publishes is signed; the adapters it holds are bounded
def test_trainer_signs_deltas_and_snapshots_and_bounds_its_adapters() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parents[2] / "unit" / "trainers"))
    from helpers_trainers import make_examples

    from schemas.settings import LoraSettings, OnlineSettings
    from trainers.models.lora import AdapterBank
    from trainers.online import OnlineTrainer

    torch.manual_seed(0)
    cfg = RankerConfig(
        state_dim=8,
        ad_buckets=64,
        advertiser_buckets=16,
        campaign_buckets=16,
        category_buckets=8,
        deep_hidden=16,
    )
    bank = AdapterBank(Ranker(cfg), LoraSettings(rank=4, alpha=8), "ranker-v1")
    spec = OnlineSettings(lr=0.01, min_step_examples=16, max_adapters=2)
    tr = OnlineTrainer(bank, spec, signing_key=KEY)
    deltas = []
    for adapter in ("feed", "search", "splash"):  # a third adapter evicts the least recent one
        deltas += tr.learn(make_examples(100, dim=8, adapters=(adapter,)), flush=True) + tr.take_pending()
    assert set(tr.runs) == {"search", "splash"} and set(bank.adapters) == {"search", "splash"}
    assert tr.counts["evictions"] == 1
    (gone,) = tr.take_evicted()
    assert gone.adapter_id == "feed" and gone.snapshot and gone in deltas
    assert deltas and all(d.signature is not None for d in deltas)
    for d in [*deltas, tr.snapshot("search")]:
        verify_delta(d, KEY)
    # a batch naming more adapters than the limit keeps them all (counted), never drops examples
    tr.learn(make_examples(60, dim=8, adapters=("feed", "search", "splash")), flush=True)
    assert set(tr.runs) == {"feed", "search", "splash"} and tr.counts["over_limit"] == 1


def test_trainer_from_settings_shares_the_stack_key(tmp_path: Path) -> None:
    from trainers.models.lora import AdapterBank
    from trainers.online import OnlineTrainer

    s = Settings(state_dir=tmp_path)
    bank = AdapterBank(Ranker(RankerConfig(state_dim=8, deep_hidden=16)), s.lora, "v1")
    assert OnlineTrainer.from_settings(bank, s).signing_key == resolve_signing_key(s)
