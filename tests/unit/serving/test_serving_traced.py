"""The ranker's trunk traced by TorchScript on the serving path (`serving.ranking.traced_trunk`,
`serving.rank_trace_rows`): the same results as the eager trunk bit for bit, for every size and
after an in-place change of the weights it shares; the replica's scores the same with it and
without it on every path (a fold alone, several folds stacked, the plain model, the mixed
adapters, a per-user offset, across a swap, chunks above and below the limit, an empty input);
not used where the folds differ inside the trunk or on a GPU."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from schemas.settings import Settings
from serving.adapters import CANDIDATE, STABLE
from serving.ranking import RankInput, RankModel, _with_weights, run_traced, traced_scorer, traced_trunk
from trainers.models.features import ID_COLUMNS
from trainers.models.ranker import Ranker, RankerConfig

CFG = RankerConfig(state_dim=8, ad_buckets=64, advertiser_buckets=16, campaign_buckets=16, deep_hidden=16)


def _input(rows: torch.Tensor, seed: int, row: int | None = None) -> RankInput:
    g = torch.Generator().manual_seed(seed)
    n = rows.shape[0]
    ids = torch.stack([torch.randint(0, s, (n,), generator=g) for s in CFG.table_sizes.values()], 1)
    return RankInput(torch.randn(n, CFG.dense_dim, generator=g), ids, rows, row=row)


def _weights(rank: RankModel, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: (torch.randn(4, s.fan_in, generator=g) * 0.2, torch.randn(s.fan_out, 4, generator=g) * 0.2)
        for n, s in rank.bank.shapes.items()
    }


def _rank(trace_rows: int, targets: tuple[str, ...] | None = None) -> RankModel:
    torch.manual_seed(0)
    lora: dict[str, object] = {"rank": 4, "alpha": 8.0}
    if targets is not None:
        lora["targets"] = targets
    s = Settings(lora=lora, serving={"adapter_capacity": 8, "rank_trace_rows": trace_rows})
    rank = RankModel(copy.deepcopy(Ranker(CFG).eval()), "v0", s, torch.device("cpu"))
    for i, slot in enumerate(("feed", "search", "splash")):
        rank.bank.put(
            slot, _weights(rank, i), version="s0", seq=0, base_version="v0", arms=(STABLE, CANDIDATE)
        )
    rank.bank.put("adv:x", _weights(rank, 9), version="s0", seq=0, base_version="v0")
    return rank


def test_the_traced_trunk_is_the_eager_trunk_bit_for_bit_and_shares_its_weights() -> None:
    torch.manual_seed(1)
    model = Ranker(CFG).eval()
    trunk = traced_trunk(model)
    with torch.inference_mode():
        for n in (1, 2, 10, 80, 500, 1024, 3000):
            inp = _input(torch.zeros(n, dtype=torch.int64), n)
            want = model.head_input(inp.dense, inp.ids)
            assert torch.equal(trunk(inp.dense, inp.ids), want), n
            assert torch.equal(run_traced(trunk, inp.dense, inp.ids), want), n  # interpreted as served
            assert torch._C._get_graph_executor_optimize()  # the thread's flag restored
        inp = _input(torch.zeros(40, dtype=torch.int64), 7)
        before = trunk(inp.dense, inp.ids).clone()
        for p in model.parameters():  # a change in place (the only kind the served base gets)
            p.mul_(1.5)
        after = trunk(inp.dense, inp.ids)
        assert not torch.equal(after, before)
        assert torch.equal(after, model.head_input(inp.dense, inp.ids))


def test_the_traced_scorer_is_any_folds_forward_bit_for_bit() -> None:
    """Called with a model's head and wide tables, the traced forward of the plain model gives
    that model's logits: the plain one's, and a fold's (new head and tables, the trunk shared)."""
    torch.manual_seed(2)
    model = Ranker(CFG).eval()
    scorer = traced_scorer(model)
    g = torch.Generator().manual_seed(3)
    fold = _with_weights(
        model,
        {
            "head": model.head.weight + torch.randn(model.head.weight.shape, generator=g),
            "wide.slot": model.wide["slot"].weight
            + torch.randn(model.wide["slot"].weight.shape, generator=g),
        },
    )
    assert isinstance(fold, Ranker)
    names = [n for n in ID_COLUMNS if n in model.wide]
    with torch.inference_mode():
        for m in (model, fold):
            tables = tuple(m.wide[n].weight for n in names)
            for n in (1, 10, 500):
                inp = _input(torch.zeros(n, dtype=torch.int64), n)
                got = scorer(inp.dense, inp.ids, m.head.weight, m.head.bias, tables)
                assert torch.equal(got, m(inp.dense, inp.ids)), n
        inp = _input(torch.zeros(50, dtype=torch.int64), 4)
        assert not torch.equal(fold(inp.dense, inp.ids), model(inp.dense, inp.ids))


