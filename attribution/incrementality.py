"""Incrementality from randomised holdouts: lift per campaign, and credits calibrated to it.

Serving holds out a stable random share of users per campaign (`schemas.holdout.is_holdout`)
and records a holdout impression for them (ad_id `HOLDOUT_AD_ID`, price 0). For each campaign,
users with a served impression are *exposed*, users with only holdout impressions are
*holdout*; each user's conversions (of the campaign's advertiser) in a window after their first
impression of the campaign are counted (a window keeps far-off organic conversions, pure noise
for the comparison, out). The lift is the difference of conversion rates; incremental
conversions are that difference times the exposed users (with a normal-approximation
standard error from the two Poisson rates).

`calibrate(result, lifts)` replaces each measured campaign's credited conversions by its
incremental conversions (never below 0), spreads that over the campaign's channels in the
model's proportions, and rescales all channels so the credits again sum to the conversions
(efficiency), leaving the shares as the experiment says. Only granularities that name the
campaign (campaign, slot_campaign) can be calibrated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attribution.models.result import AttributionResult
from attribution.paths import AttributionInputError
from attribution.sql import Backend
from schemas.holdout import HOLDOUT_AD_ID

LIFT_SQL = """
SELECT campaign_id, exposed, count() AS users,
       -- 18.16 drops a column a lambda only captures: first_ts travels as an array argument
       sum(length(arrayFilter((t, f) -> t >= f AND t - f <= %(window)s,
                              c_ts, arrayResize([first_ts], length(c_ts), first_ts)))) AS conversions,
       sum(arraySum(arrayFilter((v, t, f) -> t >= f AND t - f <= %(window)s,
                                c_val, c_ts, arrayResize([first_ts], length(c_ts), first_ts)))) AS value
FROM (
    SELECT campaign_id, user_id, advertiser_id, max(ad_id != %(holdout)s) AS exposed,
           min(toUInt32(ts)) AS first_ts
    FROM impressions FINAL
    WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
    GROUP BY campaign_id, user_id, advertiser_id
) AS e ANY LEFT JOIN (
    SELECT user_id, advertiser_id, groupArray(toUInt32(ts)) AS c_ts, groupArray(value) AS c_val
    FROM conversions FINAL
    WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
    GROUP BY user_id, advertiser_id
) AS c USING user_id, advertiser_id
GROUP BY campaign_id, exposed
ORDER BY campaign_id, exposed
"""


@dataclass(frozen=True)
class Lift:
    """A campaign's holdout experiment: rates, lift and incremental conversions."""

    campaign_id: str
    exposed_users: int
    holdout_users: int
    exposed_rate: float
    holdout_rate: float
    incremental_conversions: float
    se: float

    @property
    def relative_lift(self) -> float:
        return self.exposed_rate / self.holdout_rate - 1.0 if self.holdout_rate > 0 else float("nan")


def measure_lift(backend: Backend, since: int, until: int, window_s: int = 7 * 86400) -> dict[str, Lift]:
    """Lift of every campaign with both exposed and holdout users in [since, until), counting each
    user's conversions in the `window_s` after their first impression (served or held out)."""
    params = {"since": since, "until": until, "holdout": HOLDOUT_AD_ID, "window": window_s}
    rows = backend.execute(LIFT_SQL, params)
    groups: dict[str, dict[int, tuple[int, float]]] = {}
    for campaign, exposed, users, conv, _value in rows:
        groups.setdefault(str(campaign), {})[int(exposed)] = (int(users), float(conv))
    return {c: lift for c, g in groups.items() if (lift := _lift(c, g)) is not None}


def _lift(campaign: str, g: dict[int, tuple[int, float]]) -> Lift | None:
    if 0 not in g or 1 not in g or g[0][0] == 0 or g[1][0] == 0:
        return None
    (nh, ch), (ne, ce) = g[0], g[1]
    re, rh = ce / ne, ch / nh
    se = ne * float(np.sqrt(ce / ne**2 + ch / nh**2))
    return Lift(campaign, ne, nh, re, rh, (re - rh) * ne, se)


def campaign_of(channel: str, by: str) -> str:
    """The campaign a channel belongs to (`campaign` or `campaign:slot`)."""
    if by == "campaign":
        return channel
    if by == "slot_campaign":
        return channel.rsplit(":", 1)[0]
    raise AttributionInputError(f"calibration needs channels that name the campaign; --by {by!r} does not")


def calibrate(result: AttributionResult, lifts: dict[str, Lift], by: str) -> AttributionResult:
    """The model's credits with measured campaigns set to their incremental conversions."""
    campaigns = np.array([campaign_of(c, by) for c in result.channels])
    conv = result.conversions.astype(float).copy()
    factors: dict[str, float] = {}
    for campaign, lift in lifts.items():
        mask = campaigns == campaign
        credited = float(conv[mask].sum())
        if not mask.any() or credited <= 0:
            continue
        factors[campaign] = max(lift.incremental_conversions, 0.0) / credited
        conv[mask] *= factors[campaign]
    total, new_total = float(result.conversions.sum()), float(conv.sum())
    scale = total / new_total if new_total > 0 else 0.0
    share = conv * scale / total if total > 0 else conv
    value = share * float(result.value.sum())
    meta = {**result.meta, "calibrated": {k: round(v, 6) for k, v in factors.items()}}
    return AttributionResult(f"{result.model}+holdout", result.channels, conv * scale, value, meta=meta)
