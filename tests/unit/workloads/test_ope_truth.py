"""workloads.ope_truth: logged propensities are exact, and SNIPS / DR estimate a different
policy's CTR within 10 % of the simulator's truth."""

from __future__ import annotations

import numpy as np
import pytest

from attribution.ope import ips
from workloads.ope_truth import OpeTruthConfig, log_bandit, score, summarize

pytestmark = pytest.mark.timeout(120)

SMALL = OpeTruthConfig(seed=1, rounds=30_000)


def test_propensities_are_those_of_the_logging_policy() -> None:
    b = log_bandit(SMALL)
    eps, k = SMALL.epsilon, SMALL.candidates
    # only two values are possible: the greedy ad's and a non-greedy explored ad's
    assert set(np.round(b.pscore, 12)) <= {round(1 - eps + eps / k, 12), round(eps / k, 12)}
    # the logging policy scored on its own logs is its realised CTR, and close to its truth
    on = ips(b.reward, b.pscore, b.pscore)
    assert on.value == pytest.approx(b.reward.mean())
    assert on.ci_low <= b.logging_value <= on.ci_high
    # E[w] = 1 for any target that is a distribution over the candidates
    w = b.target_prob / b.pscore
    assert abs(w.mean() - 1.0) < 4 * w.std() / np.sqrt(w.size)


def test_target_differs_from_logging() -> None:
    b = log_bandit(SMALL)
    assert b.true_value > 1.2 * b.logging_value  # the better ranker is worth estimating


@pytest.mark.parametrize("seed", [1, 2])
def test_snips_and_dr_are_within_ten_percent_of_the_truth(seed: int) -> None:
    r = score(OpeTruthConfig(seed=seed, rounds=30_000))
    for name in ("snips", "dr"):
        assert abs(r.relative_error(name)) < 0.10, (name, r.as_dict())


def test_summarize_pools_seeds() -> None:
    runs = [score(OpeTruthConfig(seed=s, rounds=5_000)) for s in (3, 4, 5)]
    s = summarize(runs)
    assert set(s) == {"ips", "snips", "dr"}
    for v in s.values():
        assert v["ci_low"] <= v["mean"] <= v["ci_high"] and v["runs"] == 3
        assert v["mean_abs"] <= v["max_abs"]
    with pytest.raises(ValueError, match="at least 2 runs"):
        summarize(runs[:1])


def test_bad_configs_are_named() -> None:
    with pytest.raises(ValueError, match="epsilon 0"):
        OpeTruthConfig(epsilon=0)
    with pytest.raises(ValueError, match="candidates 1"):
        OpeTruthConfig(candidates=1)
