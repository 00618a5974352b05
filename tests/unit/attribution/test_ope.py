"""attribution.ope: hand-computed cases, Open Bandit Pipeline parity, input checks, coverage."""

from __future__ import annotations

import doctest
import math
from dataclasses import astuple

import numpy as np
import pytest

from attribution import ope
from attribution.ope import Estimate, EstimationError, dr, ips, snips
from schemas.errors import AdstreamError


def test_doctests() -> None:
    assert doctest.testmod(ope).failed == 0


def test_ips_by_hand() -> None:
    # w = [2, 0, 2, 1]; terms w·r = [2, 0, 2, 0]: mean 1, sample sd = sqrt(4/3)
    e = ips([1, 0, 1, 0], [0.5, 0.5, 0.25, 1.0], [1, 0, 0.5, 1])
    half = 1.959963984540054 * math.sqrt(4 / 3) / 2
    assert astuple(e) == pytest.approx(astuple(Estimate(1.0, 1.0 - half, 1.0 + half, 4)))


def test_snips_by_hand() -> None:
    # Σ w r = 4, Σ w = 5 → 0.8; influence w (r − 0.8) / mean(w) = [0.32, 0, 0.32, −0.64]
    e = snips([1, 0, 1, 0], [0.5, 0.5, 0.25, 1.0], [1, 0, 0.5, 1])
    psi = np.array([0.32, 0.0, 0.32, -0.64])
    half = 1.959963984540054 * psi.std(ddof=1) / 2
    assert e.value == pytest.approx(0.8)
    assert (e.ci_low, e.ci_high) == pytest.approx((0.8 - half, 0.8 + half))


def test_dr_by_hand() -> None:
    # terms: 0.6 + 2·(1 − 0.6) = 1.4 and 0.4 + 0·(0 − 0.2) = 0.4
    e = dr([1, 0], [0.5, 0.5], [1, 0], [0.6, 0.2], [0.6, 0.4])
    half = 1.959963984540054 * np.std([1.4, 0.4], ddof=1) / math.sqrt(2)
    assert astuple(e) == pytest.approx(astuple(Estimate(0.9, 0.9 - half, 0.9 + half, 2)))


def test_logging_policy_scores_its_own_mean() -> None:
    r = np.array([1.0, 0.0, 0.0, 1.0, 0.0])
    p = np.array([0.2, 0.9, 0.5, 0.7, 1.0])
    assert ips(r, p, p).value == pytest.approx(r.mean())
    assert snips(r, p, p).value == pytest.approx(r.mean())


def test_one_round_has_an_unbounded_interval() -> None:
    e = ips([1], [0.5], [0.5])
    assert e.value == 1.0 and e.ci_low == -math.inf and e.ci_high == math.inf


def _synthetic(seed: int, n: int = 4000, k: int = 6) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, k))
    pi_b = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    pi_b = 0.8 * pi_b + 0.2 / k
    action = (pi_b.cumsum(axis=1) > rng.random((n, 1))).argmax(axis=1)
    true_q = 1 / (1 + np.exp(-(logits - 1.0)))
    reward = (rng.random(n) < true_q[np.arange(n), action]).astype(float)
    pi_e = np.exp(2 * logits) / np.exp(2 * logits).sum(axis=1, keepdims=True)
    q_hat = np.clip(true_q + rng.normal(0, 0.1, size=(n, k)), 0, 1)
    return {"reward": reward, "action": action, "pi_b": pi_b, "pi_e": pi_e, "q_hat": q_hat, "true_q": true_q}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_values_equal_obp(seed: int) -> None:
    from obp.ope import DoublyRobust, InverseProbabilityWeighting, SelfNormalizedInverseProbabilityWeighting

    d = _synthetic(seed)
    n = d["reward"].shape[0]
    rows = np.arange(n)
    pscore = d["pi_b"][rows, d["action"]]
    target = d["pi_e"][rows, d["action"]]
    q_logged = d["q_hat"][rows, d["action"]]
    q_target = (d["pi_e"] * d["q_hat"]).sum(axis=1)
    dist = d["pi_e"][:, :, None]
    common = {"reward": d["reward"], "action": d["action"], "pscore": pscore, "action_dist": dist}
    obp_ips = InverseProbabilityWeighting().estimate_policy_value(**common)
    obp_snips = SelfNormalizedInverseProbabilityWeighting().estimate_policy_value(**common)
    obp_dr = DoublyRobust().estimate_policy_value(
        **common, estimated_rewards_by_reg_model=d["q_hat"][:, :, None]
    )
    assert ips(d["reward"], pscore, target).value == pytest.approx(obp_ips, rel=1e-12)
    assert snips(d["reward"], pscore, target).value == pytest.approx(obp_snips, rel=1e-12)
    assert dr(d["reward"], pscore, target, q_logged, q_target).value == pytest.approx(obp_dr, rel=1e-12)


