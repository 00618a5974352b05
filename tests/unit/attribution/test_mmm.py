"""The media-mix model (attribution.mmm): daily data from chDB, a quick PyMC-Marketing fit calibrated
by a lift test, response curves, budget moves with intervals, Meridian's export, bad input."""

from __future__ import annotations

import csv
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from attribution.channel_lift import ChannelLift, HoldoutDesign
from attribution.incrementality import Lift
from attribution.migrate import apply_migrations
from attribution.mmm import (
    L_MAX,
    LiftFileError,
    MmmData,
    daily_data,
    equalise_marginal,
    fit_mmm,
    holdout_split,
    lift_tests,
    lognormal_prior,
    meridian_export,
    parse_lift_csv,
    plan_mmm_budget,
    plan_mmm_split,
)
from attribution.paths import AttributionInputError
from attribution.sql import ChdbBackend
from workloads.attribution_market import (
    SLOTS,
    AttributionMarketConfig,
    default_outside,
    outside_lift_csv,
    period,
    simulate,
    write_raw,
)

pytest.importorskip("pymc_marketing")
# a quick fit takes ~25 s of CPU (compile, 6,000 ADVI steps): more wall time on a loaded machine
pytestmark = pytest.mark.timeout(900)

CFG = AttributionMarketConfig(
    seed=5,
    n_users=1500,
    days=16,
    confounded=True,
    holdout_share=0.3,
    outside=default_outside(),
    daily_jitter=0.4,
)


@pytest.fixture(scope="module")
def market() -> Iterator[tuple[ChdbBackend, object]]:
    b = ChdbBackend(f"mmm_{uuid.uuid4().hex[:6]}")
    apply_migrations(b)
    data = simulate(CFG)
    write_raw(b, data)
    try:
        yield b, data
    finally:
        b.execute(f"DROP DATABASE IF EXISTS {b.database}")
        b.close()


