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

from attribution.incrementality import calibrate, measure_lift
from attribution.models import AttributionResult, ModelConfig, attribute, tv_distance
from attribution.paths import Window, build_paths
from attribution.roi import plan_budget
from attribution.sql import Backend
from workloads.attribution_market import (
    AttributionMarketConfig,
    MarketData,
    period,
    simulate,
    write_raw,
)

RETARGET = "cmp_retarget"


@dataclass(frozen=True)
class ModelTruth:
    """One model's error against the truth and the true outcome of its budget moves."""

    model: str
    error: float  # TV distance of credit shares
    retarget_share: float
    true_share: dict[str, float]
    model_share: dict[str, float]
    plan_true_conversions_delta: float | None = None
    plan_true_value_delta: float | None = None
    outside_share: float | None = None  # the model's share of the outside channels (None: none)
    true_outside_share: float | None = None
    campaign_error: float | None = None  # TV distance of shares per campaign (own) and outside channel
    curve_error: float | None = None  # response curves against the true ones (`curve_error`)
    gain_interval: tuple[float, float, float] | None = None  # a media-mix model's expected gain a day

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
        if self.plan_true_conversions_delta is not None:
            out["budget_moves_true_conversions_delta"] = round(self.plan_true_conversions_delta, 2)
            out["budget_moves_true_value_delta"] = round(float(self.plan_true_value_delta or 0.0), 2)
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
    adds the media-mix model (`mmm`, and `mmm+holdout` with holdouts) and scores every model per
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
        for m in list(results):
            cal = calibrate(results[m], lifts, "slot_campaign")
            results[cal.model] = cal
    spend = dict(zip(data.channels, data.spend(), strict=True))
    outside_names = {o.name for o in cfg.outside}
    base_conv, base_value = data.true_credit()
    out: dict[str, ModelTruth] = {}
    for name, result in results.items():
        delta_c = delta_v = None
        if budget_moves:
            plan = plan_budget(result, spend)
            mult = {c.channel: c.recommended_spend / c.spend for c in plan.channels if c.spend > 0}
            moved = simulate(replace(cfg, spend_multiplier=mult))
            conv, value = moved.true_credit()
            delta_c, delta_v = float(conv.sum() - base_conv.sum()), float(value.sum() - base_value.sum())
        outside = np.array([c in outside_names for c in paths.channels], dtype=bool)
        shares = (
            (float(result.share[outside].sum()), float(truth[outside].sum() / max(truth.sum(), 1e-12)))
            if outside_names
            else (None, None)
        )
        out[name] = ModelTruth(
            name, tv_distance(result.conversions, truth), _retarget(result),
            _shares(truth, paths.channels), _shares(result.conversions, paths.channels), delta_c, delta_v,
            *shares,
        )  # fmt: skip
    if mmm:
        out.update(
            check_mmm(backend, cfg, data, results, out, quick=mmm == "quick", budget_moves=budget_moves)
        )
    return out, data


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
    uncalibrated and holdout-calibrated, scored like the multi-touch models: TV error of shares
    per unit, response-curve error, and the true outcome of its budget moves re-simulated. The
    multi-touch models in `scored` gain their per-unit error and the error of the curve their
    budget moves assume (credit a day × (s/s̄)^0.5)."""
    from attribution.mmm import daily_data, fit_mmm, lift_tests, plan_mmm_budget
    from workloads.attribution_market import SLOTS

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
    fits = {"mmm": None}
    if cfg.holdout_share > 0:
        fits["mmm+holdout"] = lift_tests(mdata, measure_lift(backend, since, until), "campaign")  # type: ignore[assignment]
    base_conv, base_value = data.true_credit()
    out: dict[str, ModelTruth] = {}
    for name, lifts in fits.items():
        fit = fit_mmm(mdata, lifts, quick=quick, seed=seed)
        share = fit.shares()
        est_c = fit.response(m * daily[None, :]).mean(axis=0)
        plan = plan_mmm_budget(fit)
        delta_c = delta_v = None
        if budget_moves:
            mult: dict[str, float] = {}
            for u, f in plan.multipliers.items():
                for c in [u] if u in outside else [f"{u}:{slot}" for slot in SLOTS]:
                    mult[c] = f
            conv, value = simulate(replace(cfg, spend_multiplier=mult)).true_credit()
            delta_c, delta_v = float(conv.sum() - base_conv.sum()), float(value.sum() - base_value.sum())
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
            delta_c,
            delta_v,
            outside_share=shares_[0],
            true_outside_share=shares_[1],
            campaign_error=err,
            curve_error=curve_error(est_c, true_c),
            gain_interval=(g["mean"], g["low"], g["high"]),
        )
    return out
