"""The trainer's snapshot guard agrees with what a serving replica accepts (no services needed)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

import pytest
import torch
from helpers_trainers import make_examples

from schemas.delta import AdapterState, full_parts, make_delta
from schemas.errors import ConfigError
from schemas.events import AdapterDelta
from schemas.retry import Backoff
from schemas.settings import LoraSettings, OnlineSettings
from serving.adapters import AdapterStack
from serving.banked import target_layers
from serving.hotswap import DeltaApplier
from trainers.models.lora import AdapterBank
from trainers.models.ranker import Ranker, RankerConfig
from trainers.online import OnlineTrainer
from trainers.replay import replay
from trainers.snapshots import (
    ServeBound,
    SnapshotRefused,
    check_snapshot,
    check_state,
    delta_w_norm,
)

CFG = RankerConfig(
    state_dim=8, ad_buckets=64, advertiser_buckets=16, campaign_buckets=16, category_buckets=8, deep_hidden=16
)
VERSION = "ranker-unit"


@pytest.fixture(scope="module")
def trained() -> OnlineTrainer:
    torch.manual_seed(0)
    tr = OnlineTrainer(
        AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8, targets=("cross", "deep")), VERSION),
        OnlineSettings(lr=0.01, min_step_examples=16),
    )
    replay(make_examples(600, dim=8, adapters=("feed",)), tr, 64)
    return tr


def _bound(tr: OnlineTrainer, max_norm: float) -> ServeBound:
    return ServeBound(VERSION, tr.bank.spec.rank, tr.bank.spec.scaling, max_norm, tr.bank.shapes)


def _replica(max_norm: float) -> DeltaApplier:
    torch.manual_seed(1)
    bank = AdapterStack(target_layers(Ranker(CFG), ["cross", "deep"]), 4, 8.0, 4, max_norm)
    return DeltaApplier(bank, VERSION, max_norm=10.0)


def _source(snap: AdapterDelta) -> Callable[[str], Awaitable[AdapterDelta | None]]:
    async def read(adapter_id: str) -> AdapterDelta | None:
        return snap

    return read


def _snapshot(tr: OnlineTrainer, tensors: dict[str, torch.Tensor], **kw: object) -> AdapterDelta:
    pub = tr.runs["feed"].published
    state = AdapterState(
        "feed", str(kw.get("base_version", pub.base_version)), pub.rank, pub.seq, pub.tensors
    )
    return make_delta(
        state, full_parts(tensors, pub.rank), pub.seq + 1, snapshot=bool(kw.get("snapshot", True))
    )


def test_delta_w_norm_is_the_norm_serving_checks(trained: OnlineTrainer) -> None:
    state = trained.bank.get_state("feed")
    serving = _replica(1e9).bank
    weights = {m: (state[f"{m}.lora_A"], state[f"{m}.lora_B"]) for m in trained.bank.modules}
    ours = delta_w_norm(state, trained.bank.spec.scaling)
    assert ours > 0.1  # the adapter learned something, so the comparison means something
    assert math.isclose(ours, serving.check(weights), rel_tol=1e-9)


def test_check_state_names_the_reason(trained: OnlineTrainer) -> None:
    state = trained.bank.get_state("feed")
    norm = delta_w_norm(state, trained.bank.spec.scaling)
    assert check_state(state, _bound(trained, norm * 1.01)) == pytest.approx(norm)
    with pytest.raises(SnapshotRefused, match=r"exceeds serving\.adapter_max_norm") as over:
        check_state(state, _bound(trained, norm * 0.99))
    assert over.value.reason == "norm"
    broken = dict(state)
    broken["cross.0.lora_B"] = broken["cross.0.lora_B"].clone()
    broken["cross.0.lora_B"][0, 0] = math.nan
    with pytest.raises(SnapshotRefused, match=r"'cross\.0\.lora_B'") as nan:
        check_state(broken, _bound(trained, 1e9))
    assert nan.value.reason == "non_finite"


def test_check_snapshot_refuses_exactly_what_a_replica_refuses(trained: OnlineTrainer) -> None:
    """Each case goes through the trainer's guard and through a real replica (apply + bank check)."""
    state = trained.bank.get_state("feed")
    bound = 1000.0  # settings.serving.adapter_max_norm's default
    inflated = {k: v * 3000 if k.endswith("lora_B") else v for k, v in state.items()}
    good = _snapshot(trained, state)
    tampered = good.model_copy(update={"norm": good.norm * 2})
    cases: dict[str, tuple[AdapterDelta, str | None]] = {
        "good": (good, None),
        "oversized": (_snapshot(trained, inflated), "norm"),
        "other base": (_snapshot(trained, state, base_version="ranker-old"), "invalid"),
        "declared norm": (tampered, "invalid"),
        "not a snapshot": (_snapshot(trained, state, snapshot=False), "invalid"),
    }
    assert delta_w_norm(inflated, trained.bank.spec.scaling) > bound  # the oversized case really is
    for name, (snap, reason) in cases.items():
        replica = asyncio.run(
            _replica(bound).resync("feed", _source(snap))
        )  # how replicas load Redis snapshots
        try:
            check_snapshot(snap, "feed", _bound(trained, bound))
            ours = None
        except SnapshotRefused as exc:
            ours = exc.reason
        assert ours == reason, name
        assert (replica == "applied") == (reason is None), name


def test_check_snapshot_refuses_another_adapters_snapshot(trained: OnlineTrainer) -> None:
    snap = _snapshot(trained, trained.bank.get_state("feed"))
    with pytest.raises(SnapshotRefused, match="adapter_id") as exc:
        check_snapshot(snap, "search", _bound(trained, 1e9))
    assert exc.value.reason == "invalid"


def test_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="first_s"):
        Backoff(first_s=3.0, max_s=1.0)
    with pytest.raises(ConfigError, match="give_up_s"):
        Backoff(give_up_s=-1)
    with pytest.raises(ConfigError, match="max_norm"):
        ServeBound("v", 4, 2.0, 0.0, {})
