"""The truth check: every model against the simulator's exact causal credit.

A market (`workloads.attribution_market`) is simulated and written into the raw tables; paths
are built in ClickHouse at slot × campaign granularity (with the outside channels' touches when
the market has them: `OutsideChannel`); each model's credit shares are compared with the true
shares (total-variation distance; the outside channels' total share beside it). Each model's
budget plan is then re-simulated (the same market with channel budgets scaled as the plan says,
outside channels' daily spend included) and the true caused conversions and value are compared
with the unchanged market. With holdouts in the market, the calibrated
variant of each model is checked too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from attribution.channel_lift import measure_design
from attribution.incrementality import calibrate, measure_lift
from attribution.models import AttributionResult, ModelConfig, attribute, tv_distance
from attribution.paths import Window, build_paths
from attribution.roi import plan_budget
from attribution.sql import Backend
from workloads.attribution_market import (
    SLOTS,
    AttributionMarketConfig,
    MarketData,
    channel_names,
    outside_lift_csv,
    period,
    simulate,
    write_raw,
)

RETARGET = "cmp_retarget"
# the plan a model with exactly the true credit would make (same assumed curve and bounds as every
# multi-touch model's): what credit alone can gain, the reference for every model's budget moves
EXACT = "exact_credit"


@dataclass(frozen=True)
class PlanOutcome:
    """A budget plan re-simulated (the same market, channel budgets scaled by `multipliers`): the
    caused conversions and value it adds to the unchanged market, expected given the touches
    served (`MarketData.expected_credit`: what plans are compared by) and as one draw realised
    them (`true_credit`: tens of conversions of noise, whatever the plan)."""

    multipliers: dict[str, float]
    expected_conversions: float
    expected_value: float
    conversions: float
    value: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_moves_expected_conversions_delta": round(self.expected_conversions, 2),
            "budget_moves_expected_value_delta": round(self.expected_value, 2),
            "budget_moves_true_conversions_delta": round(self.conversions, 2),
            "budget_moves_true_value_delta": round(self.value, 2),
            "budget_moves": {c: round(m, 3) for c, m in self.multipliers.items()},
        }


def plan_outcome(
    cfg: AttributionMarketConfig, base: MarketData, multipliers: dict[str, float]
) -> PlanOutcome:
    """What the plan's budget `multipliers` (channel → factor) change in the market `base` was
    simulated from: caused conversions and value, expected and realised."""
    moved = simulate(replace(cfg, spend_multiplier=multipliers))
    ec, bc = moved.expected_credit()[0], base.expected_credit()[0]
    # the outside channels on the base's days, their spend scaled (a re-simulation redraws it)
    ec[len(ec) - len(cfg.outside) :] = base.outside_expected(multipliers)
    (rc, rv), (tc, tv) = moved.true_credit(), base.true_credit()
    gain = float(ec.sum() - bc.sum())
    return PlanOutcome(dict(multipliers), gain, gain * cfg.value_mean, float(rc.sum() - tc.sum()),
                       float(rv.sum() - tv.sum()))  # fmt: skip


@dataclass(frozen=True)
class ModelTruth:
    """One model's error against the truth and the true outcome of its budget moves."""

    model: str
    error: float  # TV distance of credit shares
    retarget_share: float
    true_share: dict[str, float]
    model_share: dict[str, float]
    outside_share: float | None = None  # the model's share of the outside channels (None: none)
    true_outside_share: float | None = None
    campaign_error: float | None = None  # TV distance of shares per campaign (own) and outside channel
    curve_error: float | None = None  # response curves against the true ones (`curve_error`)
    gain_interval: tuple[float, float, float] | None = None  # a media-mix model's expected gain a day
    outcome: PlanOutcome | None = None  # its budget moves re-simulated (None: not re-simulated)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"error": round(self.error, 4), "retarget_share": round(self.retarget_share, 4)}
        if self.outside_share is not None:
            out["outside_share"] = round(self.outside_share, 4)
            out["true_outside_share"] = round(float(self.true_outside_share or 0.0), 4)
        if self.campaign_error is not None:
            out["campaign_error"] = round(self.campaign_error, 4)
        if self.curve_error is not None:
            out["curve_error"] = round(self.curve_error, 4)
        if self.gain_interval is not None:
            out["expected_gain_per_day"] = [round(x, 3) for x in self.gain_interval]
        if self.outcome is not None:
            out.update(self.outcome.to_dict())
        return out


def truth_window(cfg: AttributionMarketConfig) -> Window:
    """The lookbacks of the truth check: long enough for the market's slow effects."""
    return Window(click_s=3 * 86400, view_s=3 * 86400, gap_s=3 * 86400)


