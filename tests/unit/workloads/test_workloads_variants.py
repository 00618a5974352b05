"""The simulator's creative variants: per-segment effects with known truth, logged uniformly with
their propensity, and nothing changed for markets without variants."""

from __future__ import annotations

import math

import numpy as np
import pytest

from schemas.events import CREATIVE_SLOTS, Impression
from schemas.signing import check_event
from workloads import Market, MarketConfig, UnknownEntityError
from workloads.truth import sigmoid

KEY = b"k" * 32


def test_a_variant_adds_its_segments_effect_to_the_click_logit() -> None:
    m = Market(MarketConfig(seed=3, n_users=200, n_ads=20, n_variants=4))
    vw = m.variants
    assert vw is not None and vw.emphasis.shape == (40, 4)  # initial and new ads
    base = m.true_pctr("u000007", "ad00002", "feed", 0)
    share = vw.share[7]
    assert share.sum() == pytest.approx(1.0) and vw.segment[7] == share.argmax()
    for v in range(4):
        effect = sum(share[s] * (vw.lift[s, vw.emphasis[2, v]] + vw.own[2, v, s]) for s in range(4))
        logit = math.log(base / (1 - base)) + effect
        assert m.true_pctr("u000007", "ad00002", "feed", 0, variant_id=f"v{v}") == pytest.approx(
            sigmoid(logit)
        )
    table = m.true_variant_pctrs(np.array([7, 8]), np.array([2, 2]), "feed", 0)
    assert table[0, 3] == pytest.approx(m.true_pctr("u000007", "ad00002", "feed", 0, variant_id="v3"))
    # what differs between segments is centred: no emphasis is best everywhere by construction
    assert np.allclose((vw.lift - vw.lift.mean(axis=0)).sum(axis=0), 0.0)
    assert all(len(set(row)) == 4 for row in vw.emphasis.tolist())
    with pytest.raises(UnknownEntityError, match="'v4'"):
        m.true_pctr("u000007", "ad00002", "feed", 0, variant_id="v4")


def test_the_best_variant_differs_between_segments() -> None:
    m = Market(MarketConfig(seed=0, n_users=400, n_ads=10, n_variants=6))
    assert m.variants is not None
    users = np.arange(400)
    best = m.true_variant_pctrs(users, np.zeros(400, dtype=np.int64), "feed", 0).argmax(axis=1)
    per_segment = {int(np.bincount(best[m.variants.segment == s]).argmax()) for s in range(4)}
    assert len(per_segment) > 1


def test_the_open_loop_logs_a_uniform_variant_with_its_propensity() -> None:
    m = Market(MarketConfig(seed=1, n_users=300, n_ads=20, n_variants=3), signing_key=KEY)
    events = list(m.open_loop(3000))
    catalog = [e for e in events if e.kind == "ad"]
    assert all([v.variant_id for v in ad.variants] == ["v0", "v1", "v2"] for ad in catalog)  # type: ignore[union-attr]
    assert {v.emphasis for ad in catalog for v in ad.variants} <= set(CREATIVE_SLOTS)  # type: ignore[union-attr]
    imps = [e for e in events if isinstance(e, Impression)]
    assert {i.variant_propensity for i in imps} == {1 / 3}
    counts = np.bincount([int(i.variant_id[1:]) for i in imps])  # type: ignore[index]
    assert counts.min() > 900  # about 1,000 each
    assert all(check_event(i, KEY) is None for i in imps[:50])  # signed over the variant too
    forged = imps[0].model_copy(update={"variant_id": "v2" if imps[0].variant_id != "v2" else "v1"})
    assert check_event(forged, KEY) is not None
    # the oracle of each logged impression is its variant's truth
    first = imps[0]
    assert m.oracle_pctr(first) == pytest.approx(
        m.true_pctr(first.user_id, first.ad_id, first.slot, first.position, variant_id=first.variant_id)
    )


def test_without_variants_nothing_changes() -> None:
    cfg = MarketConfig(seed=2, n_users=100, n_ads=10)
    m = Market(cfg)
    assert m.variants is None and all(ad.variants == () for ad in m.catalog())
    events = list(m.open_loop(500))
    imps = [e for e in events if isinstance(e, Impression)]
    assert all(i.variant_id is None and i.variant_propensity is None for i in imps)
    # the variants' truth has its own stream of the seed: the rest of the world is the same
    other = Market(MarketConfig(seed=2, n_users=100, n_ads=10, n_variants=2))
    assert [(a.ad_id, a.title, a.bid) for a in other.catalog()] == [
        (a.ad_id, a.title, a.bid) for a in m.catalog()
    ]
    assert (other.world.interests == m.world.interests).all()
    with pytest.raises(Exception, match="no variants"):
        m.true_variant_pctrs(np.array([0]), np.array([0]), "feed", 0)


def test_user_states_tell_the_segment() -> None:
    m = Market(MarketConfig(seed=4, n_users=500, n_ads=10, n_variants=2))
    x = m.user_states(32)
    assert x.shape == (500, 32) and np.allclose(np.linalg.norm(x, axis=1), 1.0)
    assert m.variants is not None
    # nearest segment centroid recovers most users' segment: the state carries it
    seg = m.variants.segment
    centroids = np.stack([x[seg == s].mean(axis=0) for s in range(4)])
    assert (np.argmax(x @ centroids.T, axis=1) == seg).mean() > 0.6  # chance: 0.25
