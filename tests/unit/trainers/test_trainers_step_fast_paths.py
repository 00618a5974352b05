"""The cheap paths of the online step give what the generic ones gave, bit for bit."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers_trainers import make_examples
from safetensors.torch import save

from schemas.delta import (
    FORMAT,
    DeltaPart,
    change_norm,
    empty_state,
    encode_delta,
    make_delta,
    merge_parts,
    select_parts,
    verify_delta,
)
from schemas.settings import LoraSettings, OnlineSettings
from trainers.models.features import featurize
from trainers.models.lora import AdapterBank
from trainers.models.ranker import Ranker, RankerConfig
from trainers.online import OnlineTrainer, click_loss, module_thresholds


def _window(rng: np.random.Generator, steps: int, modules: int, r: int, dtype: type) -> list[np.ndarray]:
    kind = rng.integers(3)
    out = []
    for _ in range(steps):
        a = rng.random((modules, r)) * 10 ** rng.uniform(-6, 3)
        if kind == 1:  # many ties
            a = np.round(a, 1)
        elif kind == 2:  # many zeros (directions without gradient)
            a[rng.random((modules, r)) < 0.5] = 0
        out.append(a.astype(dtype))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_module_thresholds_equal_numpy_percentile_bit_for_bit(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for trial in range(500):
        dtype = (np.float32, np.float64)[trial % 2]
        steps, modules, r = (int(v) for v in rng.integers(1, (60, 6, 17)))
        window = _window(rng, steps, modules, r, dtype)
        pct = float(rng.choice([95.0, 50.0, 1.0, 99.9, rng.uniform(0.01, 99.99)]))
        stacked = np.stack(window)  # the definition: [steps, modules, r] → per module, all its values
        want = np.percentile(stacked.transpose(1, 0, 2).reshape(stacked.shape[1], -1), pct, axis=1)
        got = module_thresholds(window, pct)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_module_thresholds_edges_follow_numpy() -> None:
    one = [np.array([[3.0], [1.0]])]  # one value per module: it is every percentile
    np.testing.assert_array_equal(module_thresholds(one, 95.0), [3.0, 1.0])
    nan = [np.array([[1.0, np.nan, 2.0], [1.0, 2.0, 3.0]])]
    np.testing.assert_array_equal(module_thresholds(nan, 50.0), np.percentile(nan[0], 50.0, axis=1))


def test_click_loss_without_a_mask_is_the_unmasked_value_and_gradient() -> None:
    torch.manual_seed(0)
    z = torch.randn(64, requires_grad=True)
    y = (torch.rand(64) < 0.3).float()
    for fn_loss in ("weighted", "calibrated"):
        fast = click_loss(z, y, None, fn_loss)
        (g_fast,) = torch.autograd.grad(fast, z)
        slow = click_loss(z, y, torch.zeros(64, dtype=torch.bool), fn_loss)
        (g_slow,) = torch.autograd.grad(slow, z)
        assert torch.equal(fast, slow)
        assert torch.equal(g_fast, g_slow)


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {
        "head.lora_A": torch.randn(4, 6),
        "head.lora_B": torch.randn(1, 4),
        "wide.slot.lora_A": torch.randn(4, 3),
        "wide.slot.lora_B": torch.randn(1, 4),
    }


def test_merge_parts_copies_what_it_changes_and_never_writes_its_inputs() -> None:
    old = _state()
    frozen = {k: v.clone() for k, v in old.items()}
    parts = select_parts({k: v + 1 for k, v in old.items()}, {"head": torch.tensor([1, 3])})
    new = merge_parts(old, parts)
    for k, v in old.items():
        assert torch.equal(v, frozen[k]), k  # inputs untouched
    assert torch.equal(new["head.lora_A"][[1, 3]], frozen["head.lora_A"][[1, 3]] + 1)
    assert torch.equal(new["head.lora_A"][[0, 2]], frozen["head.lora_A"][[0, 2]])
    assert torch.equal(new["wide.slot.lora_A"], frozen["wide.slot.lora_A"])
    # a later merge into the new state does not reach the old one (nor what the two share)
    newer = merge_parts(new, select_parts(_state(), {"wide.slot": torch.tensor([0])}))
    assert torch.equal(old["wide.slot.lora_A"], frozen["wide.slot.lora_A"])
    assert torch.equal(newer["head.lora_A"], new["head.lora_A"])


def test_select_parts_never_aliases_the_state() -> None:
    state = _state()
    parts = select_parts(state, {"head": torch.tensor([0, 2])})
    before = parts["head"].lora_A.clone()
    state["head.lora_A"].add_(5.0)
    assert torch.equal(parts["head"].lora_A, before)


def test_make_delta_with_a_known_norm_is_the_same_signed_message() -> None:
    shapes = {"head": (6, 1), "wide.slot": (3, 1)}
    start = empty_state("feed", "v1", shapes, 4)
    parts = select_parts(_state(), {"head": torch.tensor([1]), "wide.slot": torch.tensor([0, 3])})
    key, now = b"k" * 32, datetime(2026, 1, 1, tzinfo=UTC)
    plain = make_delta(start, parts, 0, key=key, now=now)
    given = make_delta(start, parts, 0, key=key, now=now, norm=change_norm(start.tensors, parts))
    assert given == plain
    verify_delta(given, key)


def test_encode_delta_takes_any_layout_and_dtype_like_safetensors_torch() -> None:
    base = torch.randn(5, 4, dtype=torch.float64)
    part = DeltaPart(torch.tensor([3, 0], dtype=torch.int32), base[:2], base.T[:, :2])  # B not contiguous
    want = {
        "m.dirs": torch.tensor([3, 0], dtype=torch.int64),
        "m.lora_A": base[:2].float().contiguous(),
        "m.lora_B": base.T[:, :2].float().contiguous(),
    }
    assert encode_delta({"m": part}) == save(want, metadata={"format": FORMAT})


def test_reset_adapter_trains_its_new_weights() -> None:
    """The bank caches each adapter's LoRA parameters; a reset (new PEFT tensors) must not leave
    the trainer reading or stepping the old ones."""
    torch.manual_seed(0)
    bank = AdapterBank(Ranker(RankerConfig(state_dim=8)), LoraSettings(rank=4, alpha=8.0), "v1")
    trainer = OnlineTrainer(bank, OnlineSettings(min_step_examples=1))
    examples = make_examples(256, seed=3)
    trainer.learn(examples[:128])
    trainer.reset("feed", "test")
    live = dict(bank.model.named_parameters())
    cached = [p for pair in bank.lora_params("feed").values() for p in pair]
    assert all(any(p is q for q in live.values()) for p in cached)
    before = bank.get_state("feed")
    assert trainer.learn(examples[128:])  # a delta: the step changed the live weights
    after = bank.get_state("feed")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    batch = featurize(examples[128:], bank.config)
    logits, base = bank.train_logits_and_base(batch, "feed")
    assert torch.allclose(base, bank.base_logits(batch), atol=1e-5)
    assert not torch.allclose(logits.detach(), base, atol=1e-7)


def test_featurize_reads_training_examples_as_it_reads_any_object() -> None:
    """TrainingExamples are read from their `__dict__`; other objects (serving's candidates,
    stand-ins) through attributes: the same batch, with and without labels."""
    examples = make_examples(64, seed=5)
    cfg = RankerConfig(state_dim=8)
    fast = featurize(examples, cfg)
    plain = featurize([SimpleNamespace(**e.model_dump()) for e in examples], cfg)
    unlabelled = featurize([SimpleNamespace(**e.model_dump(exclude={"click"})) for e in examples], cfg)
    assert torch.equal(fast.dense, plain.dense) and torch.equal(fast.ids, plain.ids)
    assert fast.label is not None and plain.label is not None and torch.equal(fast.label, plain.label)
    assert torch.equal(fast.dense, unlabelled.dense) and unlabelled.label is None


def test_user_vectors_packed_as_doubles_equal_numpys_conversion() -> None:
    """The packed path gives what `np.fromiter(..., float32)` gives, for floats beyond float32
    (rounded, overflowing to inf), ints and numpy scalars; a value struct cannot pack falls back
    to numpy's own conversion or its error."""
    from itertools import chain

    from trainers.models.features import _vectors

    rng = np.random.default_rng(0)
    vecs = [list(rng.normal(size=4) * 10.0 ** rng.integers(-40, 40)) for _ in range(50)]
    vecs += [[1e39, -1e39, 1, 2], [np.float32(0.1), np.float64(1 / 3), True, 0]]
    with np.errstate(over="ignore"):  # 1e39 is inf in float32, either way
        want = np.fromiter(chain.from_iterable(vecs), dtype=np.float32).reshape(len(vecs), 4)
        got = _vectors(vecs, 4)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert np.array_equal(_vectors([["0.5", 1.0]], 2), np.array([[0.5, 1.0]], dtype=np.float32))
    with pytest.raises(ValueError, match="could not convert"):
        _vectors([["x", 1.0]], 2)