def test_daily_data_is_the_markets_spend_and_conversions_per_day(market: tuple[ChdbBackend, object]) -> None:
    backend, data = market
    since, until = period(CFG)
    d = daily_data(backend, "campaign", since, until)
    assert d.days == 16 and d.first_day * 86400 == since
    campaigns = [c.campaign_id for c in CFG.campaigns]
    assert d.channels == tuple(sorted([*campaigns, *(o.name for o in CFG.outside)]))
    imp = data.imp  # type: ignore[attr-defined]
    price = np.array([c.price for c in CFG.campaigns for _ in SLOTS])
    served = ~imp["holdout"]
    day = (imp["t"] // 86400).astype(int)
    for ci, cmp in enumerate(campaigns):
        mine = served & (imp["channel"] // len(SLOTS) == ci)
        want = np.bincount(day[mine], weights=price[imp["channel"][mine]], minlength=16)
        assert d.spend[:, d.channels.index(cmp)] == pytest.approx(want, rel=1e-9)
    for j, o in enumerate(CFG.outside):
        assert d.spend[:, d.channels.index(o.name)] == pytest.approx(data.outside_spend[j], rel=1e-6)  # type: ignore[attr-defined]
    conv_day = np.bincount((data.conv["t"] // 86400).astype(int), minlength=16)  # type: ignore[attr-defined]
    assert d.conversions.tolist() == conv_day.tolist()
    # the campaign budgets vary day to day (the market's daily jitter): what a media-mix model needs
    assert float(np.std(d.spend[:, 0]) / np.mean(d.spend[:, 0])) > 0.1


def test_bad_input_is_named(market: tuple[ChdbBackend, object]) -> None:
    backend, _ = market
    since, _ = period(CFG)
    with pytest.raises(AttributionInputError, match="no whole UTC day"):
        daily_data(backend, "campaign", since + 10, since + 86000)
    with pytest.raises(AttributionInputError, match="no spend and conversions"):
        daily_data(backend, "campaign", since - 30 * 86400, since - 20 * 86400)
    with pytest.raises(AttributionInputError, match="'nope' is not a granularity"):
        daily_data(backend, "nope", since, since + 86400)
    short = daily_data(backend, "campaign", since, since + 5 * 86400)
    with pytest.raises(AttributionInputError, match=f"at least {2 * L_MAX} days"):
        fit_mmm(short)
    with pytest.raises(AttributionInputError, match="needs --by campaign"):
        lift_tests(short, {}, "slot")


def _synthetic(seed: int = 0) -> tuple[MmmData, np.ndarray]:
    """42 days, four channels: a, b, c with known effects through adstock and saturation, d none."""
    rng = np.random.default_rng(seed)
    days = 42
    spend = rng.lognormal(0, 0.4, (days, 4)) * np.array([10.0, 20.0, 40.0, 5.0])
    ad = spend.copy()
    for d in range(1, days):
        ad[d] += 0.4 * ad[d - 1]
    caused = np.array([3.0, 2.0, 1.0, 0.0]) * ad / (ad + ad.mean(0))
    conv = rng.poisson(15 + caused.sum(1)).astype(float)
    return MmmData(20_000, ("a", "b", "c", "d"), spend, spend * 100, conv, conv * 50), caused


@pytest.fixture(scope="module")
def quick_fit() -> object:
    data, _ = _synthetic()
    # a lift test says d adds nothing at its mean spend
    return fit_mmm(data, [{"channel": "d", "x": 0.0, "delta_x": 5.0, "delta_y": 0.0, "sigma": 0.05}], seed=1)


def test_quick_fit_curves_match_the_libraries_contributions(quick_fit: object) -> None:
    fit = quick_fit
    data = fit.data  # type: ignore[attr-defined]
    assert fit.meta["method"] == "advi" and fit.meta["lift_tests"] == ["d"]  # type: ignore[attr-defined]
    # the response curve (numpy, from the posterior's parameters) run through the same normalised
    # geometric adstock gives PyMC-Marketing's own channel contributions, draw by draw
    alpha = fit.alpha  # type: ignore[attr-defined]
    w = alpha[:, None, :] ** np.arange(L_MAX)[None, :, None]
    w = w / w.sum(axis=1, keepdims=True)
    ad = np.zeros((alpha.shape[0], data.days, 4))
    for d in range(data.days):
        for k in range(min(L_MAX, d + 1)):
            ad[:, d] += w[:, k] * data.spend[d - k]
    x = ad / fit.channel_scale  # type: ignore[attr-defined]
    u = fit.lam[:, None, :] * x  # type: ignore[attr-defined]
    mine = fit.target_scale * fit.beta[:, None, :] * (1 - np.exp(-u)) / (1 + np.exp(-u))  # type: ignore[attr-defined]
    assert mine.sum(axis=1) == pytest.approx(fit.contribution, rel=1e-6)  # type: ignore[attr-defined]
    steady = fit.response(data.spend.mean(axis=0)[None, :])[:, 0]  # type: ignore[attr-defined]
    assert steady.shape == (alpha.shape[0], 4) and np.all(steady >= 0)
    curves = fit.curves()  # type: ignore[attr-defined]
    assert curves["a"]["conversions"][0] == 0.0
    assert all(lo <= hi for lo, hi in zip(curves["b"]["low"], curves["b"]["high"], strict=True))
    # calibrated to no lift, d's share stays small (uncalibrated it took 0.19 on this market)
    share = fit.shares()  # type: ignore[attr-defined]
    assert share[3] < 0.15 and share[3] < min(share[0], share[1])


def test_budget_moves_keep_the_budget_within_bounds_with_an_interval(quick_fit: object) -> None:
    plan = plan_mmm_budget(quick_fit, max_change=0.5)  # type: ignore[arg-type]
    assert plan.recommended.sum() == pytest.approx(plan.spend.sum(), rel=1e-6)
    assert np.all(plan.recommended >= plan.spend * 0.5 - 1e-9) and np.all(
        plan.recommended <= plan.spend * 1.5 + 1e-9
    )
    assert plan.gain["low"] <= plan.gain["mean"] <= plan.gain["high"]
    # the posterior-mean optimum gains at least what keeping the budget as it is gains (0)
    assert plan.gain["mean"] >= -1e-9
    body = plan.to_dict()
    assert [c["channel"] for c in body["channels"]] == ["a", "b", "c", "d"]  # type: ignore[index]


def test_budget_moves_fund_the_best_return_first_when_curves_are_linear() -> None:
    # returns 3, 2 and 1 a unit of spend, each within ±50 % of 10: the best takes its top, the worst
    # its floor, the middle one the rest (the grid's leftover used to be spread over every channel
    # with room: [15, 7.5, 7.5], funding the worst)
    spend = np.array([10.0, 10.0, 10.0])
    new = equalise_marginal(0.5 * spend, 1.5 * spend, 30.0, lambda g: g * np.array([3.0, 2.0, 1.0]))
    assert new == pytest.approx([15.0, 10.0, 5.0])
    # concave curves: equal marginal returns inside the bounds (√s has marginal 1 / (2√s))
    new = equalise_marginal(
        np.array([1.0, 1.0]), np.array([30.0, 30.0]), 20.0, lambda g: np.sqrt(g) * np.array([1.0, 2.0])
    )
    assert new == pytest.approx([4.0, 16.0], rel=0.02)


def test_meridian_export(tmp_path: Path) -> None:
    data, _ = _synthetic()
    lift = Lift("a", 1000, 400, 0.1, 0.05, 50.0, 10.0)
    spec = meridian_export(data, {"a": lift}, tmp_path)
    rows = list(csv.DictReader((tmp_path / "meridian_data.csv").open()))
    assert len(rows) == 42 and rows[0]["time"] == "2024-10-04"
    cols = spec["coord_to_columns"]
    assert cols["kpi"] == "conversions" and cols["media_spend"] == [
        "a_spend",
        "b_spend",
        "c_spend",
        "d_spend",
    ]
    assert set(rows[0]) == {
        "time",
        "conversions",
        "revenue_per_conversion",
        *cols["media"],
        *cols["media_spend"],
    }
    assert float(rows[3]["b_spend"]) == pytest.approx(data.spend[3, 1], rel=1e-6)
    assert spec["media_spend_to_channel"]["a_spend"] == "a"
    prior = spec["roi_m_priors"]["a"]
    assert set(spec["roi_m_priors"]) == {"a"}  # only the channel a holdout measured
    roi = 50.0 * data.value.sum() / data.conversions.sum() / data.spend[:, 0].sum()
    assert prior["roi_mean"] == pytest.approx(roi, rel=1e-5)
    assert np.exp(prior["mu"] + prior["sigma"] ** 2 / 2) == pytest.approx(roi, rel=1e-4)
    assert json.loads((tmp_path / "meridian_spec.json").read_text()) == spec


def test_lognormal_prior_has_the_asked_mean_and_sd() -> None:
    p = lognormal_prior(2.0, 0.5)
    mean = np.exp(p["mu"] + p["sigma"] ** 2 / 2)
    sd = mean * np.sqrt(np.exp(p["sigma"] ** 2) - 1)
    assert (mean, sd) == pytest.approx((2.0, 0.5), rel=1e-4)


def test_lift_tests_from_holdouts(market: tuple[ChdbBackend, object]) -> None:
    from attribution.incrementality import measure_lift

    backend, _ = market
    since, until = period(CFG)
    d = daily_data(backend, "campaign", since, until)
    lifts = measure_lift(backend, since, until)
    rows = lift_tests(d, lifts, "campaign")
    assert {r["channel"] for r in rows} == set(lifts) - {o.name for o in CFG.outside}
    for r in rows:
        lift = lifts[r["channel"]]
        c = d.channels.index(r["channel"])
        assert r["delta_x"] == pytest.approx(d.spend[:, c].mean())
        assert r["delta_y"] == pytest.approx(max(lift.incremental_conversions, 0.0) / 16)
        assert r["sigma"] == pytest.approx(lift.se / 16)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_full_fit_by_nuts_converges() -> None:
    data, _ = _synthetic(seed=3)
    fit = fit_mmm(data, quick=False, seed=2)  # r-hat ≤ 1.1 on every parameter, else MmmFitError
    assert fit.meta["method"] == "nuts" and fit.alpha.shape == (2 * 500, 4)
    assert fit.shares().sum() == pytest.approx(1.0)
    plan = plan_mmm_budget(fit)
    assert plan.gain["low"] <= plan.gain["mean"] <= plan.gain["high"]


LIFT_CHANNELS = ("cmp_a", "google/cpc/brand", "newsletter/email")


def test_lift_file_rows_in_pymc_marketings_form() -> None:
    text = (
        "channel,delta_x,delta_y,sigma\n"  # x left out: 0
        "google/cpc/brand,60,5.5,1.2\n"
        "\n"
        "newsletter/email,8,-0.4,0.3\n"  # a lift that came out with the wrong sign (noise)
    )
    rows, notes = parse_lift_csv(text, LIFT_CHANNELS)
    assert rows == [
        {"channel": "google/cpc/brand", "x": 0.0, "delta_x": 60.0, "delta_y": 5.5, "sigma": 1.2},
        {"channel": "newsletter/email", "x": 0.0, "delta_x": 8.0, "delta_y": 0.0, "sigma": 0.3},
    ]
    assert len(notes) == 1 and notes[0].startswith("line 4: newsletter/email") and "counted as 0" in notes[0]
    rows, notes = parse_lift_csv("sigma,channel,x,delta_y,delta_x\n0.5,cmp_a,10,-1,-4\n", LIFT_CHANNELS)
    assert rows == [{"channel": "cmp_a", "x": 10.0, "delta_x": -4.0, "delta_y": -1.0, "sigma": 0.5}]
    assert notes == []


def test_lift_file_bad_rows_are_each_named_by_line() -> None:
    text = (
        "channel,x,delta_x,delta_y,sigma\n"
        "tv/linear,0,10,1,1\n"  # 2: not a fitted channel
        "cmp_a,0,ten,1,1\n"  # 3
        "cmp_a,0,10,nan,1\n"  # 4
        "cmp_a,0,10,1,0\n"  # 5
        "cmp_a,0,0,1,1\n"  # 6
        "cmp_a,-1,10,1,1\n"  # 7
        "cmp_a,5,-6,-1,1\n"  # 8
        "cmp_a,0,10\n"  # 9
        "cmp_a,0,10,1,1\n"  # 10: fine
    )
    with pytest.raises(LiftFileError) as info:
        parse_lift_csv(text, LIFT_CHANNELS, "lifts.csv")
    msg = str(info.value)
    assert msg.startswith("lifts.csv: 8 bad rows, nothing fitted")
    for line, needle in [
        (2, "channel 'tv/linear' is not in the data"),
        (3, "delta_x 'ten' is not a number"),
        (4, "delta_y 'nan' is not finite"),
        (5, "sigma 0 is not above 0"),
        (6, "delta_x is 0"),
        (7, "x -1 is below 0"),
        (8, "x + delta_x = -1 is below 0"),
        (9, "expected 5 cells"),
    ]:
        assert f"line {line}: {needle}" in msg, (line, msg)
    assert "line 10" not in msg
    for bad, needle in [
        ("channel,delta_x,sigma\ncmp_a,1,1\n", "line 1: header lacks delta_y"),
        ("channel,x,delta_x,delta_y,sigma,geo\n", "line 1: unknown columns 'geo'"),
        ("channel,x,delta_x,delta_y,sigma\n", "no lift rows"),
        ("", "line 1: header lacks channel"),
    ]:
        with pytest.raises(LiftFileError, match=needle):
            parse_lift_csv(bad, LIFT_CHANNELS)


def test_simulated_geo_tests_estimate_the_outside_channels_truth(market: tuple[ChdbBackend, object]) -> None:
    _, data = market
    names = tuple(o.name for o in CFG.outside)
    caused = data.outside_expected() / CFG.days  # type: ignore[attr-defined]
    t = data.conv["t"]  # type: ignore[attr-defined]
    per_day = np.count_nonzero((t >= 0) & (t < CFG.days * 86400)) / CFG.days
    se = np.sqrt(per_day / CFG.days * (1 / 0.8 + 1 / 0.2))  # a 20 % geo holdout's Poisson error
    draws = []
    for seed in range(200):
        text = outside_lift_csv(data, holdout=0.2, seed=seed)  # type: ignore[arg-type]
        rows, _ = parse_lift_csv(text, names)
        assert [r["channel"] for r in rows] == list(names)
        for j, r in enumerate(rows):
            assert r["x"] == 0.0 and r["sigma"] == pytest.approx(se, rel=1e-4)
            assert r["delta_x"] == pytest.approx(data.outside_spend[j].mean(), rel=1e-5)  # type: ignore[attr-defined]
        draws.append([float(line.split(",")[3]) for line in text.splitlines()[1:]])
    est = np.array(draws)
    # unbiased around the truth (before the reader's clamp at 0), spread by the stated error
    assert np.abs(est.mean(axis=0) - caused).max() < 4 * se / np.sqrt(200)
    assert est.std(axis=0) == pytest.approx(np.full(3, se), rel=0.2)
    with pytest.raises(ValueError, match=r"holdout 1\.0"):
        outside_lift_csv(data, holdout=1.0)  # type: ignore[arg-type]


def test_moves_split_within_a_unit_by_credit(quick_fit: object) -> None:
    fit = quick_fit
    whole = plan_mmm_budget(fit)  # type: ignore[arg-type]
    # parts with credit in proportion to spend are the unit's curve cut in two: the same moves
    even = plan_mmm_split(fit, {"a": {"a:x": (3.0, 1.0), "a:y": (9.0, 3.0)}})  # type: ignore[arg-type]
    assert even.channels == ("a:x", "a:y", "b", "c", "d")
    assert even.spend[:2].sum() == pytest.approx(whole.spend[0]) and even.spend[0] == pytest.approx(
        whole.spend[0] / 4
    )
    m_whole, m_even = whole.multipliers, even.multipliers
    for part in ("a:x", "a:y"):
        assert m_even[part] == pytest.approx(m_whole["a"], abs=0.01)
    for unit in "bcd":
        assert m_even[unit] == pytest.approx(m_whole[unit], abs=0.01)
    assert even.gain["mean"] == pytest.approx(whole.gain["mean"], abs=0.02 * abs(whole.gain["mean"]) + 1e-3)
    # a part that earns more credit a dollar is funded first, the other cut: the split gains more
    skew = plan_mmm_split(fit, {"a": {"a:x": (9.0, 1.0), "a:y": (3.0, 3.0)}})  # type: ignore[arg-type]
    m = skew.multipliers
    assert m["a:x"] == pytest.approx(1.5) and m["a:y"] < m_whole["a"]
    assert skew.recommended.sum() == pytest.approx(whole.spend.sum(), rel=1e-6)
    assert skew.gain["mean"] > whole.gain["mean"]
    assert skew.gain["low"] <= skew.gain["mean"] <= skew.gain["high"]
    with pytest.raises(AttributionInputError, match="max change -1"):
        plan_mmm_split(fit, {}, max_change=-1)  # type: ignore[arg-type]


def _design(lifts: dict[str, tuple[tuple[str, ...], list[float], list[float]]]) -> HoldoutDesign:
    return HoldoutDesign(
        channels={
            c: ChannelLift(c, slots, np.array(x), np.array(se), np.ones(len(slots)), float(sum(x)), 1.0)
            for c, (slots, x, se) in lifts.items()
        }
    )


def test_holdout_split_keeps_campaigns_whole_when_the_slots_differ_by_noise_only() -> None:
    # measured per-slot lifts within one standard error of a split by spend: τ² = 0, so every
    # campaign's credit splits as its spend does (the split moves nothing between its slots)
    spend = {"a:feed": 30.0, "a:search": 10.0, "b:feed": 20.0, "b:splash": 20.0, "c": 5.0}
    design = _design({
        "a": (("feed", "search"), [31.0, 9.0], [5.0, 5.0]),
        "b": (("feed", "splash"), [18.0, 22.0], [5.0, 5.0]),
    })  # fmt: skip
    split = holdout_split(design, spend)
    assert set(split) == {"a", "b"}  # c has no holdout (an outside channel): stays whole
    for parts in split.values():
        total = sum(w for w, _ in parts.values())
        for name, (w, v) in parts.items():
            assert v == spend[name]
            assert w / total == pytest.approx(v / sum(s for _, s in parts.values()))


def test_holdout_split_moves_nothing_when_the_slots_differences_are_not_significant() -> None:
    # every gap 1.15 standard errors: the method of moments alone puts τ² above 0 (mean gap²
    # 132 > se² 100) and moved 57/43; Cochran's Q (5.29 on 2 degrees of freedom, p = 0.07) says
    # the slots are not told apart, so each campaign splits as its spend does
    spend = {"a:feed": 20.0, "a:search": 20.0, "b:feed": 20.0, "b:splash": 20.0}

    def shares(se: float) -> list[float]:  # each campaign's first slot's share of its split
        slots = {"a": (("feed", "search"), [31.5, 8.5]), "b": (("feed", "splash"), [8.5, 31.5])}
        split = holdout_split(_design({c: (s, x, [se, se]) for c, (s, x) in slots.items()}), spend)
        return [w[0] / sum(w) for w in ([w for w, _ in p.values()] for p in split.values())]

    assert shares(10.0) == pytest.approx([0.5, 0.5])
    # the same gaps at a quarter of the noise are significant: the split follows them
    assert shares(2.5)[0] > 0.7


def test_holdout_split_follows_slots_measured_apart() -> None:
    # a: search returns 3× feed a dollar, far beyond the noise; its split follows the measurement
    # (shrunk by its precision toward the spend split), b's noise-level gap stays near spend
    spend = {"a:feed": 30.0, "a:search": 10.0, "b:feed": 20.0, "b:splash": 20.0}
    design = _design({
        "a": (("feed", "search"), [12.0, 12.0], [1.0, 1.0]),
        "b": (("feed", "splash"), [21.0, 19.0], [4.0, 4.0]),
    })  # fmt: skip
    split = holdout_split(design, spend)
    a = {k: w for k, (w, _) in split["a"].items()}
    share = a["a:search"] / (a["a:feed"] + a["a:search"])
    assert 0.45 < share <= 0.5  # measured 0.5, spend share 0.25: little shrinkage at se 1
    b = {k: w for k, (w, _) in split["b"].items()}
    assert b["b:feed"] / (b["b:feed"] + b["b:splash"]) == pytest.approx(0.5, abs=0.03)


def test_holdout_split_leaves_out_campaigns_not_measured_per_slot() -> None:
    spend = {"a:feed": 30.0, "a:search": 10.0, "b:feed": 20.0}
    # a's search was not measured; b has one spent slot: nothing to split
    design = _design({"a": (("feed",), [10.0], [1.0]), "b": (("feed",), [5.0], [1.0])})
    assert holdout_split(design, spend) == {}
    # a lift with a NaN (a slot without holdout users) is not used either
    design = _design({"a": (("feed", "search"), [10.0, float("nan")], [1.0, 1.0])})
    assert holdout_split(design, spend) == {}
