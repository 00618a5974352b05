"""Incrementality from randomised holdouts: lift per campaign, and credits calibrated to it.

Serving holds out a stable random share of users per campaign (`schemas.holdout.is_holdout`)
and records a holdout impression for them (ad_id `HOLDOUT_AD_ID`, price 0). For each campaign,
users with a served impression are *exposed*, users with only holdout impressions are
*holdout*; each user's conversions (of the campaign's advertiser) in a window after their first
impression of the campaign are counted (a window keeps far-off organic conversions, pure noise
for the comparison, out). The lift is the difference of conversion rates; incremental
conversions are that difference times the exposed users (with a normal-approximation
standard error from the two Poisson rates).

`calibrate(result, lifts, by, design)` replaces each measured campaign's credited conversions by
its incremental conversions (never below 0; with the holdouts' `design`, less half of its
measured interactions with other campaigns: their Shapley split, `channel_lift`), spreads that
over the campaign's channels (the model's proportions, pulled toward the per-slot lifts by their
precision; where the model gave the campaign nothing, the exposed impressions'), and rescales all
channels so the credits again sum to the conversions (efficiency), leaving the shares as the
experiment says. Only granularities that name the campaign (campaign, slot_campaign) can be
calibrated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attribution.channel_lift import ChannelLift, HoldoutDesign, shapley_lifts
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


def calibrate(
    result: AttributionResult,
    lifts: dict[str, Lift],
    by: str,
    design: HoldoutDesign | None = None,
) -> AttributionResult:
    """The model's credits with measured campaigns set to their incremental conversions.

    With the holdouts' `design` (`channel_lift.measure_design`), a campaign's incremental
    conversions lose half of its measured interactions with other campaigns (their Shapley
    split, `shapley_lifts`) and its split over channels uses the per-slot lifts; without it, the
    lifts are taken as they are and split as the model splits. Each measured campaign's
    incremental conversions (never below 0) are split over its channels by `split_campaigns`; the
    channels of campaigns without a holdout keep the model's credit; all are then rescaled so
    that the credits again sum to the conversions (efficiency).
    """
    if design is not None:
        lifts = shapley_lifts(lifts, design.interactions)
    channel_lifts = design.channels if design is not None else {}
    campaigns = np.array([campaign_of(c, by) for c in result.channels])
    conv = result.conversions.astype(float).copy()
    measured: dict[str, np.ndarray] = {}
    for campaign in lifts:
        mask = np.flatnonzero(campaigns == campaign)
        if mask.size:
            measured[campaign] = mask
    splits = split_campaigns(result, measured, channel_lifts, by)
    incremental: dict[str, float] = {}
    for campaign, mask in measured.items():
        incremental[campaign] = max(lifts[campaign].incremental_conversions, 0.0)
        conv[mask] = incremental[campaign] * splits[campaign]
    total, new_total = float(result.conversions.sum()), float(conv.sum())
    scale = total / new_total if new_total > 0 else 0.0
    share = conv * scale / total if total > 0 else conv
    value = share * float(result.value.sum())
    meta = {**result.meta, "calibrated": {k: round(v, 6) for k, v in incremental.items()}}
    return AttributionResult(f"{result.model}+holdout", result.channels, conv * scale, value, meta=meta)


def split_campaigns(
    result: AttributionResult,
    measured: dict[str, np.ndarray],
    channel_lifts: dict[str, ChannelLift],
    by: str,
) -> dict[str, np.ndarray]:
    """How each measured campaign's incremental conversions split over its channels (shares).

    The prior is the model's split of the campaign's credit; where the model gave the campaign no
    credit at all (Markov can: a campaign whose removal its chain does not miss), it is the split
    of the exposed users' impressions (one impression, one unit of effect), or an even one.
    Where the holdout measured the campaign per slot (`channel_lift`), each channel's measured
    incremental conversions pull its share toward them by their precision: normal-normal
    shrinkage, the prior's spread τ² estimated from all measured channels at once (method of
    moments: the mean squared gap between measurement and prior, less the measurements' own
    variance). Measurements much noisier than their gap to the prior leave the prior as it is.
    """
    conv = result.conversions.astype(float)
    # an outside channel (`source/medium`) names no slot; it is in no measured campaign anyway
    slot_of = [c.rsplit(":", 1)[-1] if by == "slot_campaign" and ":" in c else "" for c in result.channels]
    prior: dict[str, np.ndarray] = {}
    seen: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for campaign, mask in measured.items():
        lift = channel_lifts.get(campaign)
        at = {s: j for j, s in enumerate(lift.slots)} if lift is not None and by == "slot_campaign" else {}
        slots = [slot_of[i] for i in mask]
        credited = float(conv[mask].sum())
        if credited > 0:
            q = conv[mask] / credited
        elif at and all(s in at for s in slots) and sum(lift.exposed_impressions[at[s]] for s in slots) > 0:  # type: ignore[union-attr]
            dose = np.array([lift.exposed_impressions[at[s]] for s in slots])  # type: ignore[union-attr]
            q = dose / dose.sum()
        else:
            q = np.full(mask.size, 1.0 / mask.size)
        prior[campaign] = q
        if at and all(s in at for s in slots):
            x = np.array([lift.incremental[at[s]] for s in slots])  # type: ignore[union-attr]
            se = np.array([lift.se[at[s]] for s in slots])  # type: ignore[union-attr]
            if np.all(np.isfinite(x)) and np.all(se > 0):
                seen[campaign] = (x, se)
    if not seen:
        return prior
    scale = {c: max(float(channel_lifts[c].incremental.sum()), 0.0) for c in seen}
    gaps = np.concatenate([seen[c][0] - prior[c] * scale[c] for c in seen])
    noise = np.concatenate([seen[c][1] ** 2 for c in seen])
    tau2 = max(0.0, float(np.mean(gaps**2 - noise)))
    if tau2 == 0.0:
        return prior
    out = dict(prior)
    for campaign, (x, se) in seen.items():
        m = prior[campaign] * scale[campaign]
        w = tau2 / (tau2 + se**2)
        post = np.maximum(w * x + (1 - w) * m, 0.0)
        if post.sum() > 0:
            out[campaign] = post / post.sum()
    return out
