"""Off-policy estimates of a variant policy from the simulator's logged impressions (variant and
propensity recorded in each): adstream's IPS / SNIPS / DR equal Open Bandit Pipeline's on the same
arrays, and the simulated truth lies in their intervals."""

from __future__ import annotations

import numpy as np
import pytest
from obp.ope import DoublyRobust, InverseProbabilityWeighting, SelfNormalizedInverseProbabilityWeighting

from attribution import ope
from schemas.events import Click, Impression
from workloads import Market, MarketConfig

V = 4


@pytest.fixture(scope="module")
def logs() -> dict[str, np.ndarray]:
    market = Market(
        MarketConfig(seed=11, n_users=500, n_ads=20, n_variants=V, bias=-2.0, drift_at=None, new_ads_at=None)
    )
    events = list(market.open_loop(8000))
    imps = [e for e in events if isinstance(e, Impression)]
    clicked = {e.impression_id for e in events if isinstance(e, Click)}
    action = np.array([int(i.variant_id[1:]) for i in imps])  # type: ignore[index]
    # the policy under evaluation: v0 on the search slot, v1 elsewhere (deterministic per context)
    best = np.array([0 if i.slot == "search" else 1 for i in imps])
    truth = np.mean(
        [
            market.true_pctr(i.user_id, i.ad_id, i.slot, i.position, f"v{b}")
            for i, b in zip(imps, best, strict=True)
        ]
    )
    return {
        "reward": np.array([float(i.event_id in clicked) for i in imps]),
        "pscore": np.array([i.variant_propensity for i in imps], dtype=np.float64),
        "action": action,
        "best": best,
        "truth": np.array(truth),
    }


def test_the_estimators_equal_obp_and_cover_the_truth(logs: dict[str, np.ndarray]) -> None:
    r, p, a, best = logs["reward"], logs["pscore"], logs["action"], logs["best"]
    n = r.shape[0]
    assert np.allclose(p, 1 / V)
    dist = np.zeros((n, V, 1))
    dist[np.arange(n), best, 0] = 1.0
    target = dist[np.arange(n), a, 0]
    q = np.full((n, V, 1), r.mean())  # a constant reward model
    ours = {
        "ips": ope.ips(r, p, target),
        "snips": ope.snips(r, p, target),
        "dr": ope.dr(r, p, target, q[np.arange(n), a, 0], (dist * q).sum(axis=(1, 2))),
    }
    kw = {"reward": r, "action": a, "position": np.zeros(n, dtype=np.int64), "pscore": p, "action_dist": dist}
    theirs = {
        "ips": InverseProbabilityWeighting().estimate_policy_value(**kw),
        "snips": SelfNormalizedInverseProbabilityWeighting().estimate_policy_value(**kw),
        "dr": DoublyRobust().estimate_policy_value(**kw, estimated_rewards_by_reg_model=q),
    }
    truth = float(logs["truth"])
    for name, est in ours.items():
        assert est.value == pytest.approx(float(theirs[name]), abs=1e-12), name
        assert est.ci_low <= truth <= est.ci_high, (name, est, truth)
