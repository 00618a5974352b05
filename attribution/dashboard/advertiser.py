"""The advertiser's view of the page (`?view=advertiser`): their campaigns only, from the rollups.

Every panel reads `rollup_hourly` (002; refreshed by `adstream attribution rollup` and by every
stored attribution run), never a raw event table with `FINAL`, so the view costs the same
whatever the traffic; budgets come from the catalog's latest state of each ad (`ads`, argMax,
duplicates harmless). The advertiser and campaign filters (`?advertiser=a,b&campaign=c`, empty:
all) are bound parameters. Every rate shows the counts it is made of, money is labelled with the
page's currency (`?currency=EUR`, ISO 4217: the platform keeps one currency, it does not convert),
and the pacing panel flags each day × campaign whose spend ran ahead of its plan (the daily
budget, pro rata for a day the window cuts).

Rules of `queries` hold: 18.16 and current SQL, values only as parameters, hours bucketed with
`intDiv`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from attribution.dashboard import queries as q
from attribution.dashboard.figures import Panel, base_layout, empty, panel, span, stamp
from attribution.rollups import SHOWN
from attribution.sql import Backend

# The rollup's rows of the window, of the chosen advertisers and campaigns. An empty filter is
# "all": the flag says so (an empty array literal has no type 18.16 can compare with a String).
ROLLUP_FILTER = f"""
{q.ROLLUP_RANGE}
AND (%(all_advertisers)s = 1 OR has(%(advertisers)s, advertiser_id))
AND (%(all_campaigns)s = 1 OR has(%(campaigns)s, campaign_id))
AND campaign_id != ''
"""

# What the filters can choose from (the page's lists): every advertiser and campaign rolled up.
FILTER_CHOICES = """
SELECT advertiser_id, campaign_id FROM rollup_hourly FINAL
WHERE advertiser_id != '' AND campaign_id != ''
GROUP BY advertiser_id, campaign_id ORDER BY advertiser_id, campaign_id
"""

ADV_SPEND = f"""
SELECT toUInt32(hour) AS t, campaign_id, sum(spend) AS spend
FROM rollup_hourly FINAL WHERE {ROLLUP_FILTER}
GROUP BY t, campaign_id ORDER BY t, campaign_id
"""

# Per campaign: served impressions, shown impressions (CTR's denominator; hours rolled up before
# migration 010 count what was served), clicks, spend, conversions (as the conversions name their
# campaign), value: the counts every rate of the view is made of.
ADV_TOTALS = f"""
SELECT campaign_id, sum(impressions) AS n_impressions, sum(n_shown1) AS n_shown, sum(clicks) AS n_clicks,
       sum(spend) AS total_spend, sum(conversions) AS n_conversions, sum(value) AS total_value
FROM (
    SELECT campaign_id, impressions, {SHOWN} AS n_shown1, clicks, spend, conversions, value
    FROM rollup_hourly FINAL WHERE {ROLLUP_FILTER}
)
GROUP BY campaign_id ORDER BY total_spend DESC, campaign_id LIMIT %(top)s
"""

ADV_DAILY_SPEND = f"""
SELECT intDiv(toUInt32(hour), 86400) * 86400 AS day, campaign_id, sum(spend) AS day_spend
FROM rollup_hourly FINAL WHERE {ROLLUP_FILTER}
GROUP BY day, campaign_id ORDER BY day, campaign_id
"""

# Each campaign's daily budget: the sum over its ads live at the window's end (latest state).
ADV_BUDGETS = """
SELECT cmp, sum(budget) AS daily_budget FROM (
    SELECT ad_id, argMax(campaign_id, ts) AS cmp, argMax(daily_budget, ts) AS budget,
           argMax(active, ts) AS live
    FROM ads WHERE ts < toDateTime(%(until)s) GROUP BY ad_id
) WHERE live = 1 GROUP BY cmp ORDER BY cmp
"""

QUERIES = {
    "filter_choices": FILTER_CHOICES,
    "adv_spend": ADV_SPEND,
    "adv_totals": ADV_TOTALS,
    "adv_daily_spend": ADV_DAILY_SPEND,
    "adv_budgets": ADV_BUDGETS,
}


def params(window: q.Window) -> dict[str, Any]:
    """The window's parameters with the filters bound (a placeholder list when one is empty)."""
    return {
        **window.params,
        "all_advertisers": int(not window.view.advertisers),
        "advertisers": list(window.view.advertisers) or [""],
        "all_campaigns": int(not window.view.campaigns),
        "campaigns": list(window.view.campaigns) or [""],
    }


def filter_choices(backend: Backend) -> dict[str, list[str]]:
    """advertiser → its campaigns, from the rollups."""
    out: dict[str, list[str]] = defaultdict(list)
    for advertiser, campaign in backend.execute(FILTER_CHOICES):
        out[str(advertiser)].append(str(campaign))
    return dict(out)


def _who(window: q.Window) -> str:
    parts = []
    if window.view.advertisers:
        parts.append("advertiser " + ", ".join(window.view.advertisers))
    if window.view.campaigns:
        parts.append("campaign " + ", ".join(window.view.campaigns))
    return " · ".join(parts) or "all advertisers"


