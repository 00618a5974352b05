"""Pure pieces of the simulator: truth functions, logging policies and config checks."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from schemas.errors import ConfigError
from workloads import truth
from workloads.config import MarketConfig, resolve_at
from workloads.policy import PopularityPolicy, RandomPolicy


def test_doctests_of_truth() -> None:
    assert doctest.testmod(truth).failed == 0


def test_auc_matches_sklearn_with_ties() -> None:
    rng = np.random.default_rng(0)
    scores = np.round(rng.random(500), 1)  # many ties
    labels = rng.random(500) < scores
    assert truth.auc(scores, labels) == pytest.approx(roc_auc_score(labels, scores))
    assert np.isnan(truth.auc([0.1, 0.2], [1, 1]))


def test_bounces_are_likelier_for_poor_matches() -> None:
    rng = np.random.default_rng(1)
    kw = {"median_ms": 20_000.0, "sigma": 0.8, "bounce_prob_max": 0.5}
    poor = [truth.sample_dwell_ms(rng, 0.05, **kw) for _ in range(4000)]
    good = [truth.sample_dwell_ms(rng, 0.95, **kw) for _ in range(4000)]
    bounce = lambda xs: np.mean(np.asarray(xs) < truth.BOUNCE_MS)  # noqa: E731
    assert bounce(poor) == pytest.approx(truth.bounce_probability(0.05, 0.5), abs=0.03)
    assert bounce(good) == pytest.approx(truth.bounce_probability(0.95, 0.5), abs=0.03)
    assert np.median(good) > np.median(poor)


def test_popularity_policy_learns_the_best_ad_and_random_is_uniform() -> None:
    rng = np.random.default_rng(2)
    active = np.arange(5)
    ctr = np.array([0.01, 0.02, 0.2, 0.03, 0.01])
    pol = PopularityPolicy(5, epsilon=0.1)
    picks = []
    for _ in range(3000):
        ad = int(pol.choose(rng, active, 1)[0])
        pol.update(ad, bool(rng.random() < ctr[ad]))
        picks.append(ad)
    assert np.bincount(picks[-1000:], minlength=5).argmax() == 2
    counts = np.bincount([int(RandomPolicy().choose(rng, active, 2)[0]) for _ in range(5000)], minlength=5)
    assert counts.min() > 850


@pytest.mark.parametrize(
    ("field", "value"),
    [("n_users", 0), ("rate", 0.0), ("drift_share", 1.5), ("drift_at", -1.0), ("policy", "greedy"),
     ("slot_k", {"feed": 1}), ("channel_lift", {"feed": -1.0, "search": 0.0, "splash": 0.0})],
)  # fmt: skip
def test_config_errors_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        MarketConfig(**{field: value})  # type: ignore[arg-type]


def test_change_points_are_fractions_or_indices() -> None:
    assert resolve_at(0.25, 1000) == 250
    assert resolve_at(300, 1000) == 300
    assert resolve_at(None, 1000) is None
