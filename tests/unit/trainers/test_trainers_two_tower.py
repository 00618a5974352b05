"""Two-tower recall model with the real MiniLM title encoder: learns, indexes, round-trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_trainers import T0, make_examples

from schemas.errors import ConfigError, ModelError
from schemas.events import AdCreative
from trainers.models.text import TEXT_DIM, TitleEncoder
from trainers.models.two_tower import (
    TwoTowerConfig,
    build_ad_index,
    evaluate_two_tower,
    load_ad_index,
    load_two_tower,
    save_ad_index,
    save_two_tower,
    tower_batch,
    train_two_tower,
)

CFG = TwoTowerConfig(
    state_dim=8, out_dim=8, hidden=16, emb_dim=4, category_buckets=8, advertiser_buckets=8, ad_buckets=64
)
TITLES = {"a": "red running shoes", "b": "garden hose and sprinkler", "c": "dog food for puppies"}


@pytest.fixture(scope="module")
def encoder() -> TitleEncoder:
    return TitleEncoder()


def _catalog() -> dict[str, AdCreative]:
    out = {}
    for i in range(20):
        cat = "abc"[i % 3]
        out[f"ad{i}"] = AdCreative(
            event_id=f"c{i}",
            ts=T0,
            ad_id=f"ad{i}",
            campaign_id="c",
            advertiser_id="v",
            category=cat,
            title=f"{TITLES[cat]} {i}",
            bid=1.0,
            daily_budget=10.0,
            active=True,
        )
    return out


def test_title_encoder_is_offline_cached_and_semantic(encoder: TitleEncoder) -> None:
    v = encoder.encode(["red running shoes", "sneakers for jogging", "dog food for puppies"])
    assert v.shape == (3, TEXT_DIM) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > v[0] @ v[2]  # shoes are closer to sneakers than to dog food
    assert "red running shoes" in encoder.cache
    assert encoder.encode([]).shape == (0, TEXT_DIM)


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match=r"out_dim.*0"):
        TwoTowerConfig(out_dim=0)


def test_learns_indexes_and_round_trips(encoder: TitleEncoder, tmp_path) -> None:
    catalog = _catalog()
    exs = make_examples(1500, seed=5, dim=8)
    # ads whose category matches the one the click label was drawn for
    exs = [
        e.model_copy(update={"ad_id": f"ad{3 * (i % 6) + 'abc'.index(e.category)}"})
        for i, e in enumerate(exs)
    ]
    train, hold = exs[:1200], exs[1200:]
    model = train_two_tower(tower_batch(train, catalog, encoder, CFG), CFG, epochs=6, lr=1e-2, seed=0)
    score = evaluate_two_tower(model, tower_batch(hold, catalog, encoder, CFG))
    assert score > 0.6
    ids, vecs = build_ad_index(model, list(catalog.values()), encoder)
    assert ids == list(catalog) and vecs.shape == (20, 8)
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    version = save_two_tower(model, tmp_path)
    save_ad_index(ids, vecs, tmp_path, version)
    loaded, v2 = load_two_tower(tmp_path)
    assert v2 == version
    ids2, vecs2, v3 = load_ad_index(tmp_path)
    assert ids2 == ids and np.array_equal(vecs2, vecs) and v3 == version
    b = tower_batch(hold[:16], catalog, encoder, CFG)
    with torch.no_grad():
        assert torch.allclose(model(b.user_x, b.ad_ids, b.ad_text), loaded(b.user_x, b.ad_ids, b.ad_text))
    # a brand-new ad (unseen id) still gets a vector close to its category's ads via title/category
    new = AdCreative(
        event_id="n",
        ts=T0,
        ad_id="brand-new",
        campaign_id="c",
        advertiser_id="v",
        category="a",
        title="red running shoes new",
        bid=1.0,
        daily_budget=10.0,
        active=True,
    )
    _, nv = build_ad_index(model, [new], encoder)
    same = vecs[[i for i, a in enumerate(ids) if catalog[a].category == "a"]] @ nv[0]
    other = vecs[[i for i, a in enumerate(ids) if catalog[a].category != "a"]] @ nv[0]
    assert same.mean() > other.mean()
    with pytest.raises(ModelError, match="no two-tower"):
        load_two_tower(tmp_path / "missing")


def test_train_all_writes_both_models_and_the_index(encoder: TitleEncoder, tmp_path) -> None:
    import json

    from trainers.offline import TrainSpec
    from trainers.train_all import train_all

    catalog = _catalog()
    exs = make_examples(600, seed=6, dim=8)
    exs = [
        e.model_copy(update={"ad_id": f"ad{3 * (i % 6) + 'abc'.index(e.category)}"})
        for i, e in enumerate(exs)
    ]
    report = train_all(exs, catalog, tmp_path, state_dim=8, spec=TrainSpec(epochs=1), encoder=encoder)
    assert report["holdout"] == 120 and report["two_tower"]["ads_indexed"] == 20
    assert json.loads((tmp_path / "train_report.json").read_text())["ranker"]["version"].startswith("ranker-")
    ids, vecs, version = load_ad_index(tmp_path / "two_tower")
    assert len(ids) == 20 == vecs.shape[0] and version == report["two_tower"]["version"]
