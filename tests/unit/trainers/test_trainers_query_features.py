"""The ranker's query columns (`trainers.models.features`, `RankerConfig.query_features`): the
request query's match with the ad and its presence flag, read from the TrainingExample (and from
any input with the attribute) alike; a model without them keeps the layout of before, and a
checkpoint saved before them loads as it was trained."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers_trainers import make_examples
from torch.nn import functional as F

from schemas.errors import ModelError, SchemaError
from trainers.models.features import N_EXTRA_DENSE, featurize
from trainers.models.ranker import Ranker, RankerConfig, load_checkpoint, save_checkpoint
from trainers.quality import auc

CFG = RankerConfig(
    state_dim=8, ad_buckets=64, advertiser_buckets=16, campaign_buckets=16, category_buckets=8, deep_hidden=16
)
Q = CFG.state_dim + N_EXTRA_DENSE


def _with_queries(n: int) -> list:  # type: ignore[type-arg]
    """Examples of searches (a match each, some negative: signed hashing) and of other requests."""
    exs = make_examples(n, dim=8)
    matches = [None, 0.0, 0.5, -0.25, 1.0]
    return [e.model_copy(update={"query_match": matches[i % 5]}) for i, e in enumerate(exs)]


def test_the_query_match_and_its_flag_are_two_columns_after_the_recall_score() -> None:
    exs = _with_queries(10)
    batch = featurize(exs, CFG)
    assert batch.dense.shape == (10, CFG.state_dim + 5) and CFG.dense_dim == CFG.state_dim + 5
    assert batch.dense[:, Q].tolist() == [0.0 if e.query_match is None else e.query_match for e in exs]
    assert batch.dense[:, Q + 1].tolist() == [float(e.query_match is not None) for e in exs]
    # the columns before them are what a model without query columns reads, unchanged
    plain = featurize(exs, dataclasses.replace(CFG, query_features=False))
    assert plain.dense.shape == (10, CFG.state_dim + N_EXTRA_DENSE)
    assert torch.equal(plain.dense, batch.dense[:, :Q]) and torch.equal(plain.ids, batch.ids)


def test_any_input_with_the_attribute_featurizes_as_the_training_example() -> None:
    exs = _with_queries(7)
    fast = featurize(exs, CFG)
    plain = featurize([SimpleNamespace(**e.model_dump()) for e in exs], CFG)
    assert torch.equal(fast.dense, plain.dense) and torch.equal(fast.ids, plain.ids)
    # a hand-made input without the attribute (tools written before it) has no query
    bare = [SimpleNamespace(**e.model_dump(exclude={"query_match"})) for e in exs]
    assert not bool(featurize(bare, CFG).dense[:, Q:].any())


def test_a_non_finite_query_match_is_refused_naming_the_field() -> None:
    ex = SimpleNamespace(**make_examples(1, dim=8)[0].model_dump())
    ex.query_match = float("nan")
    with pytest.raises(SchemaError, match="query_match"):
        featurize([ex], CFG)


def test_a_checkpoint_saved_before_the_query_columns_loads_as_trained(tmp_path: Path) -> None:
    old = dataclasses.replace(CFG, query_features=False)
    torch.manual_seed(4)
    model = Ranker(old).eval()
    save_checkpoint(model, tmp_path)
    meta = json.loads((tmp_path / "ranker.json").read_text())
    del meta["config"]["query_features"]  # as written before the field existed
    (tmp_path / "ranker.json").write_text(json.dumps(meta))
    loaded, _ = load_checkpoint(tmp_path)
    assert loaded.config.query_features is False and loaded.config.dense_dim == CFG.state_dim + 3
    batch = featurize(_with_queries(16), loaded.config)
    assert torch.equal(loaded.score(batch), model.score(batch))


def test_a_checkpoint_naming_a_field_this_release_does_not_know_is_refused(tmp_path: Path) -> None:
    save_checkpoint(Ranker(CFG), tmp_path)
    meta = json.loads((tmp_path / "ranker.json").read_text())
    meta["config"]["query_encoder"] = "minilm"  # a newer release's field
    (tmp_path / "ranker.json").write_text(json.dumps(meta))
    with pytest.raises(ModelError, match=r"unknown fields.*query_encoder"):
        load_checkpoint(tmp_path)


def test_the_query_columns_can_be_learned() -> None:
    """Clicks that follow the query match alone: a ranker with the columns fits them."""
    exs = make_examples(512, dim=8, seed=3)
    matches = torch.rand(512, generator=torch.Generator().manual_seed(0)).tolist()
    pairs = zip(exs, matches, strict=True)
    exs = [e.model_copy(update={"query_match": q, "click": q > 0.5}) for e, q in pairs]
    batch = featurize(exs, CFG)
    torch.manual_seed(0)
    model = Ranker(CFG)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(80):
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(batch.dense, batch.ids), batch.label)
        loss.backward()
        opt.step()
    p = model.score(batch)
    assert batch.label is not None
    assert auc(p.numpy(), batch.label.numpy()) > 0.9
