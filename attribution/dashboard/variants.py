"""The creative variants panel: per ad, each variant's share of the ad's impressions and its CTR
with a 95 % Wilson interval (impressions that name a variant: `Impression.variant_id`, stored by
migration 007). The same statement feeds the Grafana table (deploy/grafana: `$__timeFilter`)."""

from __future__ import annotations

from collections import defaultdict

from attribution.dashboard import queries as q
from attribution.dashboard.figures import Panel, base_layout, empty, panel, span
from attribution.sql import Backend

Z = 1.959964  # the normal quantile of a two-sided 95 % interval
_RANGE = q.RANGE

# Wilson's score interval of a proportion (ctr = clicks / impressions over n = impressions):
#   (ctr + z²/2n ± z·√(ctr(1 − ctr)/n + z²/4n²)) / (1 + z²/n)
# It stays inside [0, 1] and keeps a width at 0 or n clicks, where the normal interval collapses.
_WILSON = f"""(ctr + {Z * Z / 2:.6f} / impressions {{sign}} {Z} * sqrt(greatest(0.,
           ctr * (1 - ctr) / impressions + {Z * Z / 4:.6f} / (impressions * impressions))))
           / (1 + {Z * Z:.6f} / impressions)"""

# Each served impression with a variant, its click (at most one: a re-delivered click is one row
# after FINAL, ANY takes one per impression), per ad and variant; the ads with the most such
# impressions first. `%(top)s` ads at most (the others find no total: 0, filtered out; an ANY
# INNER JOIN would do it, but current releases keep one left row per key there, 18.16 all of them).
VARIANT_CTR_SQL = f"""
SELECT ad_id, variant, impressions, clicks, impressions / ad_impressions AS share,
       clicks / impressions AS ctr,
       {_WILSON.format(sign="-")} AS ctr_low,
       {_WILSON.format(sign="+")} AS ctr_high
FROM (
    SELECT ad_id, variant, count() AS impressions, sum(clicked) AS clicks
    FROM (
        SELECT event_id AS imp, ad_id, assumeNotNull(variant_id) AS variant FROM impressions FINAL
        WHERE {_RANGE} AND isNotNull(variant_id)
    ) AS i
    ANY LEFT JOIN (
        SELECT impression_id AS imp, toUInt8(1) AS clicked FROM clicks FINAL
        WHERE ts >= toDateTime(%(since)s) GROUP BY impression_id
    ) AS c USING imp
    GROUP BY ad_id, variant
) AS v
ANY LEFT JOIN (
    SELECT ad_id, count() AS ad_impressions FROM impressions FINAL
    WHERE {_RANGE} AND isNotNull(variant_id)
    GROUP BY ad_id ORDER BY ad_impressions DESC, ad_id LIMIT %(top)s
) AS a USING ad_id
WHERE ad_impressions > 0
ORDER BY ad_impressions DESC, ad_id, variant
"""

SHARE_COLOUR = "#7f7f7f"


def variant_ctr(backend: Backend, window: q.Window) -> Panel:
    """Per ad (the `top` by impressions with a variant): each variant's CTR (bars, with the Wilson
    95 % interval) and its share of the ad's impressions (markers, right axis); counts in the hover."""
    rows = backend.execute(VARIANT_CTR_SQL, window.params)
    if not rows:
        return empty(
            "variants",
            "Creative variants per ad",
            f"no impressions that name a creative variant {span(window)} (ads without variants, or "
            "serving with variants.enabled off)",
        )
    ads: dict[str, list[tuple[str, int, int, float, float, float, float]]] = defaultdict(list)
    for ad, variant, imps, clicks, share, ctr, low, high in rows:
        values = (float(share), float(ctr), float(low), float(high))
        ads[str(ad)].append((str(variant), int(imps), int(clicks), *values))
    x: list[list[str]] = [[], []]  # Plotly's multicategory axis: ad, then variant
    ctr_pct, plus, minus, share_pct, custom = [], [], [], [], []
    for ad, variants in ads.items():
        for variant, imps, clicks, share, ctr, low, high in variants:
            x[0].append(ad)
            x[1].append(variant)
            ctr_pct.append(100.0 * ctr)
            plus.append(100.0 * (high - ctr))
            minus.append(100.0 * (ctr - low))
            share_pct.append(100.0 * share)
            custom.append([imps, clicks, 100.0 * low, 100.0 * high, 100.0 * share])
    hover = (
        "%{x}<br>CTR %{customdata[2]:.2f}% … %{customdata[3]:.2f}% (95 %), point %{y:.2f}%<br>"
        "%{customdata[1]} clicks / %{customdata[0]} impressions, %{customdata[4]:.1f}% of the ad's"
    )
    data = [
        {
            "type": "bar",
            "name": "CTR (95 % Wilson interval)",
            "x": x,
            "y": ctr_pct,
            "error_y": {
                "type": "data",
                "symmetric": False,
                "array": plus,
                "arrayminus": minus,
                "visible": True,
            },
            "customdata": custom,
            "hovertemplate": hover + "<extra></extra>",
        },
        {
            "type": "scatter",
            "mode": "markers",
            "name": "share of the ad's impressions",
            "x": x,
            "y": share_pct,
            "yaxis": "y2",
            "marker": {"color": SHARE_COLOUR, "symbol": "diamond", "size": 9},
            "hovertemplate": "%{x}<br>share %{y:.1f}%<extra></extra>",
        },
    ]
    layout = base_layout(
        f"Creative variants per ad (top {window.top} by impressions): CTR with 95 % Wilson intervals, "
        "and each variant's share of its ad's impressions",
        yaxis={"title": {"text": "CTR (%)"}, "rangemode": "tozero"},
        yaxis2={"title": {"text": "share (%)"}, "overlaying": "y", "side": "right", "range": [0, 100]},
        xaxis={"type": "multicategory"},
    )
    return panel("variants", "Creative variants per ad", {"data": data, "layout": layout})
