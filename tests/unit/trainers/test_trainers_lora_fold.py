"""`fold_lora`: a slot's LoRA ΔW folded into a copy of the base ranker scores as base + adapter
does through the existing adapter paths (serving's banked layers, PEFT's forward)."""

from __future__ import annotations

import copy

import pytest
import torch

from schemas.delta import AdapterState, apply_delta, empty_state, full_parts, make_delta
from schemas.errors import AdapterError
from schemas.settings import LoraSettings, Settings
from serving.adapters import CANDIDATE
from serving.hotswap import to_weights
from serving.ranking import RankInput, RankModel
from trainers.models.features import RankerBatch
from trainers.models.lora import AdapterBank, fold_lora, target_shapes
from trainers.models.ranker import Ranker, RankerConfig

CFG = RankerConfig(
    state_dim=8, ad_buckets=64, advertiser_buckets=16, campaign_buckets=16, category_buckets=8, deep_hidden=16
)
SLOTS = ("feed", "search", "splash")
DEFAULT_TARGETS = ("head", "wide.category", "wide.slot", "wide.position")  # settings' default
WIDE_TARGETS = ("cross", "deep", "head", "emb.category", "wide.category")  # factor paths, id tables


def _base(seed: int = 0) -> Ranker:
    torch.manual_seed(seed)
    model = Ranker(CFG).eval()
    with torch.no_grad():  # non-zero wide biases, so a fold that dropped them would show
        for table in model.wide.values():
            table.weight.normal_(0, 0.3)
    return model


def _features(n: int, slot: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randint(0, s, (n,), generator=gen) for s in CFG.table_sizes.values()], 1)
    ids[:, 4] = slot
    return torch.randn(n, CFG.dense_dim, generator=gen), ids


