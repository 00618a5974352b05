"""Served, shown, clicked, billed: the rule by which an impression costs its campaign, shared by
the streams worker (which bills) and serving (which paces on what was billed).

A `/v1/ads` response's ads are *served*; a served ad becomes a *shown* impression when its render
beacon (`View`) arrives, or at once when its slot renders on the server (`Impression.render ==
"server"`, `serving.shown_on_serve`). A campaign pays (`Impression.bid_type`, from
`Campaign.bid_type`):

- **cpc**: its impression's `price` (the auction's generalized second price *per click*) for the
  first click on it inside the attribution window;
- **cpm**: `price / 1000` for the impression's first showing inside the window: its `price` is
  the auction's generalized second price *per thousand shown impressions* (the CPM an advertiser
  reads). The auction (`serving.rerank`) ranks a CPM ad by bid / 1000 per impression, a CPC ad
  by pCTR × bid, and prices each in its own unit.

A click shows its impression: an ad clicked is an ad seen (its beacon was lost, blocked or is
still on its way), so a CPM impression clicked inside its window before any view pays its
showing at the click, once (a later view adds nothing), and the label join learns it as shown.

An impression without `bid_type` (from before bid types, or a market simulation without CPM
campaigns) costs its `price` when served: it counts as shown when served (no render beacons
then), and its price is what it cost, as the hourly rollups' spend has counted it since they
began, and with them the ROI table, the media-mix model's daily spend, budget plans and every
attribution benchmark on the simulated markets (`attribution.sql.BILLED_COST_SQL`; the A/B
revenue, which counted it once clicked, and this module, which never billed it, follow). Billing
it per click instead would be the CPC reading of its price, but would move every spend figure
of the markets their benchmarks ran on; tests hold the worker and the SQL to this one rule.

Nothing else costs anything: a served ad never shown nor clicked, a second or late beacon, a
beacon of an ad never served (no impression joins it), a second click, a view of a CPC campaign.

The worker adds each cost to the Redis hash `spend:{yyyymmdd}` (campaign_id → spend of that UTC
day) in the same transaction as the offsets of the events that caused it, so every billable
event is billed exactly once; replicas read the hash for pacing and budgets.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime
from typing import Final

from schemas.events import Impression

# a CPM price is per thousand shown impressions
PER_MILLE: Final = 1000.0

# the day's spend hash outlives its day for a day (late readers, reports)
SPEND_TTL_S: Final = 2 * 86_400


_DAY_S: Final = 86_400.0


def day_of(ts: float) -> str:
    """The UTC day (yyyymmdd) of an epoch time: the spend hash a cost of that time goes to.

    The worker bills each shown impression: the day's text is made once a day (`_day`), not per
    cost; a time within a microsecond of midnight takes `datetime`'s own rounding.

    >>> day_of(0.0), day_of(86_399.9), day_of(86_399.9999997), day_of(-0.5)
    ('19700101', '19700101', '19700102', '19691231')
    """
    day = ts // _DAY_S
    if 1e-6 <= ts - day * _DAY_S < _DAY_S - 1e-6:  # NaN and ±inf fail it too
        return _day(int(day))
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y%m%d")


@functools.lru_cache(maxsize=64)
def _day(day: int) -> str:
    return datetime.fromtimestamp(day * _DAY_S, tz=UTC).strftime("%Y%m%d")


def spend_key(prefix: str, day: str) -> str:
    """The Redis hash of a day's billed spend per campaign (`prefix`: `settings.redis_prefix`)."""
    return f"{prefix}spend:{day}"


def counts_as_shown(imp: Impression) -> bool:
    """Whether a served impression is shown without a render beacon: its slot renders on the
    server, or it says nothing of rendering (impressions from before render beacons)."""
    return imp.render != "client"


def cost_when_shown(imp: Impression) -> float:
    """What an impression's first showing costs its campaign (CPM: price / 1000, its price being
    per thousand shown; no bid type: its price, shown when served; CPC: 0).

    >>> from datetime import UTC, datetime
    >>> imp = Impression(event_id="r/0", ts=datetime(2026, 1, 1, tzinfo=UTC), user_id="u",
    ...     request_id="r", ad_id="a", campaign_id="c", advertiser_id="v", slot="feed",
    ...     position=0, price=2.0, pctr=0.05, bid_type="cpm", render="client")
    >>> cost_when_shown(imp), cost_when_clicked(imp)
    (0.002, 0.0)
    """
    if imp.bid_type is None:
        return float(imp.price)
    if imp.bid_type != "cpm":
        return 0.0
    return float(imp.price) / PER_MILLE


def cost_when_clicked(imp: Impression) -> float:
    """What an impression's first click costs its campaign (CPC: its price; else 0: a CPM
    impression's click costs its showing, `cost_when_shown`, when no view showed it first)."""
    return float(imp.price) if imp.bid_type == "cpc" else 0.0
