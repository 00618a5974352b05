"""Slot adapters folded into copies of the base at swap time (`serving.ranking.FoldedSlots`):
requests whose candidates share one slot adapter are scored by a plain forward that equals the
banked (mixed-adapter) path; a swap refolds, in each buffer's own copy, so a batch bound to the
old buffers keeps the old fold; per-advertiser adapters keep the banked path."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
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
    assert {feed, search, rank.bank.row("feed", STABLE)} <= rank.folded.rows()
    assert rank.bank.row("adv:x", CANDIDATE) not in rank.folded.rows()  # advertisers: banked
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
        held = rank.folded.model_for(inp[0].rows, old)
        assert held is not None
        rank.bank.put("feed", _weights(rank, 7), version="s1", seq=1, base_version="v0")
        assert rank.folded.folds == folds + 1  # feed refolded at the swap, search untouched
        # the held batch's fold did not move: it still scores as the old weights do
        assert rank.folded.model_for(inp[0].rows, old) is held
        with torch.inference_mode():
            np.testing.assert_allclose(
                torch.sigmoid(held(inp[0].dense, inp[0].ids)).numpy(), before, atol=1e-6
            )
        # a second swap while the batch holds them: a fresh copy of the buffers, folds included
        rank.bank.put("feed", _weights(rank, 8), version="s2", seq=2, base_version="v0")
        assert rank.folded.model_for(inp[0].rows, old) is held
    after = rank.score(inp, use_adapters=True)[0]
    assert abs(after - before).max() > 1e-4
    np.testing.assert_allclose(after, _banked(rank, inp)[0], atol=1e-5)
    with rank.bank.reading() as buf:
        assert rank.folded.model_for(inp[0].rows, buf) is not held
    rank.bank.put("feed", _weights(rank, 9), version="s3", seq=3, base_version="v0")  # both copies caught up
    np.testing.assert_allclose(rank.score(inp, use_adapters=True)[0], _banked(rank, inp)[0], atol=1e-5)
    rank.bank.evict("search")  # an evicted slot's copies go at that swap
    assert rank.folded.rows() == {feed}
    rank.bank.put("noise", _weights(rank, 2), version="s0", seq=0, base_version="v0")
    assert rank.folded.rows() == {feed}  # not a slot: banked


def test_the_fold_equals_the_trainers_fold_and_promotion_copies_it() -> None:
    """The replica's fold is `trainers.models.lora.fold_lora`'s (W + scale·B·A summed in float64,
    rounded once); promotion makes each stable row's fold its candidate's, in both buffers."""
    rank = _model()
    w = _weights(rank, 3)
    rank.bank.put("feed", w, version="s0", seq=0, base_version="v0")
    cand, stable = rank.bank.row("feed", CANDIDATE), rank.bank.row("feed", STABLE)
    assert rank.folded.rows() == {cand}
    with rank.bank.reading() as buf:
        model = rank.folded.model_for(torch.full((3,), cand), buf)
    assert model is not None
    for name, (a, b) in w.items():
        layer = rank.folded.plain.get_submodule(name)
        delta = b.double() @ a.double()
        if isinstance(layer, torch.nn.Embedding):
            delta = delta.T
        want = (layer.weight.double() + rank.bank.scale * delta).float()
        assert torch.equal(model.get_submodule(name).weight, want), name
    rank.bank.promote()
    assert rank.folded.rows() == {cand, stable}
    rank.bank.put("feed", _weights(rank, 4), version="s1", seq=1, base_version="v0")  # the other copy
    inp = [_input(torch.full((20,), stable), 6), _input(torch.full((20,), cand), 7)]
    with rank.bank.reading() as buf:
        assert rank.folded.model_for(inp[0].rows, buf) is not None
    got, want = rank.score(inp, use_adapters=True), _banked(rank, inp)
    for g, x in zip(got, want, strict=True):
        np.testing.assert_allclose(g, x, atol=1e-5)
    assert abs(got[0] - got[1]).max() > 1e-4  # stable kept s0, the candidate moved to s1


def test_a_failing_fold_leaves_the_swap_standing_and_the_banked_path_serving() -> None:
    """A fold that fails must not fail the swap (the replica's applier would take a swapped-in
    delta for a failed one: its state not updated, the bank's moved): it is logged, the swap
    stands and, without a fold, the banked path scores the slot's candidates."""
    rank = _model()

    def broken(weights):  # type: ignore[no-untyped-def]
        raise RuntimeError("fold failed")

    rank.folded.fold = broken  # type: ignore[method-assign]
    meta = rank.bank.put("feed", _weights(rank, 0), version="s0", seq=0, base_version="v0")
    assert meta.version == "s0" and rank.bank.meta["feed"].seq == 0
    feed = rank.bank.row("feed", CANDIDATE)
    assert feed not in rank.folded.rows()
    inp = [_input(torch.full((30,), feed), 1)]
    with rank.bank.reading() as buf:
        assert rank.folded.model_for(inp[0].rows, buf) is None
    np.testing.assert_allclose(rank.score(inp, use_adapters=True)[0], _banked(rank, inp)[0], atol=1e-5)


def test_several_slots_in_one_batch_run_the_trunk_once_when_the_targets_add_to_the_logit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the default targets (head and wide tables, which only add to the logit), a batch of
    several slots' requests is scored in one pass, the trunk once and the slots' heads and tables
    stacked (`RankModel._forward_stacked`), and equals the banked path, before and after a swap;
    with targets inside the trunk (the module's other tests) it is not stackable."""
    assert not _model().stackable
    torch.manual_seed(0)
    s = Settings(lora={"rank": 4, "alpha": 8.0}, serving={"adapter_capacity": 8})  # default targets
    rank = RankModel(copy.deepcopy(Ranker(CFG).eval()), "v0", s, torch.device("cpu"))
    assert rank.stackable and set(rank.bank.shapes) == set(s.lora.targets)
    rank.chunk = 64  # several chunks, each across slots
    for i, slot in enumerate(("feed", "search", "splash")):
        rank.bank.put(
            slot, _weights(rank, i), version="s0", seq=0, base_version="v0", arms=(STABLE, CANDIDATE)
        )
    rows = [rank.bank.row(x, CANDIDATE) for x in ("feed", "search", "splash")]
    inputs = [_input(torch.full((n,), rows[k % 3]), k) for k, n in enumerate((30, 25, 40, 17, 50, 9))]
    inputs.append(_input(torch.full((20,), 0), 7))  # no adapter: the plain model's head and tables
    inputs[1] = dataclasses.replace(inputs[1], offset=torch.randn(25))  # a per-user correction
    calls: list[int] = []
    stacked = rank._forward_stacked
    monkeypatch.setattr(rank, "_forward_stacked", lambda *a: calls.append(1) or stacked(*a))
    got = rank.score(inputs, use_adapters=True)
    assert calls == [1]
    for g, w in zip(got, _banked(rank, inputs), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)
    base = rank.score(inputs, use_adapters=False)
    assert abs(got[0] - base[0]).max() > 1e-3  # the adapters do change the scores
    np.testing.assert_allclose(got[-1], base[-1], atol=1e-6)
    # a swap of one slot: the next batch reads the new fold, the others' stay as they were
    rank.bank.put(
        "search", _weights(rank, 11), version="s1", seq=1, base_version="v0", arms=(STABLE, CANDIDATE)
    )
    after = rank.score(inputs, use_adapters=True)
    for g, w in zip(after, _banked(rank, inputs), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)
    assert abs(after[1] - got[1]).max() > 1e-3
    np.testing.assert_allclose(after[0], got[0], atol=1e-6)


def test_a_known_shared_row_picks_the_fold_unchecked_and_the_base_pass_equals_the_banked_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`RankInput.row` (the row the ad server knows every candidate shares: a slot adapter's)
    picks the same model as checking each row does; scores with the hint equal those without;
    and the base pass (no adapters: the control arm, the frozen rung) runs through the same
    stacked pass as the slots' folds (the plain model alone) and equals the banked layers with
    the adapters off."""
    torch.manual_seed(0)
    s = Settings(lora={"rank": 4, "alpha": 8.0}, serving={"adapter_capacity": 8})  # default targets
    rank = RankModel(copy.deepcopy(Ranker(CFG).eval()), "v0", s, torch.device("cpu"))
    rank.chunk = 64
    for i, slot in enumerate(("feed", "search")):
        rank.bank.put(
            slot, _weights(rank, i), version="s0", seq=0, base_version="v0", arms=(STABLE, CANDIDATE)
        )
    rank.bank.put("adv:x", _weights(rank, 9), version="s0", seq=0, base_version="v0")
    feed, search, adv = (rank.bank.row(x, CANDIDATE) for x in ("feed", "search", "adv:x"))
    with rank.bank.reading() as buf:
        for r in (feed, search, 0, adv):
            rows = torch.full((5,), r)
            assert rank.folded.model_for(rows, buf, r) is rank.folded.model_for(rows, buf)
        assert rank.folded.model_for(torch.full((5,), adv), buf, adv) is None  # not folded: banked
    inputs = [_input(torch.full((n,), (feed, search, 0)[k % 3]), k) for k, n in enumerate((30, 70, 25, 41))]
    inputs[2] = dataclasses.replace(inputs[2], offset=torch.randn(25))
    hinted = [dataclasses.replace(i, row=int(i.rows[0])) for i in inputs]
    unhinted = rank.score(inputs, use_adapters=True)
    for a, b in zip(rank.score(hinted, use_adapters=True), unhinted, strict=True):
        np.testing.assert_array_equal(a, b)
    calls: list[int] = []
    stacked = rank._forward_stacked
    monkeypatch.setattr(rank, "_forward_stacked", lambda *a: calls.append(1) or stacked(*a))
    base = rank.score(inputs, use_adapters=False)
    assert calls == [1]
    with torch.inference_mode():
        banked_off = rank._split(inputs, rank._forward(inputs, False))
    for g, w in zip(base, banked_off, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-6)


@pytest.mark.parametrize("combined_max", [1 << 16, 1])
def test_a_batch_of_named_rows_groups_by_row_and_the_adapted_tables_combine_or_not(
    monkeypatch: pytest.MonkeyPatch, combined_max: int
) -> None:
    """Every input naming its row (`RankInput.row`) takes the grouped pass by row
    (`_score_named_rows`): both arms' empty rows are the plain model, a row that is not folded
    (an advertiser's adapter) or an input without its row sends the batch down the general path;
    each scores as the banked layers do. The adapted wide tables are summed into one table per
    model (`_combined`) where their rows multiply to at most `COMBINED_MAX`, and gathered one by
    one otherwise: the same scores either way."""
    import serving.ranking as ranking

    monkeypatch.setattr(ranking, "COMBINED_MAX", combined_max)
    torch.manual_seed(0)
    s = Settings(lora={"rank": 4, "alpha": 8.0}, serving={"adapter_capacity": 8})  # default targets
    rank = RankModel(copy.deepcopy(Ranker(CFG).eval()), "v0", s, torch.device("cpu"))
    rank.chunk = 64
    for i, slot in enumerate(("feed", "search", "splash")):
        rank.bank.put(
            slot, _weights(rank, i), version="s0", seq=0, base_version="v0", arms=(STABLE, CANDIDATE)
        )
    rank.bank.put("adv:x", _weights(rank, 9), version="s0", seq=0, base_version="v0")
    feed, search = rank.bank.row("feed", CANDIDATE), rank.bank.row("search", STABLE)
    null_stable, null_candidate = rank.bank.row(None, STABLE), rank.bank.row(None, CANDIDATE)
    adv = rank.bank.row("adv:x", CANDIDATE)
    rows = (feed, null_stable, search, null_candidate, feed)
    inputs = [
        dataclasses.replace(_input(torch.full((n,), r), k), row=r)
        for k, (r, n) in enumerate(zip(rows, (30, 25, 70, 17, 41), strict=True))
    ]
    inputs[2] = dataclasses.replace(inputs[2], offset=torch.randn(70))
    with torch.inference_mode(), rank.bank.reading() as buf:
        grouped = rank._score_named_rows(inputs, buf)
        assert grouped is not None
        stacked = rank._stacks[next(reversed(rank._stacks))]
        assert (stacked[3] is not None) == (combined_max > 1)
        # not for the grouped pass: an advertiser's (banked) row, an input without its row
        banked_row = [*inputs, dataclasses.replace(_input(torch.full((9,), adv), 8), row=adv)]
        assert rank._score_named_rows(banked_row, buf) is None
        unnamed = [*inputs[:2], dataclasses.replace(inputs[2], row=None)]
        assert rank._score_named_rows(unnamed, buf) is None
    for g, w in zip(grouped, _banked(rank, inputs), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)
    for batch in (banked_row, unnamed):
        for g, w in zip(rank.score(batch, use_adapters=True), _banked(rank, batch), strict=True):
            np.testing.assert_allclose(g, w, atol=1e-5)
    base = rank.score(inputs, use_adapters=False)
    with torch.inference_mode():
        off = rank._split(inputs, rank._forward(inputs, False))
    for g, w in zip(base, off, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-6)
    np.testing.assert_allclose(grouped[1], base[1], atol=1e-6)  # an empty row: the plain model