def _random_state(
    adapter_id: str, model: Ranker, targets: tuple[str, ...], rank: int, seed: int
) -> AdapterState:
    """A random adapter state that went through the delta format: encoded as a snapshot and
    applied onto an empty state (what a replica's `DeltaApplier` holds)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = target_shapes(model, targets)
    tensors = {}
    for m, (fan_in, fan_out) in shapes.items():
        tensors[f"{m}.lora_A"] = torch.randn(rank, fan_in, generator=gen) * 0.2
        tensors[f"{m}.lora_B"] = torch.randn(fan_out, rank, generator=gen) * 0.2
    empty = empty_state(adapter_id, "v1", shapes, rank)
    filled = AdapterState(adapter_id, "v1", rank, -1, tensors)
    delta = make_delta(filled, full_parts(tensors, rank), 0, snapshot=True)
    return apply_delta(empty, delta, max_norm=1e9)


@pytest.mark.parametrize("targets", [DEFAULT_TARGETS, WIDE_TARGETS], ids=["default", "cross_deep_emb"])
def test_folded_slots_score_as_the_serving_bank(targets: tuple[str, ...]) -> None:
    lora = LoraSettings(rank=4, alpha=8, targets=targets)
    settings = Settings(lora=lora, serving={"adapter_capacity": 8})
    base = _base()
    served = RankModel(copy.deepcopy(base), "v1", settings, torch.device("cpu"))
    states = {slot: _random_state(slot, base, targets, lora.rank, seed=i) for i, slot in enumerate(SLOTS)}
    for slot, state in states.items():
        served.bank.put(slot, to_weights(state), version="seq-0", seq=0, base_version="v1")
    # one mixed batch of requests of every slot, as a replica scores it (merged and dense paths)
    inputs, want = [], []
    for j, slot in enumerate([*SLOTS, *SLOTS]):
        dense, ids = _features(40 + 7 * j, SLOTS.index(slot), seed=j)
        rows = torch.full((len(ids),), served.bank.row(slot, CANDIDATE), dtype=torch.int64)
        inputs.append(RankInput(dense, ids, rows))
        folded = fold_lora(base, states[slot].tensors, lora.scaling)
        with torch.no_grad():
            want.append(torch.sigmoid(folded(dense, ids)).numpy())
    got = served.score(inputs, use_adapters=True)
    base_scores = served.score(inputs, use_adapters=False)
    for g, w, b in zip(got, want, base_scores, strict=True):
        assert abs(g - w).max() < 1e-5
        assert abs(g - b).max() > 1e-3  # the adapters do change the scores


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_folded_logits_equal_peft_adapters(seed: int) -> None:
    lora = LoraSettings(rank=4, alpha=8, targets=WIDE_TARGETS)
    base = _base(seed)
    bank = AdapterBank(base, lora, "v1")
    dense, ids = _features(64, seed % 3, seed=100 + seed)
    for i, slot in enumerate(SLOTS):
        state = _random_state(slot, base, WIDE_TARGETS, lora.rank, seed=10 * seed + i)
        bank.set_state(slot, dict(state.tensors))
        folded = fold_lora(base, state.tensors, lora.scaling)
        with torch.no_grad():
            assert torch.allclose(
                folded(dense, ids), bank.logits(RankerBatch(dense, ids), [slot] * 64), atol=1e-5
            )


def test_fold_is_pure_and_exact_where_it_should_be() -> None:
    base = _base()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    state = _random_state("feed", base, DEFAULT_TARGETS, 4, seed=3)
    tensors_before = {k: v.clone() for k, v in state.tensors.items()}
    folded = fold_lora(base, state.tensors, 2.0)
    assert folded is not base and isinstance(folded, Ranker)
    assert all(torch.equal(v, before[k]) for k, v in base.state_dict().items())
    assert all(torch.equal(v, tensors_before[k]) for k, v in state.tensors.items())
    # untargeted weights copied as they are; a zero adapter folds to the base weights exactly
    assert torch.equal(folded.deep[0].weight, base.deep[0].weight)
    assert folded.deep[0].weight.data_ptr() != base.deep[0].weight.data_ptr()
    zero = fold_lora(base, empty_state("feed", "v1", target_shapes(base, DEFAULT_TARGETS), 4).tensors, 2.0)
    assert all(torch.equal(v, before[k]) for k, v in zero.state_dict().items())
    # the table is W + scale·(B A)ᵀ, one row per id
    a, b = state.tensors["wide.category.lora_A"], state.tensors["wide.category.lora_B"]
    want = base.wide["category"].weight + 2.0 * (b @ a).T
    assert torch.allclose(folded.wide["category"].weight, want, atol=1e-6)
    assert not folded.training and all(
        p.requires_grad == q.requires_grad
        for p, q in zip(folded.parameters(), base.parameters(), strict=True)
    )


def test_fold_keeps_a_bf16_model_bf16() -> None:
    base = _base().to(torch.bfloat16)
    state = _random_state("feed", _base(), DEFAULT_TARGETS, 4, seed=4)
    folded = fold_lora(base, state.tensors, 2.0)
    assert folded.head.weight.dtype == torch.bfloat16


def test_fold_rejects_bad_adapters_naming_the_tensor() -> None:
    base = _base()
    good = dict(_random_state("feed", base, DEFAULT_TARGETS, 4, seed=5).tensors)
    with pytest.raises(AdapterError, match=r"'head'.*lack.*head.lora_B"):
        fold_lora(base, {k: v for k, v in good.items() if k != "head.lora_B"}, 2.0)
    with pytest.raises(AdapterError, match=r"no module 'nope'"):
        fold_lora(base, {**good, "nope.lora_A": torch.zeros(4, 3), "nope.lora_B": torch.zeros(1, 4)}, 2.0)
    with pytest.raises(AdapterError, match=r"'input_norm' is LayerNorm"):
        fold_lora(
            base, {"input_norm.lora_A": torch.zeros(4, 11), "input_norm.lora_B": torch.zeros(11, 4)}, 2.0
        )
    with pytest.raises(AdapterError, match=r"module 'head'.*do not fit"):
        fold_lora(base, {**good, "head.lora_A": torch.zeros(4, 3)}, 2.0)
    with pytest.raises(AdapterError, match=r"module 'head': non-finite"):
        fold_lora(base, {**good, "head.lora_B": torch.full_like(good["head.lora_B"], float("nan"))}, 2.0)


def test_fold_refuses_a_model_serving_already_wrapped() -> None:
    settings = Settings(lora=LoraSettings(rank=4, alpha=8), serving={"adapter_capacity": 2})
    served = RankModel(_base(), "v1", settings, torch.device("cpu"))
    state = _random_state("feed", _base(), DEFAULT_TARGETS, 4, seed=6)
    with pytest.raises(AdapterError, match=r"BankedLinear.*plain ranker"):
        fold_lora(served.model, state.tensors, 2.0)
