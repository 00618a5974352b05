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

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"error": round(self.error, 4), "retarget_share": round(self.retarget_share, 4)}
        if self.outside_share is not None:
            out["outside_share"] = round(self.outside_share, 4)
            out["true_outside_share"] = round(float(self.true_outside_share or 0.0), 4)
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
) -> tuple[dict[str, ModelTruth], MarketData]:
    """Simulate, write, build paths, and score each model (and calibrated ones with holdouts).

    `variants` adds named runs of a model with other knobs, e.g.
    `{"markov_null_removal": ("markov", {"markov_removal": "null"})}`.
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
    return out, data
