"""Open slots in the models (issue 34 item 5): the three default slots keep rows 0-2, so a
checkpoint saved before slots were configurable loads and scores them bit for bit as before;
other slots hash into extra rows (a model trained while they are configured) or share feed's row
(a model without them, such as an old one)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from schemas.events import SLOTS
from trainers.models.features import featurize, slot_index
from trainers.models.ranker import (
    EXTRA_SLOT_BUCKETS,
    Ranker,
    RankerConfig,
    load_checkpoint,
    save_checkpoint,
    slot_buckets_for,
)
from trainers.models.two_tower import TwoTower, TwoTowerConfig, load_two_tower, save_two_tower, user_features

DIM = 8


class Ex:
    def __init__(self, slot: str, i: int) -> None:
        g = torch.Generator().manual_seed(i)
        self.user_vector = torch.randn(DIM, generator=g).tolist()
        self.intent_score, self.recall_score = float(i % 3), None
        self.ad_id, self.advertiser_id, self.campaign_id = f"a{i}", f"v{i % 4}", f"c{i % 5}"
        self.category, self.slot, self.position, self.hour = f"k{i % 6}", slot, i % 5, i % 24


def _examples(slot: str) -> list[Ex]:
    return [Ex(slot, i) for i in range(32)]


def _as_before_slots(directory: Path, config_file: str) -> None:
    """Rewrite a checkpoint's config as one saved before `slot_buckets` existed."""
    path = directory / config_file
    meta = json.loads(path.read_text())
    del meta["config"]["slot_buckets"]
    path.write_text(json.dumps(meta))


def test_an_old_ranker_checkpoint_scores_the_default_slots_bit_for_bit(tmp_path: Path) -> None:
    torch.manual_seed(0)
    old = Ranker(RankerConfig(state_dim=DIM, slot_buckets=0)).eval()
    save_checkpoint(old, tmp_path, "ranker-old")
    _as_before_slots(tmp_path, "ranker.json")
    model, version = load_checkpoint(tmp_path)
    assert version == "ranker-old" and model.config.slot_buckets == 0
    assert model.emb["slot"].num_embeddings == 3 and model.wide["slot"].num_embeddings == 3
    for slot in SLOTS:
        batch = featurize(_examples(slot), model.config)
        assert torch.equal(model.score(batch), old.score(batch)), slot
    # a slot it never saw shares feed's row: scored, not refused
    news, feed = (featurize(_examples(s), model.config) for s in ("news", "feed"))
    assert (news.ids[:, 4] == 0).all() and torch.equal(model.score(news), model.score(feed))


def test_a_ranker_for_more_slots_keeps_the_defaults_and_hashes_the_others() -> None:
    assert RankerConfig().slot_buckets == 0 == slot_buckets_for(SLOTS)  # the defaults: as before
    buckets = slot_buckets_for((*SLOTS, "news"))
    assert buckets == EXTRA_SLOT_BUCKETS
    torch.manual_seed(0)
    without = Ranker(RankerConfig(state_dim=DIM)).eval()
    after_without = torch.rand(4)
    torch.manual_seed(0)
    new = Ranker(RankerConfig(state_dim=DIM, slot_buckets=buckets)).eval()
    after_new = torch.rand(4)
    # the hashed rows are drawn aside: every other weight, and the RNG stream after, are the same
    assert torch.equal(after_without, after_new)
    assert new.emb["slot"].num_embeddings == 3 + new.config.slot_buckets
    assert torch.equal(new.emb["slot"].weight[:3], without.emb["slot"].weight)
    for slot in SLOTS:
        batch = featurize(_examples(slot), new.config)
        assert torch.equal(new.score(batch), without.score(batch)), slot
    rows = {s: slot_index(s, new.config.slot_buckets) for s in ("news", "sidebar", "video")}
    assert all(3 <= r < 3 + new.config.slot_buckets for r in rows.values())
    news = featurize(_examples("news"), new.config)
    assert (news.ids[:, 4] == rows["news"]).all()
    assert not torch.equal(new.score(news), new.score(featurize(_examples("feed"), new.config)))


def test_a_new_ranker_checkpoint_round_trips_its_slot_rows(tmp_path: Path) -> None:
    torch.manual_seed(1)
    new = Ranker(RankerConfig(state_dim=DIM, slot_buckets=5)).eval()
    save_checkpoint(new, tmp_path)
    model, _ = load_checkpoint(tmp_path)
    assert model.config.slot_buckets == 5
    batch = featurize(_examples("news"), model.config)
    assert torch.equal(model.score(batch), new.score(batch))


def test_an_old_two_tower_checkpoint_loads_and_embeds_the_defaults_as_before(tmp_path: Path) -> None:
    torch.manual_seed(0)
    old = TwoTower(TwoTowerConfig(state_dim=DIM, slot_buckets=0)).eval()
    save_two_tower(old, tmp_path)
    _as_before_slots(tmp_path, "two_tower.json")
    model, _ = load_two_tower(tmp_path)
    assert model.config.slot_buckets == 0
    vecs = [e.user_vector for e in _examples("feed")]
    hours = [e.hour for e in _examples("feed")]
    with torch.no_grad():
        for slot in SLOTS:
            x = user_features(vecs, [slot] * len(vecs), hours, DIM, 0)
            assert torch.equal(model.user_vectors(x), old.user_vectors(x)), slot
        # an unseen slot sets no slot column there
        x = user_features(vecs, ["news"] * len(vecs), hours, DIM, 0)
        assert x[:, DIM : DIM + 3].sum() == 0 and model.user_vectors(x).isfinite().all()
    torch.manual_seed(0)
    new = TwoTower(TwoTowerConfig(state_dim=DIM, slot_buckets=EXTRA_SLOT_BUCKETS)).eval()
    with torch.no_grad():  # the defaults' columns are the old ones; the hashed ones follow the hour's
        x_old = user_features(vecs, ["search"] * len(vecs), hours, DIM, 0)
        x_new = user_features(vecs, ["search"] * len(vecs), hours, DIM, new.config.slot_buckets)
        assert torch.equal(x_new[:, : x_old.shape[1]], x_old) and x_new[:, x_old.shape[1] :].sum() == 0
        assert torch.allclose(new.user_vectors(x_new), old.user_vectors(x_old), atol=1e-6)
        x_news = user_features(vecs, ["news"] * len(vecs), hours, DIM, new.config.slot_buckets)
        assert (x_news[:, x_old.shape[1] :].sum(1) == 1).all()