def test_intervals_cover_the_truth_near_the_nominal_rate() -> None:
    covered = {"ips": 0, "snips": 0, "dr": 0}
    trials = 200
    for seed in range(trials):
        d = _synthetic(1000 + seed, n=1500)
        n = d["reward"].shape[0]
        rows = np.arange(n)
        truth = float((d["pi_e"] * d["true_q"]).sum(axis=1).mean())
        pscore = d["pi_b"][rows, d["action"]]
        target = d["pi_e"][rows, d["action"]]
        q_target = (d["pi_e"] * d["q_hat"]).sum(axis=1)
        estimates = {
            "ips": ips(d["reward"], pscore, target),
            "snips": snips(d["reward"], pscore, target),
            "dr": dr(d["reward"], pscore, target, d["q_hat"][rows, d["action"]], q_target),
        }
        for name, e in estimates.items():
            covered[name] += e.ci_low <= truth <= e.ci_high
    for name, hits in covered.items():
        # nominal 95 %: with 200 trials a correct interval lands in [0.90, 0.99] with near certainty
        assert 0.90 <= hits / trials <= 0.99, (name, hits)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (([1, 0], [0.5], [1, 1]), "pscore has 1 rounds but reward has 2"),
        (([1, 0], [0.5, 0.0], [1, 1]), "pscore[1] = 0.0 is not a probability in (0, 1]"),
        (([1, 0], [0.5, 1.5], [1, 1]), "pscore[1] = 1.5"),
        (([1, math.nan], [0.5, 0.5], [1, 1]), "reward[1] = nan is not finite"),
        (([1, 0], [0.5, 0.5], [1, -0.1]), "target_prob[1] = -0.1"),
        (([], [], []), "reward is empty"),
        (([[1, 0]], [0.5, 0.5], [1, 1]), "reward must be one-dimensional"),
    ],
)
def test_bad_input_is_named(args: tuple[list[float], ...], needle: str) -> None:
    with pytest.raises(EstimationError) as info:
        ips(*args)
    assert needle in str(info.value)
    assert isinstance(info.value, AdstreamError) and isinstance(info.value, ValueError)


def test_snips_with_zero_weights_is_an_error() -> None:
    with pytest.raises(EstimationError, match="Σ w = 0"):
        snips([1, 0], [0.5, 0.5], [0, 0])


def test_dr_checks_its_reward_model_columns() -> None:
    with pytest.raises(EstimationError, match="q_target has 1 rounds"):
        dr([1, 0], [0.5, 0.5], [1, 0], [0.1, 0.2], [0.3])
    with pytest.raises(EstimationError, match=r"q_logged\[0\] = inf"):
        dr([1, 0], [0.5, 0.5], [1, 0], [math.inf, 0.2], [0.3, 0.3])


def test_alpha_is_checked() -> None:
    with pytest.raises(EstimationError, match=r"alpha 1\.5"):
        ips([1, 0], [0.5, 0.5], [1, 1], alpha=1.5)