def aligned_truth(data: MarketData, channels: tuple[str, ...]) -> np.ndarray:
    """The true caused conversions per channel, in `channels` order."""
    truth, _ = data.true_credit()
    return np.array([truth[data.channels.index(c)] for c in channels])


def _shares(values: np.ndarray, channels: tuple[str, ...]) -> dict[str, float]:
    total = float(values.sum())
    return {
        c: round(float(v) / total, 4) if total > 0 else 0.0 for c, v in zip(channels, values, strict=True)
    }


def _retarget(result: AttributionResult) -> float:
    return float(sum(s for c, s in zip(result.channels, result.share, strict=True) if c.startswith(RETARGET)))


def check_market(
    backend: Backend,
    cfg: AttributionMarketConfig,
    models: list[str],
    model_cfg: ModelConfig | None = None,
    *,
    budget_moves: bool = True,
    write: bool = True,
    variants: dict[str, tuple[str, dict[str, Any]]] | None = None,
    mmm: str | None = None,
) -> tuple[dict[str, ModelTruth], MarketData]:
    """Simulate, write, build paths, and score each model (and calibrated ones with holdouts).

    `variants` adds named runs of a model with other knobs, e.g.
    `{"markov_null_removal": ("markov", {"markov_removal": "null"})}`. `mmm` ("quick" or "full")
    adds the media-mix model (`mmm`, `mmm+holdout` with holdouts, `mmm+lift` with them and a
    simulated geo test of each outside channel) and scores every model per
    campaign and on its response curves (`check_mmm`).
    """
    model_cfg = model_cfg or ModelConfig(seed=cfg.seed)
    data = simulate(cfg)
    if write:
        write_raw(backend, data)
    since, until = period(cfg)
    paths = build_paths(backend, "slot_campaign", since, until, truth_window(cfg)).paths
    truth = aligned_truth(data, paths.channels)
    results = {m: attribute(m, paths, model_cfg) for m in models}
    for name, (model, knobs) in (variants or {}).items():
        results[name] = replace(attribute(model, paths, replace(model_cfg, **knobs)), model=name)
    if cfg.holdout_share > 0:
        lifts = measure_lift(backend, since, until)
        design = measure_design(backend, since, until)
        for m in list(results):
            cal = calibrate(results[m], lifts, "slot_campaign", design)
            results[cal.model] = cal
    spend = dict(zip(data.channels, data.spend(), strict=True))
    outside_names = {o.name for o in cfg.outside}
    _, base_value = data.true_credit()
    scored = dict(results)
    if budget_moves:  # the reference: the budget plan of a model whose credit is the exact truth
        true_value = np.array([base_value[data.channels.index(c)] for c in paths.channels])
        scored[EXACT] = AttributionResult(EXACT, paths.channels, truth, true_value)
    out: dict[str, ModelTruth] = {}
    for name, result in scored.items():
        outcome = None
        if budget_moves:
            plan = plan_budget(result, spend)
            mult = {c.channel: c.recommended_spend / c.spend for c in plan.channels if c.spend > 0}
            outcome = plan_outcome(cfg, data, mult)
        outside = np.array([c in outside_names for c in paths.channels], dtype=bool)
        shares: tuple[float | None, float | None] = (
            (float(result.share[outside].sum()), float(truth[outside].sum() / max(truth.sum(), 1e-12)))
            if outside_names
            else (None, None)
        )
        out[name] = ModelTruth(
            name, tv_distance(result.conversions, truth), _retarget(result),
            _shares(truth, paths.channels), _shares(result.conversions, paths.channels),
            outside_share=shares[0], true_outside_share=shares[1], outcome=outcome,
        )  # fmt: skip
    if budget_moves:
        # their credit is the truth's
        exact = _shares(truth, paths.channels)
        share = out[EXACT].true_outside_share
        for name, mult in oracle_plans(cfg, data).items():
            out[name] = ModelTruth(
                name, 0.0, 0.0, exact, exact, share, share, outcome=plan_outcome(cfg, data, mult)
            )
    if mmm:
        out.update(
            check_mmm(backend, cfg, data, results, out, quick=mmm == "quick", budget_moves=budget_moves)
        )
    return out, data


# the plans that know the true curves: per channel, and per media-mix unit (what a media-mix model
# can move); the ceiling of what any model's budget moves can gain within the same bounds
ORACLE = "true_curves"
ORACLE_BY_UNIT = "true_curves_by_campaign"
ORACLE_POINTS = np.linspace(0.5, 1.5, 9)  # × every channel's budget, re-simulated


def unit_multipliers(per_unit: dict[str, float], outside: set[str]) -> dict[str, float]:
    """A plan per media-mix unit (campaign, outside channel) as budget factors per market channel."""
    return {c: f for u, f in per_unit.items() for c in ([u] if u in outside else [f"{u}:{s}" for s in SLOTS])}


