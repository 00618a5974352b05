"""The creative variants panel: per ad, each variant's share of the ad's served impressions (what
serving's variant bandit chose) and its CTR, clicks over *shown* impressions (`schemas.billing`,
as the rollups and `adstream ab` count it), with a 95 % Wilson interval (impressions that name a
variant: `Impression.variant_id`, stored by migration 007). The same statement feeds the Grafana
table (deploy/grafana: `$__timeFilter`)."""

from __future__ import annotations

from collections import defaultdict

from attribution.dashboard import queries as q
from attribution.dashboard.figures import Panel, base_layout, empty, num, panel, span
from attribution.sql import SHOWN_AT_SERVE_SQL, Backend, with_click_and_view

Z = 1.959964  # the normal quantile of a two-sided 95 % interval
_RANGE = q.RANGE

# Wilson's score interval of a proportion (ctr = clicks / shown over n = shown impressions):
#   (ctr + z²/2n ± z·√(ctr(1 − ctr)/n + z²/4n²)) / (1 + z²/n)
# It stays inside [0, 1] and keeps a width at 0 or n clicks, where the normal interval collapses.
# A variant with nothing shown has no CTR (nan).
_WILSON = f"""if(shown > 0, (ctr + {Z * Z / 2:.6f} / shown {{sign}} {Z} * sqrt(greatest(0.,
           ctr * (1 - ctr) / shown + {Z * Z / 4:.6f} / (shown * shown))))
           / (1 + {Z * Z:.6f} / shown), nan)"""

# the window's served impressions that carry a variant
_VARIANT_IMPRESSIONS = f"""
            SELECT event_id AS imp, ad_id, assumeNotNull(variant_id) AS variant,
                   {SHOWN_AT_SERVE_SQL} AS shown_at_serve
            FROM impressions FINAL
            WHERE {_RANGE} AND isNotNull(variant_id)"""

# Each served impression with a variant, whether it was clicked and whether it was shown (at once
# on a server-rendered slot, or from before render beacons; else by its render beacon), per ad and
# variant (one JOIN per SELECT, 18.16: clicks, then views; `attribution.sql`'s per-impression
# flags, at most one per impression); the ads with the most such served impressions first.
# `%(top)s` ads at most (the others find no total: 0, filtered out; an ANY INNER JOIN would do
# it, but current releases keep one left row per key there, 18.16 all of them).
VARIANT_CTR_SQL = f"""
SELECT ad_id, variant, impressions, shown, clicks, impressions / ad_impressions AS share,
       if(shown > 0, clicks / shown, nan) AS ctr,
       {_WILSON.format(sign="-")} AS ctr_low,
       {_WILSON.format(sign="+")} AS ctr_high
FROM (
    SELECT ad_id, variant, count() AS impressions, sum(shown_at_serve OR viewed) AS shown,
           sum(clicked) AS clicks
    FROM {with_click_and_view("imp, ad_id, variant, shown_at_serve", _VARIANT_IMPRESSIONS)}
    GROUP BY ad_id, variant
) AS s
ANY LEFT JOIN (
    SELECT ad_id, count() AS ad_impressions FROM impressions FINAL
    WHERE {_RANGE} AND isNotNull(variant_id)
    GROUP BY ad_id ORDER BY ad_impressions DESC, ad_id LIMIT %(top)s
) AS a USING ad_id
WHERE ad_impressions > 0
ORDER BY ad_impressions DESC, ad_id, variant
"""

SHARE_COLOUR = "#7f7f7f"


def _pct(v: float | None) -> float | None:
    return None if v is None else 100.0 * v


def variant_ctr(backend: Backend, window: q.Window) -> Panel:
    """Per ad (the `top` by served impressions with a variant): each variant's CTR over shown
    impressions (bars, with the Wilson 95 % interval) and its share of the ad's served impressions
    (markers, right axis); served, shown and clicks in the hover."""
    rows = backend.execute(VARIANT_CTR_SQL, window.params)
    if not rows:
        return empty(
            "variants",
            "Creative variants per ad",
            f"no impressions that name a creative variant {span(window)} (ads without variants, or "
            "serving with variants.enabled off)",
        )
    ads: dict[str, list[tuple[str, int, int, int, float, float | None, float | None, float | None]]]
    ads = defaultdict(list)
    for ad, variant, imps, shown, clicks, share, ctr, low, high in rows:
        # nothing shown: no CTR (None, drawn as a gap; chDB gives the nan as null)
        values = (float(share), num(ctr), num(low), num(high))
        ads[str(ad)].append((str(variant), int(imps), int(shown), int(clicks), *values))
    x: list[list[str]] = [[], []]  # Plotly's multicategory axis: ad, then variant
    ctr_pct: list[float | None] = []
    plus: list[float | None] = []
    minus: list[float | None] = []
    share_pct: list[float] = []
    custom: list[list[float | int | None]] = []
    for ad, variants in ads.items():
        for variant, imps, shown, clicks, share, ctr, low, high in variants:
            x[0].append(ad)
            x[1].append(variant)
            if ctr is None or low is None or high is None:  # nothing shown: no CTR
                ctr_pct.append(None)
                plus.append(None)
                minus.append(None)
            else:
                ctr_pct.append(100.0 * ctr)
                plus.append(100.0 * (high - ctr))
                minus.append(100.0 * (ctr - low))
            share_pct.append(100.0 * share)
            custom.append([imps, shown, clicks, _pct(low), _pct(high), 100.0 * share])
    hover = (
        "%{x}<br>CTR %{customdata[3]:.2f}% … %{customdata[4]:.2f}% (95 %), point %{y:.2f}%<br>"
        "%{customdata[2]} clicks / %{customdata[1]} shown (%{customdata[0]} served), "
        "%{customdata[5]:.1f}% of the ad's served"
    )
    data = [
        {
            "type": "bar",
            "name": "CTR: clicks / shown (95 % Wilson interval)",
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
            "name": "share of the ad's served impressions",
            "x": x,
            "y": share_pct,
            "yaxis": "y2",
            "marker": {"color": SHARE_COLOUR, "symbol": "diamond", "size": 9},
            "hovertemplate": "%{x}<br>share %{y:.1f}%<extra></extra>",
        },
    ]
    layout = base_layout(
        f"Creative variants per ad (top {window.top} by served impressions): CTR (clicks over shown) "
        "with 95 % Wilson intervals, and each variant's share of its ad's served impressions",
        yaxis={"title": {"text": "CTR (%)"}, "rangemode": "tozero"},
        yaxis2={"title": {"text": "share (%)"}, "overlaying": "y", "side": "right", "range": [0, 100]},
        xaxis={"type": "multicategory"},
    )
    return panel("variants", "Creative variants per ad", {"data": data, "layout": layout})