def _none(pid: str, title: str, window: q.Window) -> Panel:
    return empty(
        pid, title, f"no rolled-up traffic for {_who(window)} {span(window)} "
        "(the rollups are refreshed by `adstream attribution rollup` and by every stored run)",
    )  # fmt: skip


def spend_per_campaign(backend: Backend, window: q.Window) -> Panel:
    """Hourly spend per campaign (stacked), in the page's currency."""
    title = f"Spend per campaign ({window.view.currency}, hourly)"
    rows = backend.execute(ADV_SPEND, params(window))
    if not rows:
        return _none("adv_spend", title, window)
    series: dict[str, dict[int, float]] = defaultdict(dict)
    for t, campaign, spend in rows:
        series[str(campaign)][int(t)] = float(spend)
    hours = sorted({int(r[0]) for r in rows})
    data = [
        {"type": "bar", "name": c, "x": [stamp(h) for h in hours], "y": [s.get(h, 0.0) for h in hours],
         "hovertemplate": "%{x} · " + c + ": %{y:,.2f} " + window.view.currency + "<extra></extra>"}
        for c, s in sorted(series.items())
    ]  # fmt: skip
    layout = base_layout(
        f"{title} · {_who(window)}",
        barmode="stack",
        xaxis={"type": "date"},
        yaxis={"title": {"text": f"spend ({window.view.currency})"}, "rangemode": "tozero"},
    )
    return panel("adv_spend", title, {"data": data, "layout": layout})


def campaign_table(backend: Backend, window: q.Window) -> Panel:
    """Per campaign, every rate beside the counts it is made of: CTR (clicks over shown
    impressions; served impressions beside them), CPA and ROAS (spend, conversions, value)."""
    title = f"Campaigns: rates and the counts behind them ({window.view.currency})"
    rows = backend.execute(ADV_TOTALS, params(window))
    if not rows:
        return _none("adv_campaigns", title, window)
    cols: dict[str, list[Any]] = defaultdict(list)
    for campaign, imps, shown, clicks, spend, conv, value in rows:
        imps, shown, clicks, conv = int(imps), int(shown), int(clicks), int(conv)
        spend, value = float(spend), float(value)
        cols["campaign"].append(str(campaign))
        cols["impressions"].append(imps)
        cols["shown"].append(shown)
        cols["clicks"].append(clicks)
        cols["CTR %"].append(round(100.0 * clicks / shown, 3) if shown else None)
        cols[f"spend ({window.view.currency})"].append(round(spend, 2))
        cols["conversions"].append(conv)
        cols[f"value ({window.view.currency})"].append(round(value, 2))
        cols[f"CPA ({window.view.currency})"].append(round(spend / conv, 2) if conv else None)
        cols["ROAS"].append(round(value / spend, 3) if spend > 0 else None)
    data = [
        {
            "type": "table",
            "header": {"values": list(cols), "align": "left"},
            "cells": {
                "values": [["–" if v is None else v for v in c] for c in cols.values()],
                "align": "left",
            },
        }
    ]
    layout = base_layout(f"{title} · {_who(window)}", height=80 + 28 * len(rows))
    return panel("adv_campaigns", title, {"data": data, "layout": layout})


def pacing_alerts(backend: Backend, window: q.Window) -> Panel:
    """Each day × campaign's spend against its plan (the daily budget; pro rata for the part of
    a day inside the window), ahead-of-plan days first: 'spend ahead of plan' where spend > plan."""
    title = f"Pacing alerts: spend ahead of plan ({window.view.currency})"
    p = params(window)
    rows = backend.execute(ADV_DAILY_SPEND, p)
    if not rows:
        return _none("adv_pacing", title, window)
    budgets = {str(c): float(b) for c, b in backend.execute(ADV_BUDGETS, p)}
    table: list[tuple[Any, ...]] = []
    for day, campaign, spend in rows:
        budget = budgets.get(str(campaign), 0.0)
        lo, hi = max(int(day), window.since), min(int(day) + 86400, window.until)
        plan = budget * max(hi - lo, 0) / 86400.0
        pace = float(spend) / plan if plan > 0 else None
        alert = "no budget" if plan <= 0 else ("spend ahead of plan" if float(spend) > plan else "on plan")
        table.append(
            (stamp(int(day))[:10], str(campaign), round(float(spend), 2), round(plan, 2), pace, alert)
        )
    table.sort(key=lambda r: (r[5] != "spend ahead of plan", -(r[4] or 0.0), r[0], r[1]))
    ahead = sum(r[5] == "spend ahead of plan" for r in table)
    names = [
        "day",
        "campaign",
        f"spend ({window.view.currency})",
        f"plan ({window.view.currency})",
        "spend / plan",
        "alert",
    ]
    cells = [
        [("–" if r[i] is None else (round(r[i], 3) if i == 4 else r[i])) for r in table] for i in range(6)
    ]
    data = [
        {
            "type": "table",
            "header": {"values": names, "align": "left"},
            "cells": {"values": cells, "align": "left"},
        }
    ]
    layout = base_layout(
        f"{title}: {ahead} of {len(table)} campaign-days · {_who(window)}",
        height=80 + 28 * min(len(table), 20),
    )
    return panel("adv_pacing", title, {"data": data, "layout": layout})
