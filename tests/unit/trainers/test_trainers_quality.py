"""RollingMetrics (a numpy ring) against the obvious deque definition of a rolling window."""

from __future__ import annotations

import math
import random
from collections import deque

import numpy as np
import pytest
from helpers_trainers import make_examples

from schemas.stats import auc
from trainers.models.features import featurize
from trainers.models.ranker import RankerConfig
from trainers.quality import RollingMetrics, key_ids, logloss, rank_auc


@pytest.mark.parametrize("window", [1, 7, 64, 500])
def test_rolling_window_equals_a_deque_of_the_last_pairs(window: int) -> None:
    rng = random.Random(window)
    ring = RollingMetrics(window)
    ps: deque[float] = deque(maxlen=window)
    ys: deque[int] = deque(maxlen=window)
    for step in range(300):
        n = rng.choice([0, 1, 3, window - 1, window, window + 5, rng.randrange(1, 2 * window + 2)])
        p = [rng.random() for _ in range(max(n, 0))]
        y = [int(rng.random() < 0.3) for _ in p]
        if step % 97 == 96:
            ring.clear()
            ps.clear()
            ys.clear()
        ring.extend(p, y)
        ps.extend(p)
        ys.extend(y)
        assert ring.count == len(ps)
        assert ring.positives == sum(ys)
        want = auc(list(ps), list(ys)) if ps else math.nan
        got = ring.auc() if ps else math.nan
        assert (math.isnan(want) and math.isnan(got)) or got == pytest.approx(want, abs=1e-12)
        if ps:
            assert ring.logloss() == pytest.approx(logloss(list(ps), list(ys)), abs=1e-12)


def test_extend_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="2 probabilities but 1 labels"):
        RollingMetrics(4).extend([0.1, 0.2], [1])


def test_featurize_batches_equal_one_by_one() -> None:
    """The column-wise featurize gives every row what featurizing it alone gives."""
    cfg = RankerConfig(state_dim=8)
    exs = make_examples(40, dim=8)
    exs[3] = exs[3].model_copy(update={"user_vector": [0.5, 0.25]})  # short: zero-padded
    exs[5] = exs[5].model_copy(update={"user_vector": [0.1] * 12, "recall_score": 0.7})  # long: truncated
    whole = featurize(exs, cfg)
    for i, ex in enumerate(exs):
        one = featurize([ex], cfg)
        assert whole.dense[i].tolist() == one.dense[0].tolist()
        assert whole.ids[i].tolist() == one.ids[0].tolist()
    assert whole.dense[3, 2:8].abs().sum() == 0


@pytest.mark.parametrize("seed", range(6))
def test_rank_auc_equals_the_argsort_auc_bit_for_bit(seed: int) -> None:
    """The guard's AUC (sort + searchsorted) is the contract's rank AUC exactly, ties included."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 3000))
    # coarse scores: many ties, also across the classes
    scores = np.round(rng.random(n), int(rng.integers(1, 4))).astype(np.float64)
    positive = rng.random(n) < rng.choice([0.02, 0.3, 0.9])
    want, got = auc(scores, positive), rank_auc(scores, positive)
    assert (math.isnan(want) and math.isnan(got)) or got == want


def test_rank_auc_refuses_nan_and_needs_both_classes() -> None:
    with pytest.raises(ValueError, match="NaN"):
        rank_auc(np.array([0.1, math.nan]), np.array([True, False]))
    assert math.isnan(rank_auc(np.array([0.1, 0.2]), np.array([True, True])))


def test_cached_auc_follows_every_change_of_the_window() -> None:
    ring = RollingMetrics(4)
    ring.extend([0.9, 0.1], [1, 0])
    assert ring.auc() == 1.0
    ring.extend([0.95, 0.05], [0, 1])  # now the window ranks a negative first
    assert ring.auc() == auc([0.9, 0.1, 0.95, 0.05], [1, 0, 0, 1])
    ring.clear()
    assert ring.count == 0 and math.isnan(ring.auc())
    ring.update(0.3, 1)
    ring.update(0.2, 0)
    assert ring.auc() == 1.0


def _reference_row(ex: object, cfg: RankerConfig) -> tuple[list[float], list[int]]:
    """One candidate by the module docstring's tables, written out row by row."""
    from schemas.events import SLOTS
    from trainers.models.features import stable_bucket

    vec = [float(v) for v in list(ex.user_vector)[: cfg.state_dim]]  # type: ignore[attr-defined]
    vec += [0.0] * (cfg.state_dim - len(vec))
    r = ex.recall_score  # type: ignore[attr-defined]
    dense = [*vec, ex.intent_score, 0.0 if r is None else r, float(r is not None)]  # type: ignore[attr-defined]
    if cfg.query_features:
        q = ex.query_match  # type: ignore[attr-defined]
        dense += [0.0 if q is None else q, float(q is not None)]
    ids = [
        stable_bucket(ex.ad_id, cfg.ad_buckets, "ad"),  # type: ignore[attr-defined]
        stable_bucket(ex.advertiser_id, cfg.advertiser_buckets, "advertiser"),  # type: ignore[attr-defined]
        stable_bucket(ex.campaign_id, cfg.campaign_buckets, "campaign"),  # type: ignore[attr-defined]
        stable_bucket(ex.category, cfg.category_buckets, "category"),  # type: ignore[attr-defined]
        SLOTS.index(ex.slot),  # type: ignore[attr-defined]
        min(int(ex.position), cfg.max_position - 1),  # type: ignore[attr-defined]
        int(ex.hour),  # type: ignore[attr-defined]
    ]
    return [float(np.float32(v)) for v in dense], ids


