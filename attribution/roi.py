"""Spend, ROI and CPA per channel under a model, and a budget reallocation with its expected uplift.

Spend is what the impressions served in the range were billed per own channel (`schemas.billing`:
a CPC impression its price if clicked, a CPM one price / 1000 if shown, one from before billing
its price when served; holdouts cost nothing) and the imported daily spend per outside channel
(`adstream spend import`). The
reallocation keeps the total budget fixed, moves each channel within its bounds (default
±`max_change` of its spend), and assumes diminishing returns: a channel's credited value scales
as (spend'/spend)^elasticity. It maximises the total value (a concave problem: KKT water-filling,
bisection on the multiplier). A move is flagged *low confidence* when the channel's ROAS
interval overlaps the interval of any channel moved the other way (or has no interval).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

from attribution.models.result import AttributionResult
from attribution.paths import AttributionInputError, channel_sql, outside_sql
from attribution.sql import (
    BILLED_COST_SQL,
    SHOWN_AT_SERVE_SQL,
    Backend,
    with_click_and_view,
)
from schemas.holdout import HOLDOUT_AD_ID

# the served impressions of [since, until), the holdout's excluded; `{adv}` a filter of `billed_sql`
_BILLED_IMPRESSIONS = f"""
        SELECT event_id AS imp, ts, slot, campaign_id, bid_type, price,
               {SHOWN_AT_SERVE_SQL} AS shown_at_serve
        FROM impressions FINAL
        WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s) AND ad_id != %(holdout)s {{adv}}"""

# What each served impression of [since, until) was billed (`schemas.billing`, as the rollups'
# spend: CPC its price once clicked, CPM price / 1000 once shown or clicked, no bid type its price
# when served), the holdout's excluded; `{adv}` an extra filter on the impressions (an advertiser). One
# JOIN per SELECT (18.16): clicks, then views. Shared by the ROI table and the media-mix model's
# daily spend (`attribution.mmm`).
BILLED_SQL = f"""
SELECT imp, ts, slot, campaign_id,
       {BILLED_COST_SQL} AS spend
FROM {with_click_and_view("imp, ts, slot, campaign_id, bid_type, price, shown_at_serve", _BILLED_IMPRESSIONS)}
"""


def billed_sql(adv: str = "") -> str:
    """`BILLED_SQL` with its impressions filtered by `adv` (SQL with bound parameters, or "")."""
    return BILLED_SQL.format(adv=adv)


# Own channels: what their impressions were billed (`BILLED_SQL`); outside channels: the imported
# daily spend (`attribution.spend`) of the days that lie in the range (a day counts when it starts
# in it).
SPEND_SQL = """
SELECT channel, sum(spend) AS spend, sum(impressions) AS impressions
FROM (
    SELECT {ch} AS channel, sum(spend) AS spend, count() AS impressions
    FROM ({billed}) AS b
    GROUP BY channel
    UNION ALL
    SELECT {outside} AS channel, sum(spend) AS spend, toUInt64(0) AS impressions
    FROM outside_spend FINAL
    WHERE day >= toDate(%(since_day)s) AND day < toDate(%(until_day)s)
    GROUP BY channel
)
GROUP BY channel
ORDER BY channel
"""


def spend_query(by: str) -> str:
    """Spend and impressions per channel at granularity `by` (params: `spend_params`)."""
    return SPEND_SQL.format(ch=channel_sql(by), outside=outside_sql(by), billed=billed_sql())


def spend_params(since: int, until: int) -> dict[str, Any]:
    """Bound parameters of `spend_query` for [since, until) (days: those starting in it, UTC)."""
    first = datetime.fromtimestamp(since, UTC).date()
    if datetime.fromtimestamp(since, UTC).time() != datetime.min.time():
        first += timedelta(days=1)
    last = datetime.fromtimestamp(until, UTC).date()
    if datetime.fromtimestamp(until, UTC).time() != datetime.min.time():
        last += timedelta(days=1)
    return {
        "since": since, "until": until, "holdout": HOLDOUT_AD_ID,
        "since_day": first.isoformat(), "until_day": last.isoformat(),
    }  # fmt: skip


def channel_spend(backend: Backend, by: str, since: int, until: int) -> dict[str, float]:
    """Spend per channel in [since, until), own and outside."""
    rows = backend.execute(spend_query(by), spend_params(since, until))
    return {str(ch): float(spend) for ch, spend, _ in rows}


@dataclass(frozen=True)
class ChannelRoi:
    """One channel's economics under one model, and its recommended budget."""

    channel: str
    spend: float
    conversions: float
    value: float
    roas: float  # value / spend
    roi: float  # (value − spend) / spend
    cpa: float  # spend / conversions
    recommended_spend: float
    expected_value: float
    low_confidence: bool