def expected_curves(cfg: AttributionMarketConfig, data: MarketData) -> np.ndarray:
    """Each channel's expected caused conversions with every budget scaled by each of
    `ORACLE_POINTS` (points × channels): re-simulated, the outside channels on `data`'s days."""
    rows = []
    for m in ORACLE_POINTS:
        row = simulate(replace(cfg, spend_multiplier=_all(cfg, float(m)))).expected_credit()[0]
        row[len(row) - len(cfg.outside) :] = data.outside_expected(_all(cfg, float(m)))
        rows.append(row)
    return np.stack(rows)


def _all(cfg: AttributionMarketConfig, m: float) -> dict[str, float]:
    return {c: m for c in channel_names(cfg)}


def oracle_plans(
    cfg: AttributionMarketConfig, data: MarketData, max_change: float = 0.5
) -> dict[str, dict[str, float]]:
    """The budget plans from the true curves (`expected_curves`, linear between their points),
    marginal returns equalised within ±`max_change` at a fixed total: per channel (`ORACLE`) and
    per campaign / outside channel (`ORACLE_BY_UNIT`)."""
    from attribution.mmm import equalise_marginal

    curves, spend = expected_curves(cfg, data), data.spend()
    outside = {o.name for o in cfg.outside}
    units = tuple(dict.fromkeys(_unit(c, outside) for c in data.channels))
    member = np.array([[_unit(c, outside) == u for c in data.channels] for u in units], dtype=float)
    plans: dict[str, dict[str, float]] = {}
    for name, weights in ((ORACLE, np.eye(len(data.channels))), (ORACLE_BY_UNIT, member)):
        s, curve = weights @ spend, curves @ weights.T  # (units,), (points, units)
        paid = s > 0

        def response(grid: np.ndarray, s: np.ndarray = s[paid], c: np.ndarray = curve[:, paid]) -> np.ndarray:
            return np.stack([np.interp(grid[:, j] / s[j], ORACLE_POINTS, c[:, j]) for j in range(s.size)], 1)

        lo, hi = s[paid] * (1 - min(max_change, 1.0)), s[paid] * (1 + max_change)
        new = equalise_marginal(lo, hi, float(s[paid].sum()), response)
        keys = units if name == ORACLE_BY_UNIT else data.channels
        names = [n for n, p in zip(keys, paid, strict=True) if p]
        per = {n: float(x / y) for n, x, y in zip(names, new, s[paid], strict=True)}
        plans[name] = unit_multipliers(per, outside) if name == ORACLE_BY_UNIT else per
    return plans


CURVE_POINTS = (0.5, 0.75, 1.0, 1.25, 1.5)  # × each channel's mean daily spend
ELASTICITY = 0.5  # attribution.roi's default: the curve a multi-touch model's budget moves assume


def _unit(channel: str, outside: set[str]) -> str:
    """A channel's media-mix unit: its campaign (own channels) or itself (outside channels)."""
    return channel if channel in outside else channel.rsplit(":", 1)[0]


def by_unit(
    values: np.ndarray, channels: tuple[str, ...], units: tuple[str, ...], outside: set[str]
) -> np.ndarray:
    """Per-channel values summed per media-mix unit, in `units` order."""
    out = np.zeros(len(units))
    at = {u: i for i, u in enumerate(units)}
    for v, c in zip(values, channels, strict=True):
        u = _unit(c, outside)
        if u in at:
            out[at[u]] += float(v)
    return out


def true_curves(data: MarketData, units: tuple[str, ...], daily_spend: np.ndarray) -> np.ndarray:
    """True caused conversions a day per unit at each of `CURVE_POINTS` × its mean daily spend
    (points × units): an own campaign's impressions each cause with a fixed probability (linear in
    its budget; the small synergy term taken as linear too); an outside channel's steady-state
    adstock s/(1 − decay) through its Hill curve."""
    cfg = data.config
    outside = {o.name: o for o in cfg.outside}
    caused = by_unit(data.true_credit()[0], data.channels, units, set(outside)) / cfg.days
    m = np.array(CURVE_POINTS)[:, None]
    out = caused[None, :] * m
    for j, u in enumerate(units):
        if u in outside:
            o = outside[u]
            out[:, j] = o.response(m[:, 0] * daily_spend[j] / (1 - o.decay))
    return np.asarray(out)


def curve_error(est: np.ndarray, true: np.ndarray) -> float:
    """Σ |estimated − true| over the points and units, over Σ true (0: the curves are exact)."""
    return float(np.abs(est - true).sum() / max(float(true.sum()), 1e-12))


