"""Settings of multi-touch attribution: lookbacks, models and the lift holdout."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.settings.base import Group


class AttributionSettings(Group):
    """Multi-touch attribution: lookbacks, models and lift holdout."""

    click_lookback_s: int = Field(
        7 * 86400, gt=0, description="A click counts toward a conversion this many seconds after it"
    )
    view_lookback_s: int = Field(
        86400, gt=0, description="An impression (view) counts toward a conversion this long after it"
    )
    lookback_by_advertiser: dict[str, tuple[int, int]] = Field(
        default_factory=dict,
        description='Per-advertiser (click_s, view_s) lookbacks, JSON: {"adv001": [604800, 3600]}',
    )
    journey_gap_s: int = Field(
        7 * 86400, gt=0, description="A journey without conversion is closed (a null path) after this gap"
    )
    bootstrap: int = Field(100, ge=0, description="Bootstrap replicates for CIs (0: none)")
    seed: int = Field(0, ge=0, description="Seed of bootstraps, data splits and sampling")
    markov_order: int = Field(
        0, ge=0, le=3, description="Markov order 1-3 (0: chosen by held-out likelihood)"
    )
    markov_removal: Literal["redistribute", "null"] = Field(
        "redistribute",
        description="Markov removal effect: 'redistribute' (a removed channel is never entered; its "
        "state's other transitions renormalised) or 'null' (its journeys end in NULL, the textbook rule)",
    )
    shapley_exact_max: int = Field(
        12, ge=1, le=20, description="Shapley is exact for journeys with at most this many channels"
    )
    shapley_permutations: int = Field(
        200, ge=2, description="Sampled permutations per journey above shapley_exact_max"
    )
    time_decay_half_life_s: float = Field(
        7 * 86400.0, gt=0, description="Time-decay model: a touch's weight halves per this age"
    )
    view_weight: float = Field(0.5, ge=0, description="Time-decay model: weight of a view")
    click_weight: float = Field(1.0, ge=0, description="Time-decay model: weight of a click")
    holdout_share: float = Field(
        0.0, ge=0, lt=1, description="Share of users per campaign held out (shown no ad) for lift"
    )
    holdout_salt: str = Field("adstream-holdout", description="Salt of the stable holdout assignment")
