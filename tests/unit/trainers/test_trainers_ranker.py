"""Contract checks of the ranker: features, determinism, checkpoint round trip, validation."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from helpers_trainers import make_examples

from schemas.errors import ConfigError, ModelError, SchemaError
from trainers.models.features import RankerBatch, featurize, stable_bucket
from trainers.models.ranker import Ranker, RankerConfig, load_checkpoint, save_checkpoint, weights_version

CFG = RankerConfig(
    state_dim=8, ad_buckets=64, advertiser_buckets=16, campaign_buckets=16, category_buckets=8, deep_hidden=16
)


def test_featurize_shapes_and_labels() -> None:
    exs = make_examples(10, dim=8)
    batch = featurize(exs, CFG)
    assert batch.dense.shape == (10, 8 + 3 + 2)  # + the query match and its flag
    assert batch.ids.shape == (10, 7)
    assert batch.label is not None and batch.label.tolist() == [float(e.click) for e in exs]
    # recall flag column says whether recall_score was present
    assert batch.dense[:, 10].tolist() == [float(e.recall_score is not None) for e in exs]
    assert int(batch.ids[:, 0].max()) < CFG.ad_buckets


def test_featurize_is_pure_and_deterministic() -> None:
    exs = make_examples(5, dim=8)
    before = [e.model_dump() for e in exs]
    a, b = featurize(exs, CFG), featurize(exs, CFG)
    assert torch.equal(a.dense, b.dense) and torch.equal(a.ids, b.ids)
    assert [e.model_dump() for e in exs] == before


def test_featurize_pads_short_vectors_and_handles_empty() -> None:
    ex = make_examples(1, dim=3)[0]
    batch = featurize([ex], CFG)
    assert batch.dense[0, 3:8].abs().sum() == 0
    empty = featurize([], CFG)
    assert len(empty) == 0 and empty.label is None


def test_featurize_rejects_bad_slot_naming_field() -> None:
    class Bad:
        user_vector = (0.0,)
        intent_score = 0.0
        recall_score = None
        ad_id = advertiser_id = campaign_id = category = "x"
        slot: object = 7
        position = 0
        hour = 3

    with pytest.raises(SchemaError, match=r"field 'slot'.*7"):
        featurize([Bad()], CFG)
    # a configured slot beyond the defaults takes a hashed row after the fixed three (feed's row
    # in a model without such rows)
    Bad.slot = "sidebar"
    wide = dataclasses.replace(CFG, slot_buckets=8)
    assert 3 <= int(featurize([Bad()], wide).ids[0, 4]) < 3 + 8
    assert int(featurize([Bad()], CFG).ids[0, 4]) == CFG.slot_buckets == 0


def test_stable_bucket_is_process_independent() -> None:
    # blake2b, unlike Python's per-process salted hash()
    assert stable_bucket("x", 1 << 30, "ad") == stable_bucket("x", 1 << 30, "ad")
    assert 0 <= stable_bucket("anything", 7, "s") < 7


@pytest.mark.parametrize("field,value", [("state_dim", 0), ("emb_dim", -1), ("deep_hidden", 1.5)])
def test_config_validation_names_field_and_value(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"{field}.*{value}"):
        RankerConfig(**{field: value})


def test_deterministic_under_seed() -> None:
    torch.manual_seed(3)
    a = Ranker(CFG)
    torch.manual_seed(3)
    b = Ranker(CFG)
    assert weights_version(a) == weights_version(b)
    batch = featurize(make_examples(4, dim=8), CFG)
    assert torch.equal(a.score(batch), b.score(batch))


def test_checkpoint_round_trip(tmp_path) -> None:
    torch.manual_seed(1)
    model = Ranker(CFG)
    batch = featurize(make_examples(16, dim=8), CFG)
    version = save_checkpoint(model, tmp_path)
    loaded, loaded_version = load_checkpoint(tmp_path)
    assert loaded_version == version == weights_version(model)
    assert loaded.config == CFG
    model.eval()
    assert torch.allclose(model.score(batch), loaded.score(batch))
    meta = json.loads((tmp_path / "ranker.json").read_text())
    assert meta["format"] == "adstream-ranker" and meta["version"] == version
    assert not list(tmp_path.glob("*.pt")) and not list(tmp_path.glob("*.pkl"))


def test_checkpoint_errors(tmp_path) -> None:
    with pytest.raises(ModelError, match="no ranker checkpoint"):
        load_checkpoint(tmp_path)
    save_checkpoint(Ranker(CFG), tmp_path)
    meta = json.loads((tmp_path / "ranker.json").read_text())
    meta["config"]["deep_hidden"] = 32
    (tmp_path / "ranker.json").write_text(json.dumps(meta))
    with pytest.raises(ModelError, match="does not match"):
        load_checkpoint(tmp_path)
    meta["format"] = "pickle"
    (tmp_path / "ranker.json").write_text(json.dumps(meta))
    with pytest.raises(ModelError, match="field 'format'"):
        load_checkpoint(tmp_path)


def test_batch_select_and_learns() -> None:
    torch.manual_seed(0)
    model = Ranker(CFG)
    batch = featurize(make_examples(512, dim=8), CFG)
    half = batch.select(torch.arange(256))
    assert isinstance(half, RankerBatch) and len(half) == 256
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    frozen = copy.deepcopy(model)
    for _ in range(60):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(batch.dense, batch.ids), batch.label
        )
        loss.backward()
        opt.step()
    with torch.no_grad():
        before = torch.nn.functional.binary_cross_entropy(frozen.score(batch), batch.label)
        after = torch.nn.functional.binary_cross_entropy(model.score(batch), batch.label)
    assert after < before - 0.05


def test_version_1_checkpoints_load_without_the_wide_part(tmp_path) -> None:
    old_cfg = RankerConfig(**{**CFG.__dict__, "wide": False})
    torch.manual_seed(2)
    model = Ranker(old_cfg)
    save_checkpoint(model, tmp_path)
    meta = json.loads((tmp_path / "ranker.json").read_text())
    meta["format_version"] = 1
    del meta["config"]["wide"]
    (tmp_path / "ranker.json").write_text(json.dumps(meta))
    loaded, _ = load_checkpoint(tmp_path)
    assert loaded.config.wide is False and len(loaded.wide) == 0


def test_logistic_baseline_and_paired_ci() -> None:
    from trainers.baseline import auc_diff_ci, logistic_baseline, logistic_probs

    exs = make_examples(800, dim=8, seed=9)
    train, hold = featurize(exs[:600], CFG), featurize(exs[600:], CFG)
    res = logistic_baseline(train, hold)
    assert 0.6 < res.auc <= 1 and res.n == 200
    p = logistic_probs(train, hold)
    y = hold.label.numpy()
    lo, hi = auc_diff_ci(p, p, y)
    assert lo == hi == 0.0
    lo, hi = auc_diff_ci(p, 1 - p, y)
    assert lo > 0  # LR is clearly better than its own reversed ranking
