"""The stable holdout assignment, and ROI / budget reallocation."""

from __future__ import annotations

import numpy as np
import pytest

from attribution.incrementality import Lift, calibrate
from attribution.models import AttributionResult
from attribution.paths import AttributionInputError
from attribution.roi import optimise, plan_budget
from schemas.errors import ConfigError
from schemas.holdout import is_holdout


def test_holdout_is_stable_random_and_per_campaign() -> None:
    users = [f"u{i}" for i in range(20_000)]
    a = [is_holdout(u, "cmp1", 0.1, "salt") for u in users]
    assert a == [is_holdout(u, "cmp1", 0.1, "salt") for u in users]  # stable
    assert 0.09 < np.mean(a) < 0.11
    b = [is_holdout(u, "cmp2", 0.1, "salt") for u in users]
    both = np.mean(np.array(a) & np.array(b))
    assert 0.005 < both < 0.015  # independent across campaigns (≈ 0.01)
    c = [is_holdout(u, "cmp1", 0.1, "other") for u in users]
    assert a != c  # the salt re-draws
    assert not any(is_holdout(u, "cmp1", 0.0, "salt") for u in users[:100])


def test_holdout_share_out_of_range_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"1\.5"):
        is_holdout("u", "c", 1.5, "s")


def _result(conv: list[float], value: list[float], lo: list[float] | None = None,
            hi: list[float] | None = None) -> AttributionResult:  # fmt: skip
    n = len(conv)
    return AttributionResult(
        "m", tuple(f"c{i}" for i in range(n)), np.array(conv), np.array(value),
        value_ci_low=np.array(lo) if lo else np.zeros(0), value_ci_high=np.array(hi) if hi else np.zeros(0),
    )  # fmt: skip


def test_roi_cpa_and_reallocation_toward_better_roas() -> None:
    r = _result([10, 10], [100, 400], lo=[90, 380], hi=[110, 420])
    plan = plan_budget(r, {"c0": 100.0, "c1": 100.0}, elasticity=0.5, max_change=0.5)
    c0, c1 = plan.channels
    assert c0.roas == pytest.approx(1.0) and c1.roas == pytest.approx(4.0)
    assert c0.roi == pytest.approx(0.0) and c0.cpa == pytest.approx(10.0)
    assert c0.recommended_spend + c1.recommended_spend == pytest.approx(200.0)  # budget fixed
    assert c1.recommended_spend == pytest.approx(150.0)  # at its bound (+50 %)
    assert plan.expected_uplift > 0
    assert not c0.low_confidence and not c1.low_confidence  # intervals apart


def test_overlapping_intervals_flag_low_confidence() -> None:
    r = _result([10, 10], [100, 130], lo=[60, 90], hi=[140, 170])
    plan = plan_budget(r, {"c0": 100.0, "c1": 100.0})
    assert all(c.low_confidence for c in plan.channels)


def test_optimise_interior_solution_equalises_marginal_returns() -> None:
    spend = np.array([100.0, 100.0, 100.0])
    value = np.array([100.0, 200.0, 300.0])
    s = optimise(spend, value, spend * 0, spend * 10, 0.5)
    # with v·(s/s0)^½, the optimum spends ∝ value²: 1 : 4 : 9 of 300
    assert s == pytest.approx(300 * np.array([1, 4, 9]) / 14, rel=1e-4)


def test_budget_bounds_name_unknown_channels_and_bad_ranges() -> None:
    r = _result([1, 1], [1, 1])
    with pytest.raises(AttributionInputError, match="'zz'"):
        plan_budget(r, {"c0": 1.0, "c1": 1.0}, bounds={"zz": (0, 1)})
    with pytest.raises(AttributionInputError, match="'c0'"):
        plan_budget(r, {"c0": 1.0, "c1": 1.0}, bounds={"c0": (5, 1)})
    with pytest.raises(AttributionInputError, match=r"1\.5"):
        plan_budget(r, {"c0": 1.0}, elasticity=1.5)


def test_calibration_sets_measured_campaigns_to_their_lift() -> None:
    r = AttributionResult(
        "m", ("a:feed", "a:search", "b:feed"), np.array([30.0, 10.0, 60.0]), np.array([3.0, 1.0, 6.0])
    )
    lifts = {
        "b": Lift("b", 1000, 100, 0.05, 0.05, 0.0, 5.0),
        "a": Lift("a", 1000, 100, 0.06, 0.02, 40.0, 5.0),
    }
    cal = calibrate(r, lifts, "slot_campaign")
    assert cal.conversions.sum() == pytest.approx(100.0)  # efficiency kept
    assert cal.share == pytest.approx([0.75, 0.25, 0.0])  # b had no lift; a keeps its split
    with pytest.raises(AttributionInputError, match="'slot'"):
        calibrate(r, lifts, "slot")
