"""The market's ground truth as pure functions: click, dwell and conversion models, and AUC."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from schemas.stats import auc as auc  # the one AUC (re-exported: workloads.truth.auc)

BOUNCE_MS = 2000  # a dwell below this is a quick bounce (docs/DESIGN.md: a contradicting signal)


def sigmoid(x: float) -> float:
    """The logistic function, overflow-safe.

    >>> sigmoid(0.0)
    0.5
    """
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def click_logit(
    interest: float,
    *,
    interest_scale: float,
    ad_quality: float,
    advertiser_effect: float,
    slot_effect: float,
    position_bias: float,
    bias: float,
) -> float:
    """The true click logit: user×category interest plus ad, advertiser, slot and position terms."""
    return interest_scale * interest + ad_quality + advertiser_effect + slot_effect + position_bias + bias


def match_score(interest: float) -> float:
    """How well an ad fits the user, in (0, 1); drives dwell length and bounce probability."""
    return sigmoid(interest - 1.0)


def bounce_probability(match: float, bounce_prob_max: float) -> float:
    """Chance that a click ends in a quick bounce (< 2 s): high for poor matches."""
    return bounce_prob_max * (1.0 - 0.95 * match)


def sample_dwell_ms(
    rng: np.random.Generator, match: float, *, median_ms: float, sigma: float, bounce_prob_max: float
) -> int:
    """Dwell after a click: a bounce under 2 s, or lognormal with a median growing with the match."""
    if rng.random() < bounce_probability(match, bounce_prob_max):
        return int(rng.integers(200, BOUNCE_MS))
    median = median_ms * (0.5 + match)
    value = median * math.exp(sigma * float(rng.standard_normal()))
    return int(min(max(value, BOUNCE_MS), 3_600_000))


def expected_caused_conversions(touches: Mapping[str, int], lift: Mapping[str, float]) -> dict[str, float]:
    """Expected conversions each channel causes: its lift per touch times its number of touches.

    The conversion hazard is additive (base + Σ lift over touches), so each touch contributes
    its channel's lift independently and the credit of a channel is known in closed form.
    """
    return {c: lift[c] * touches.get(c, 0) for c in lift}


def channel_credit(touches: Mapping[str, int], lift: Mapping[str, float]) -> dict[str, float]:
    """Each channel's share of the incremental (touch-caused) conversions; shares sum to 1.

    >>> channel_credit({"feed": 100, "search": 50}, {"feed": 0.01, "search": 0.02})
    {'feed': 0.5, 'search': 0.5}
    """
    caused = expected_caused_conversions(touches, lift)
    total = sum(caused.values())
    if total <= 0:
        return {c: 0.0 for c in caused}
    return {c: v / total for c, v in caused.items()}
