"""Slot adapters folded into copies of the base at swap time (`serving.ranking.FoldedSlots`):
requests whose candidates share one slot adapter are scored by a plain forward that equals the
banked (mixed-adapter) path; a swap refolds; per-advertiser adapters keep the banked path."""

from __future__ import annotations

import copy

import numpy as np
import torch

from schemas.settings import Settings
from serving.adapters import CANDIDATE, STABLE
from serving.ranking import RankInput, RankModel
from trainers.models.ranker import Ranker, RankerConfig

CFG = RankerConfig(state_dim=8, ad_buckets=64, advertiser_buckets=16, campaign_buckets=16, deep_hidden=16)
TARGETS = ("cross", "deep", "head", "emb.category", "wide.category", "wide.slot")


def _model() -> RankModel:
    torch.manual_seed(0)
    base = Ranker(CFG).eval()
    s = Settings(lora={"rank": 4, "alpha": 8.0, "targets": TARGETS}, serving={"adapter_capacity": 8})
    return RankModel(copy.deepcopy(base), "v0", s, torch.device("cpu"))


def _weights(rank: RankModel, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: (torch.randn(4, s.fan_in, generator=g) * 0.2, torch.randn(s.fan_out, 4, generator=g) * 0.2)
        for n, s in rank.bank.shapes.items()
    }


def _banked(rank: RankModel, inputs: list[RankInput]) -> list[np.ndarray]:
    """Scores through the banked layers only (the mixed-adapter path), for every input."""
    with torch.inference_mode():
        return rank._split(inputs, rank._forward(inputs, True))


def _input(rows: torch.Tensor, seed: int) -> RankInput:
    g = torch.Generator().manual_seed(seed)
    n = rows.shape[0]
    ids = torch.stack([torch.randint(0, s, (n,), generator=g) for s in CFG.table_sizes.values()], 1)
    return RankInput(torch.randn(n, CFG.dense_dim, generator=g), ids, rows)


def test_slot_adapters_are_folded_and_score_as_the_banked_path() -> None:
    rank = _model()
    for i, slot in enumerate(("feed", "search")):
        rank.bank.put(
            slot, _weights(rank, i), version="s0", seq=0, base_version="v0", arms=(STABLE, CANDIDATE)
        )
    rank.bank.put("adv:x", _weights(rank, 9), version="s0", seq=0, base_version="v0")
    feed, search = rank.bank.row("feed", CANDIDATE), rank.bank.row("search", STABLE)
    assert {feed, search, rank.bank.row("feed", STABLE)} <= set(rank.folded.models)
    assert rank.bank.row("adv:x", CANDIDATE) not in rank.folded.models  # advertisers: banked
    adv = rank.bank.row("adv:x", CANDIDATE)
    inputs = [
        _input(torch.full((30,), feed), 1),
        _input(torch.full((25,), search), 2),
        _input(torch.full((20,), 0), 3),  # no adapter (the arm's empty row): the plain model
        _input(torch.tensor([feed, adv] * 10), 4),  # mixed: the banked path
        _input(torch.full((15,), feed), 5),
    ]
    with rank.bank.reading() as buf:
        assert rank.folded.model_for(inputs[0].rows, buf) is not None
        assert rank.folded.model_for(inputs[3].rows, buf) is None
    got = rank.score(inputs, use_adapters=True)
    want = _banked(rank, inputs)
    base = rank.score(inputs, use_adapters=False)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)
    assert abs(got[0] - base[0]).max() > 1e-3  # the adapter does change the scores
    np.testing.assert_allclose(got[2], base[2], atol=1e-6)


def test_a_swap_refolds_the_changed_slot_only() -> None:
    rank = _model()
    rank.bank.put("feed", _weights(rank, 0), version="s0", seq=0, base_version="v0")
    rank.bank.put("search", _weights(rank, 1), version="s0", seq=0, base_version="v0")
    feed = rank.bank.row("feed", CANDIDATE)
    inp = [_input(torch.full((30,), feed), 1)]
    before = rank.score(inp, use_adapters=True)[0]
    folds = rank.folded.folds
    with rank.bank.reading() as old:  # a batch still bound to the old buffers
        rank.bank.put("feed", _weights(rank, 7), version="s1", seq=1, base_version="v0")
        assert rank.folded.folds == folds + 1  # feed refolded at the swap, search untouched
        assert rank.folded.model_for(inp[0].rows, old) is None  # its version is not the new fold's
    after = rank.score(inp, use_adapters=True)[0]
    assert abs(after - before).max() > 1e-4
    np.testing.assert_allclose(after, _banked(rank, inp)[0], atol=1e-5)
    rank.bank.evict("search")  # an evicted slot's copies go at that swap
    assert set(rank.folded.models) == {rank.bank.row("feed", arm) for arm in (STABLE, CANDIDATE)}


def test_a_failing_fold_leaves_the_swap_standing_and_the_banked_path_serving() -> None:
    """The fold runs as the bank's swap hook, after the buffers are swapped: an exception there
    came out of `bank.put`, so the replica's applier took a swapped-in delta for a failed one
    (its state not updated, the bank's moved). A hook's failure is logged; the swap stands and,
    without a fold, the banked path scores the slot's candidates."""
    rank = _model()

    def broken(buf, row):  # type: ignore[no-untyped-def]
        raise RuntimeError("fold failed")

    rank.folded.fold = broken  # type: ignore[method-assign]
    meta = rank.bank.put("feed", _weights(rank, 0), version="s0", seq=0, base_version="v0")
    assert meta.version == "s0" and rank.bank.meta["feed"].seq == 0
    feed = rank.bank.row("feed", CANDIDATE)
    assert feed not in rank.folded.models
    inp = [_input(torch.full((30,), feed), 1)]
    with rank.bank.reading() as buf:
        assert rank.folded.model_for(inp[0].rows, buf) is None
    np.testing.assert_allclose(rank.score(inp, use_adapters=True)[0], _banked(rank, inp)[0], atol=1e-5)
