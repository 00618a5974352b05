"""Attribution models behind one call: `attribute(name, paths, config)` → `AttributionResult`.

Models: first_click, last_click, last_non_view, linear, position_based, time_decay,
simplified_shapley (linear over distinct channels), markov (order 1–3, removal effect,
analytic), shapley (per journey, exact up to a cap, sampled above). Every model's credits sum
to the converting paths' conversions and value (an empty path's, a conversion no touchpoint
preceded, are reported in `meta["unattributed_conversions"]`, never credited); with
`bootstrap > 0` the journeys are resampled (Poisson bootstrap of each distinct path's counts,
seeded) and the 2.5/97.5 % percentiles of each channel's credit are the CI.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import numpy as np

from attribution.models import heuristics as h
from attribution.models.markov import REMOVALS, _choose, chain, markov
from attribution.models.result import AttributionResult, ChannelCredit, tv_distance
from attribution.models.shapley import shapley
from attribution.paths import AttributionInputError, Paths
from schemas.settings import Settings

__all__ = ["MODELS", "AttributionResult", "ChannelCredit", "ModelConfig", "attribute", "tv_distance"]


@dataclass(frozen=True)
class ModelConfig:
    """The models' knobs (from settings by default)."""

    seed: int = 0
    bootstrap: int = 0
    half_life_s: float = 7 * 86400.0
    view_weight: float = 0.5
    click_weight: float = 1.0
    markov_order: int = 0  # 0: choose 1–3 on held-out likelihood
    markov_removal: str = "redistribute"  # or "null" (see attribution.models.markov)
    shapley_exact_max: int = 12
    shapley_permutations: int = 200
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, s: Settings, **overrides: Any) -> ModelConfig:
        base = cls(
            seed=s.attribution.seed,
            bootstrap=s.attribution.bootstrap,
            half_life_s=s.attribution.time_decay_half_life_s,
            view_weight=s.attribution.view_weight,
            click_weight=s.attribution.click_weight,
            markov_order=s.attribution.markov_order,
            markov_removal=s.attribution.markov_removal,
            shapley_exact_max=s.attribution.shapley_exact_max,
            shapley_permutations=s.attribution.shapley_permutations,
        )
        return replace(base, **overrides)


Credits = tuple[np.ndarray, np.ndarray, dict[str, Any]]


def _weights(fn: Callable[[Paths], np.ndarray]) -> Callable[[Paths, ModelConfig], Credits]:
    def run(paths: Paths, cfg: ModelConfig) -> Credits:
        conv, value = h.credit_from_weights(paths, fn(paths))
        return conv, value, {}

    return run


def _time_decay(paths: Paths, cfg: ModelConfig) -> Credits:
    w = h.time_decay(paths, cfg.half_life_s, cfg.view_weight, cfg.click_weight)
    conv, value = h.credit_from_weights(paths, w)
    return conv, value, {"half_life_s": cfg.half_life_s}


def _markov(paths: Paths, cfg: ModelConfig) -> Credits:
    order = cfg.markov_order
    meta: dict[str, Any] = {}
    structure = cfg.extra.get("markov_chain")  # the same paths' chain (bootstrap replicates)
    if order == 0:
        order, scores, structure = _choose(paths, cfg.seed, (1, 2, 3))
        meta["heldout_loglik"] = {str(k): v for k, v in scores.items()}
    elif structure is None:
        structure = chain(paths, order)
    if cfg.markov_removal not in REMOVALS:
        raise AttributionInputError(
            f"markov removal {cfg.markov_removal!r} is not one of {', '.join(REMOVALS)}"
        )
    conv, value, extra = markov(paths, order, structure, cfg.markov_removal)  # type: ignore[arg-type]
    return conv, value, {**meta, **extra, "order": order, "removal": cfg.markov_removal, "_chain": structure}


def _shapley(paths: Paths, cfg: ModelConfig) -> Credits:
    return shapley(paths, cfg.shapley_exact_max, cfg.shapley_permutations, cfg.seed)


class ModelName(StrEnum):
    """The attribution models by name (`adstream attribution --model`), in `MODELS`' order."""

    first_click = "first_click"
    last_click = "last_click"
    last_non_view = "last_non_view"
    linear = "linear"
    position_based = "position_based"
    time_decay = "time_decay"
    simplified_shapley = "simplified_shapley"
    markov = "markov"
    shapley = "shapley"


MODELS: dict[str, Callable[[Paths, ModelConfig], Credits]] = {
    "first_click": _weights(h.first_click),
    "last_click": _weights(h.last_click),
    "last_non_view": _weights(h.last_non_view),
    "linear": _weights(h.linear),
    "position_based": _weights(h.position_based),
    "time_decay": _time_decay,
    "simplified_shapley": _weights(h.distinct_linear),
    "markov": _markov,
    "shapley": _shapley,
}


def check_model(name: str) -> None:
    if name not in MODELS:
        raise AttributionInputError(f"unknown model {name!r} (choose from {', '.join(MODELS)})")


def attribute(name: str, paths: Paths, cfg: ModelConfig | None = None) -> AttributionResult:
    """Run model `name` on `paths` (converting and null), with bootstrap CIs if configured."""
    check_model(name)
    cfg = cfg or ModelConfig()
    # an empty path is a conversion (or journey) no touchpoint preceded: reported, never credited
    empty = paths.lengths == 0
    unattributed = {
        "unattributed_conversions": float(paths.conversions[empty].sum()),
        "unattributed_value": float(paths.value[empty].sum()),
    }
    paths = paths.touched()
    if paths.n == 0 or paths.conversions.sum() <= 0:
        why = (
            f" ({unattributed['unattributed_conversions']:g} conversions had no touchpoint)"
            if unattributed["unattributed_conversions"] > 0
            else ""
        )
        raise AttributionInputError(f"no conversion paths in the selected range{why}: nothing to attribute")
    run = MODELS[name]
    conv, value, meta = run(paths, cfg)
    lo = hi = vlo = vhi = np.full(len(paths.channels), np.nan)
    if cfg.bootstrap > 0:
        rng = np.random.default_rng([cfg.seed, 3])
        reps_c, reps_v = [], []
        # the order is chosen once; replicates reuse the chain's structure (same paths)
        fixed = replace(
            cfg,
            markov_order=meta.get("order", cfg.markov_order),
            extra={**cfg.extra, "markov_chain": meta.get("_chain")},
        )
        for _ in range(cfg.bootstrap):
            c2 = rng.poisson(paths.conversions).astype(float)
            n2 = rng.poisson(paths.nulls).astype(float)
            v2 = np.divide(
                paths.value * c2, paths.conversions, out=np.zeros(paths.n), where=paths.conversions > 0
            )
            if c2.sum() <= 0:
                continue
            bc, bv, _ = run(paths.with_counts(c2, v2, n2), fixed)
            reps_c.append(bc)
            reps_v.append(bv)
        if reps_c:
            lo, hi = np.percentile(np.array(reps_c), [2.5, 97.5], axis=0)
            vlo, vhi = np.percentile(np.array(reps_v), [2.5, 97.5], axis=0)
        meta = {**meta, "bootstrap": len(reps_c)}
    meta = {**{k: v for k, v in meta.items() if not k.startswith("_")}, **unattributed}
    return AttributionResult(name, paths.channels, conv, value, lo, hi, vlo, vhi, meta)