@dataclass(frozen=True)
class BudgetPlan:
    """Per-channel ROI and moves; the expected value uplift of the plan at a fixed total budget."""

    model: str
    channels: list[ChannelRoi]
    total_budget: float
    expected_uplift: float

    def to_dict(self) -> dict[str, object]:
        return {
            "model": self.model,
            "total_budget": self.total_budget,
            "expected_uplift": self.expected_uplift,
            "channels": [c.__dict__ for c in self.channels],
        }


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1.0), np.nan)


def optimise(spend: np.ndarray, value: np.ndarray, lo: np.ndarray, hi: np.ndarray, elasticity: float
             ) -> np.ndarray:  # fmt: skip
    """Spend per channel maximising Σ value·(s/spend)^e with Σ s = Σ spend and lo ≤ s ≤ hi."""
    budget = float(spend.sum())
    if budget <= 0:
        return spend.copy()
    e = elasticity
    a = np.where(spend > 0, value / np.where(spend > 0, spend, 1.0) ** e, 0.0)

    def alloc(lam: float) -> np.ndarray:
        with np.errstate(divide="ignore", over="ignore"):
            s = (e * a / lam) ** (1.0 / (1.0 - e))
        return np.clip(np.nan_to_num(s, posinf=hi.max()), lo, hi)

    top = alloc(1e-300)  # every credited channel at its top, the uncredited ones at their floor
    if top.sum() < budget:
        # the credited channels cannot take the whole budget: the rest goes to the uncredited ones
        # in proportion to their headroom (the budget is fixed: moves cancel out), all at their top
        # when even that cannot hold it
        room: np.ndarray = hi - top
        left = budget - float(top.sum())
        if float(room.sum()) <= left:
            return hi.copy()
        filled: np.ndarray = top + room * (left / float(room.sum()))
        return filled
    lo_l, hi_l = 1e-300, 1e300
    for _ in range(400):
        mid = np.sqrt(lo_l * hi_l)
        if alloc(mid).sum() > budget:
            lo_l = mid
        else:
            hi_l = mid
    s = alloc(np.sqrt(lo_l * hi_l))
    return s * (budget / s.sum()) if s.sum() > 0 else s


def plan_budget(
    result: AttributionResult,
    spend_by_channel: dict[str, float],
    *,
    elasticity: float = 0.5,
    max_change: float = 0.5,
    bounds: dict[str, tuple[float, float]] | None = None,
) -> BudgetPlan:
    """ROI, CPA and a reallocation for one model's credits (bounds: channel → (min, max) spend)."""
    if not 0 < elasticity < 1:
        raise AttributionInputError(f"elasticity {elasticity!r} must be in (0, 1)")
    if not 0 <= max_change:
        raise AttributionInputError(f"max change {max_change!r} must be ≥ 0")
    chans = result.channels
    for name in bounds or {}:
        if name not in chans:
            raise AttributionInputError(
                f"unknown channel {name!r} in budget bounds (known: {', '.join(chans)})"
            )
    spend = np.array([spend_by_channel.get(c, 0.0) for c in chans])
    lo = spend * (1 - min(max_change, 1.0))
    hi = spend * (1 + max_change)
    for name, (b_lo, b_hi) in (bounds or {}).items():
        if b_lo > b_hi or b_lo < 0:
            raise AttributionInputError(f"bounds of {name!r}: {b_lo!r}..{b_hi!r} is not a range ≥ 0")
        i = chans.index(name)
        lo[i], hi[i] = b_lo, b_hi
    value = result.value
    new = optimise(spend, value, lo, hi, elasticity)
    ratio = _ratio(new, spend)
    expected = np.where(spend > 0, value * np.nan_to_num(ratio, nan=0.0) ** elasticity, value)
    roas = _ratio(value, spend)
    roas_lo, roas_hi = _ratio(result.value_ci_low, spend), _ratio(result.value_ci_high, spend)
    up, down = new > spend * (1 + 1e-9), new < spend * (1 - 1e-9)
    low_conf = []
    for i in range(len(chans)):
        if not (up[i] or down[i]):
            low_conf.append(False)
            continue
        other = down if up[i] else up
        if not np.isfinite(roas_lo[i]) or not np.isfinite(roas_hi[i]):
            low_conf.append(True)
            continue
        olo, ohi = roas_lo[other], roas_hi[other]
        overlap = bool(np.any(~np.isfinite(olo) | ((olo <= roas_hi[i]) & (ohi >= roas_lo[i]))))
        low_conf.append(overlap)
    rows = [
        ChannelRoi(
            c, float(spend[i]), float(result.conversions[i]), float(value[i]), float(roas[i]),
            float(roas[i] - 1.0), float(_ratio(spend[i : i + 1], result.conversions[i : i + 1])[0]),
            float(new[i]), float(expected[i]), low_conf[i],
        )
        for i, c in enumerate(chans)
    ]  # fmt: skip
    return BudgetPlan(result.model, rows, float(spend.sum()), float(expected.sum() - value.sum()))