def _batches(rank: RankModel) -> list[list[RankInput]]:
    """Batches that take each way through `RankModel.score`."""
    feed, search, splash = (rank.bank.row(x, CANDIDATE) for x in ("feed", "search", "splash"))
    adv, null = rank.bank.row("adv:x", CANDIDATE), rank.bank.row(None, STABLE)
    one = [_input(torch.full((30,), feed), 1, row=feed)]  # one fold: its own pass
    small = [_input(torch.full((10,), search), 2, row=search)]  # a request's served ads
    several = [  # folds and the plain model stacked, one with a per-user offset
        _input(torch.full((n,), r), k, row=r)
        for k, (r, n) in enumerate(zip((feed, search, splash, null), (30, 25, 40, 17), strict=True))
    ]
    several[1] = dataclasses.replace(several[1], offset=torch.randn(25))
    unnamed = [_input(torch.full((20,), feed), 3), _input(torch.full((15,), splash), 4)]  # general path
    mixed = [_input(torch.tensor([feed, adv] * 10), 5)]  # advertisers' adapters: banked
    big = [_input(torch.full((300,), feed), 6, row=feed), _input(torch.full((250,), search), 7, row=search)]
    empty = [_input(torch.zeros(0, dtype=torch.int64), 8, row=feed)]
    return [one, small, several, unnamed, mixed, big, empty]


@pytest.mark.parametrize("chunk", [2048, 64])
def test_the_replica_scores_the_same_with_the_traced_ranker_as_without(chunk: int) -> None:
    """Bit for bit where both cut the batch alike (a pass's size picks BLAS's blocking, so
    passes of other sizes round the last bit differently), within that rounding otherwise."""
    traced, eager, eager_default = _rank(100), _rank(0), _rank(0)
    assert traced._trunk is not None and eager._trunk is None
    traced.chunk = eager.chunk = chunk
    assert traced._chunk() == min(chunk, 100)  # traced passes: at most rank_trace_rows
    eager.chunk = traced._chunk()
    for swap in range(2):
        for batch in _batches(traced):
            for flag in (True, False):
                got, want = traced.score(batch, flag), eager.score(batch, flag)
                for g, w in zip(got, want, strict=True):
                    np.testing.assert_array_equal(g, w)
                for g, w in zip(got, eager_default.score(batch, flag), strict=True):
                    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
        for rank in (traced, eager, eager_default):  # a swap rewrites the search slot's folds in place
            rank.bank.put(
                "search", _weights(rank, 20 + swap), version=f"s{swap + 1}", seq=swap + 1, base_version="v0"
            )


def test_no_trace_where_the_folds_differ_inside_the_trunk_or_on_request() -> None:
    assert _rank(1024, targets=("cross", "head", "wide.slot"))._trunk is None  # not stackable
    assert _rank(0)._trunk is None
    assert _rank(1024)._trunk is not None  # the default
    assert Settings().serving.rank_trace_rows == 1024


def test_a_torch_that_cannot_trace_ranks_with_the_eager_ranker(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`torch.jit.trace` is deprecated: where it fails, the replica starts with the eager ranker
    (a warning says so) and scores as it always did, not a failed start."""

    def gone(*args: object, **kwargs: object) -> None:
        raise RuntimeError("torch.jit.trace was removed")

    monkeypatch.setattr(torch.jit, "trace", gone)
    rank = _rank(1024)
    assert rank._trunk is None and rank._scorer is None and rank.trace_rows == 0
    assert "could not be traced" in caplog.text
    eager = _rank(0)
    for batch in _batches(rank):
        for g, w in zip(rank.score(batch, True), eager.score(batch, True), strict=True):
            np.testing.assert_array_equal(g, w)