def check_mmm(
    backend: Backend,
    cfg: AttributionMarketConfig,
    data: MarketData,
    results: dict[str, AttributionResult],
    scored: dict[str, ModelTruth],
    *,
    quick: bool = True,
    budget_moves: bool = True,
    seed: int = 0,
) -> dict[str, ModelTruth]:
    """The media-mix model on the market's daily data (per campaign and outside channel),
    uncalibrated, holdout-calibrated and (with outside channels) calibrated also by a geo test of
    each outside channel (`outside_lift_csv` through the lift-file reader), scored like the
    multi-touch models: TV error of shares per unit, response-curve error, and the true outcome of
    its budget moves re-simulated. The multi-touch models in `scored` gain their per-unit error and
    the error of the curve their budget moves assume (credit a day × (s/s̄)^0.5)."""
    from attribution.mmm import (
        daily_data,
        fit_mmm,
        holdout_split,
        lift_tests,
        parse_lift_csv,
        plan_mmm_budget,
        plan_mmm_split,
        slot_split,
    )

    since, until = period(cfg)
    mdata = daily_data(backend, "campaign", since, until)
    outside = {o.name for o in cfg.outside}
    units = mdata.channels
    truth_units = by_unit(data.true_credit()[0], data.channels, units, outside)
    daily = mdata.spend.mean(axis=0)
    true_c = true_curves(data, units, daily)
    m = np.array(CURVE_POINTS)[:, None]
    for name, result in results.items():
        credit = by_unit(result.conversions, result.channels, units, outside)
        old = scored[name]
        scored[name] = replace(
            old,
            campaign_error=tv_distance(credit, truth_units),
            curve_error=curve_error(credit[None, :] / cfg.days * m**ELASTICITY, true_c),
        )
    fits: dict[str, list[dict[str, Any]] | None] = {"mmm": None}
    held: list[dict[str, Any]] = []
    design = None
    if cfg.holdout_share > 0:
        held = lift_tests(mdata, measure_lift(backend, since, until), "campaign")
        fits["mmm+holdout"] = held
        design = measure_design(backend, since, until)
    if cfg.outside:
        # the holdouts and a geo test of each outside channel, read as a lift file is
        # (`adstream attribution mmm --lift-file`): what calibrates the channels adstream does not serve
        outside_rows, _ = parse_lift_csv(outside_lift_csv(data, seed=seed), units, "simulated lift file")
        fits["mmm+lift"] = held + outside_rows
    out: dict[str, ModelTruth] = {}
    for name, lifts in fits.items():
        fit = fit_mmm(mdata, lifts, quick=quick, seed=seed)
        share = fit.shares()
        est_c = fit.response(m * daily[None, :]).mean(axis=0)
        plan = plan_mmm_budget(fit)
        outcome = None
        if budget_moves:
            outcome = plan_outcome(cfg, data, unit_multipliers(plan.multipliers, outside))
        is_out = np.array([u in outside for u in units], dtype=bool)
        total = max(float(truth_units.sum()), 1e-12)
        shares_ = (
            (float(share[is_out].sum()), float(truth_units[is_out].sum()) / total)
            if outside
            else (None, None)
        )
        retarget = float(sum(s for u, s in zip(units, share, strict=True) if u == RETARGET))
        err = tv_distance(share, truth_units)
        g = plan.gain
        out[name] = ModelTruth(
            name,
            err,
            retarget,
            _shares(truth_units, units),
            _shares(share, units),
            outside_share=shares_[0],
            true_outside_share=shares_[1],
            campaign_error=err,
            curve_error=curve_error(est_c, true_c),
            gain_interval=(g["mean"], g["low"], g["high"]),
            outcome=outcome,
        )
        if not lifts:
            continue
        spend = dict(zip(data.channels, data.spend(), strict=True))
        splits = {}
        if SPLIT_BY in results:
            # the same fit's moves per slot: each campaign split by the calibrated multi-touch
            # model of the lowest credit error on every market so far (`plan_mmm_split`)
            splits[f"{name}+slots"] = slot_split(results[SPLIT_BY], spend)
        if design is not None:
            # or by the holdouts' own per-slot lifts, shrunk toward the spend split (`holdout_split`)
            splits[f"{name}+slot_lifts"] = holdout_split(design, spend)
        for plan_name, split in splits.items():
            sp = plan_mmm_split(fit, split)
            g = sp.gain
            out[plan_name] = replace(
                out[name],
                model=plan_name,
                gain_interval=(g["mean"], g["low"], g["high"]),
                outcome=plan_outcome(cfg, data, sp.multipliers) if budget_moves else None,
            )
    return out


SPLIT_BY = "shapley+holdout"