def test_adapter_optimizer_zero_grad_clears_every_lora_tensor_of_both_optimisers() -> None:
    """The direct `grad = None` covers what the optimisers' own `zero_grad` covers: the Adam
    (head) and the SGD (tables) tensors alike; `set_to_none=False` still zeroes in place."""
    from trainers.online import AdapterOptimizer

    targets = ("head", "wide.category")
    bank = AdapterBank(Ranker(RankerConfig(state_dim=8)), LoraSettings(rank=4, targets=targets), "v1")
    bank.ensure("feed")
    opt = AdapterOptimizer(bank, "feed", OnlineSettings())
    assert len(opt.optimizers) == 2
    owned = [p for o in opt.optimizers for g in o.param_groups for p in g["params"]]
    assert (
        {id(p) for p in opt.params} == {id(p) for p in owned} == {id(p) for p in bank.parameters_of("feed")}
    )
    for p in owned:
        p.grad = torch.ones_like(p)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in owned)
    opt.zero_grad()
    assert all(p.grad is None for p in owned)


def test_embedding_decay_shrinks_only_the_tables_by_lr_times_decay_times_the_steps_share() -> None:
    """`online.embedding_decay` forgets the id tables: with no gradient of its own, a step at
    `scale` multiplies each table tensor by 1 − embedding_lr × decay × scale; the Adam (head)
    tensors keep no decay; 0 (the default) leaves the tables as they were."""
    from trainers.online import AdapterOptimizer

    targets = ("head", "wide.category")
    for decay, scale in ((0.5, 1.0), (0.5, 0.25), (0.0, 1.0)):
        bank = AdapterBank(Ranker(RankerConfig(state_dim=8)), LoraSettings(rank=4, targets=targets), "v1")
        bank.ensure("feed")
        spec = OnlineSettings(embedding_lr=0.1, embedding_decay=decay)
        opt = AdapterOptimizer(bank, "feed", spec)
        tables = [
            p for m, pair in bank.lora_params("feed").items() if m in bank.embedding_modules for p in pair
        ]
        dense = [
            p for m, pair in bank.lora_params("feed").items() if m not in bank.embedding_modules for p in pair
        ]
        assert tables and dense
        with torch.no_grad():
            for p in tables + dense:
                p.copy_(torch.linspace(-1.0, 1.0, p.numel()).reshape(p.shape))
        before = [p.detach().clone() for p in tables + dense]
        for p in tables + dense:
            p.grad = torch.zeros_like(p)
        opt.step(scale)
        factor = 1.0 - 0.1 * decay * scale
        for p, b in zip(tables, before[: len(tables)], strict=True):
            torch.testing.assert_close(p.detach(), b * factor)
        for p, b in zip(dense, before[len(tables) :], strict=True):
            torch.testing.assert_close(p.detach(), b)  # Adam on a zero gradient: no move, no decay
    with pytest.raises(ValueError, match="embedding_decay"):
        OnlineSettings(embedding_decay=-0.1)