def test_featurize_equals_the_row_by_row_definition() -> None:
    cfg = RankerConfig(state_dim=8)
    exs = make_examples(64, dim=8)
    exs[1] = exs[1].model_copy(update={"position": 10_000, "hour": 23, "recall_score": 0.25})
    exs[2] = exs[2].model_copy(update={"user_vector": []})
    exs[3] = exs[3].model_copy(update={"query_match": -0.375})
    got = featurize(exs, cfg)
    assert got.label is not None
    for i, ex in enumerate(exs):
        dense, ids = _reference_row(ex, cfg)
        assert got.dense[i].tolist() == dense
        assert got.ids[i].tolist() == ids
        assert got.label[i].item() == float(ex.click)


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"slot": ""}, "field 'slot': must be a slot name (got '')"),  # other names hash (open slots)
        ({"hour": 24}, "field 'hour': must be 0 … 23 (got 24)"),
        ({"hour": 23.5}, "field 'hour': must be 0 … 23 (got 23.5)"),
        ({"position": -1}, "field 'position': must be >= 0 (got -1)"),
        ({"position": -0.5}, "field 'position': must be >= 0 (got -0.5)"),
        ({"intent_score": float("inf")}, "every value must be finite"),
    ],
)
def test_featurize_names_the_field_of_a_bad_value(update: dict[str, object], message: str) -> None:
    from schemas.errors import SchemaError

    exs = make_examples(5, dim=4)
    exs[3] = exs[3].model_construct(**{**exs[3].__dict__, **update})  # past the contract on purpose
    with pytest.raises(SchemaError, match=message.replace("(", r"\(").replace(")", r"\)")):
        featurize(exs, RankerConfig(state_dim=4))


def test_a_relabelled_pair_is_one_positive_and_a_key_that_left_the_window_changes_nothing() -> None:
    m = RollingMetrics(3)
    m.extend([0.1, 0.2, 0.3], [0, 0, 0], keys=key_ids(["a", "b", "c"]))
    assert m.relabel(key_ids(["b", "b"])) == 1 and m.positives == 1  # a re-delivered click counts once
    m.extend([0.4], [1])  # unkeyed: overwrites "a"'s slot, and "a" leaves with it
    assert m.relabel(key_ids(["a"])) == 0 and (m.count, m.positives) == (3, 2)
    m.extend([0.5, 0.6], [0, 0], keys=key_ids(["d", "e"]))  # "b" (positive) and "c" leave
    assert m.positives == 1 and m.relabel(key_ids(["b", "c"])) == 0
    assert m.relabel(key_ids(["e"])) == 1 and m.auc() == 0.5  # positives 0.4, 0.6 around the negative 0.5
    m.clear()
    assert m.relabel(key_ids(["d"])) == 0 and m.count == 0


def test_relabel_all_changes_each_window_as_its_own_relabel_would() -> None:
    rng = np.random.default_rng(3)
    keys = key_ids([f"i{i}" for i in range(40)])
    together = [RollingMetrics(16), RollingMetrics(16)]
    alone = [RollingMetrics(16), RollingMetrics(16)]
    for start in range(0, 40, 8):  # the ring wraps; some keys leave the window
        scores = [rng.random(8), rng.random(8)]
        labels = (rng.random(8) < 0.2).astype(int)
        for ws in (together, alone):
            for w, p in zip(ws, scores, strict=True):
                w.extend(p, labels, keys=keys[start : start + 8])
        clicked = keys[rng.choice(start + 8, 5)]
        found = RollingMetrics.relabel_all(together, clicked)
        assert found == alone[0].relabel(clicked)
        alone[1].relabel(clicked)
        for a, b in zip(together, alone, strict=True):
            assert (a.count, a.positives, a.auc()) == (b.count, b.positives, b.auc())
    # windows with other keys in their slots each look their keys up on their own
    other = RollingMetrics(16)
    other.extend([0.3, 0.7], [0, 0], keys=key_ids(["x", "i39"]))
    assert RollingMetrics.relabel_all([together[0], other], key_ids(["i39"])) in (0, 1)
    assert other.positives == 1
