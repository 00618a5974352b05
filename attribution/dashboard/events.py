"""The operations panels: event rates, CTR, AUC and adapters over the raw event tables; pacing,
spend and CPA/ROAS over the hourly rollups' billed spend (`schemas.billing`)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from attribution.dashboard import queries as q
from attribution.dashboard.figures import Panel, base_layout, empty, panel, span, stamp, time_axis
from attribution.sql import Backend

SLOT_COLOURS = {"feed": "#1f77b4", "search": "#ff7f0e", "splash": "#2ca02c"}


# The left axis's kinds, as the legend names them; the rarer kinds go on the right axis.
_LEFT = {
    "impressions": "served impressions",
    "views": "views (render beacons: client-rendered ads shown)",
    "holdout impressions": "holdout impressions",
}


def event_rates(backend: Backend, window: q.Window) -> Panel:
    """Events per second of each kind per bucket (served impressions, and the render beacons
    that make client-rendered ones shown, on the left axis; the rarer clicks, dwell and
    conversions on the right)."""
    rows = backend.execute(q.EVENT_RATES, window.params)
    if not rows:
        return empty("event_rates", "Event rates", f"no events {span(window)}")
    by_kind: dict[str, dict[int, int]] = defaultdict(dict)
    for kind, t, n in rows:
        by_kind[kind][int(t)] = int(n)
    axis = time_axis(window)
    data = []
    kinds = ["impressions", "clicks", "dwell", "conversions"]
    for optional in ("holdout impressions", "views"):  # where serving holds users out; beacons
        if optional in by_kind:
            kinds.insert(1, optional)
    for kind in kinds:
        counts = by_kind.get(kind, {})
        ts = axis if axis is not None else sorted(counts)
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": _LEFT.get(kind, f"{kind} (right axis)"),
                "x": [stamp(t) for t in ts],
                "y": [counts.get(t, 0) / window.bucket for t in ts],
                "yaxis": "y" if kind in _LEFT else "y2",
            }
        )
    layout = base_layout(
        f"Event rates (events/s, {window.bucket} s buckets)",
        yaxis={"title": {"text": "impressions/s"}, "rangemode": "tozero"},
        yaxis2={
            "title": {"text": "events/s"},
            "overlaying": "y",
            "side": "right",
            "rangemode": "tozero",
            "tickformat": ".3~f",
        },
        xaxis={"type": "date"},
    )
    return panel("event_rates", "Event rates", {"data": data, "layout": layout})


def ctr(backend: Backend, window: q.Window) -> Panel:
    """CTR (clicks over shown impressions) per campaign (the `top` by served impressions), one bar
    per slot; counts in the hover."""
    rows = backend.execute(q.CTR_BY_SLOT_CAMPAIGN, window.params)
    if not rows:
        return empty("ctr", "CTR by slot and campaign", f"no impressions {span(window)}")
    campaigns = sorted({r[1] for r in rows})
    cells: dict[tuple[str, str], tuple[int, int]] = {(s, c): (int(i), int(k)) for s, c, i, k in rows}
    data = []
    for slot in sorted({r[0] for r in rows}):
        imps = [cells.get((slot, c), (0, 0))[0] for c in campaigns]
        clicks = [cells.get((slot, c), (0, 0))[1] for c in campaigns]
        data.append(
            {
                "type": "bar",
                "name": slot,
                "x": campaigns,
                "y": [100.0 * k / i if i else None for i, k in zip(imps, clicks, strict=True)],
                "customdata": [[i, k] for i, k in zip(imps, clicks, strict=True)],
                "hovertemplate": "%{x} · " + slot + ": CTR %{y:.2f}%<br>%{customdata[1]} clicks / "
                "%{customdata[0]} shown impressions<extra></extra>",
                "marker": {"color": SLOT_COLOURS.get(slot)},
            }
        )
    layout = base_layout(
        f"CTR by slot and campaign (top {window.top} campaigns by impressions)",
        barmode="group",
        yaxis={"title": {"text": "CTR (%)"}, "rangemode": "tozero"},
        xaxis={"type": "category", "tickangle": -40},
    )
    return panel("ctr", "CTR by slot and campaign", {"data": data, "layout": layout})


# Spend is what the hourly rollups say was billed: an hour counts once it is rolled up.
_NOT_ROLLED_UP = (
    "no rolled-up hours {span} (spend is read from the hourly rollups: `adstream attribution rollup`, "
    "run hourly by the scheduler)"
)


def _budgets(backend: Backend, window: q.Window) -> dict[str, float]:
    return {str(c): float(b) for c, b in backend.execute(q.BUDGETS, window.params)}


def pacing(backend: Backend, window: q.Window) -> Panel:
    """Cumulative billed spend (the hourly rollups) against the plan: the active ads' daily
    budgets spread evenly over time."""
    rows = backend.execute(q.SPEND_OVER_TIME, window.params)
    if not rows:
        return empty("pacing", "Spend against budget pacing", _NOT_ROLLED_UP.format(span=span(window)))
    spend = {int(t): float(s) for t, s in rows}
    axis = time_axis(window) or sorted(spend)
    ends = [min(t + window.bucket, window.until) for t in axis]
    running, total = [], 0.0
    for t in axis:
        total += spend.get(t, 0.0)
        running.append(round(total, 6))
    daily = sum(_budgets(backend, window).values())
    data: list[dict[str, Any]] = [
        {"type": "scatter", "mode": "lines", "name": "spend", "x": [stamp(e) for e in ends], "y": running}
    ]
    if daily > 0:
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": f"plan ({daily:,.2f}/day)",
                "line": {"dash": "dash"},
                "x": [stamp(e) for e in ends],
                "y": [round(daily * (e - window.since) / 86400.0, 6) for e in ends],
            }
        )
    title = "Billed spend against budget pacing (cumulative, hourly rollups)"
    if daily <= 0:
        title += " · no active ad budgets in the catalog"
    layout = base_layout(
        title, yaxis={"title": {"text": "spend"}, "rangemode": "tozero"}, xaxis={"type": "date"}
    )
    return panel("pacing", "Spend against budget pacing", {"data": data, "layout": layout})


def campaign_economics(backend: Backend, window: q.Window) -> list[Panel]:
    """Billed spend (the hourly rollups) against each campaign's budget for the window, and its
    CPA and ROAS."""
    rows = backend.execute(q.CAMPAIGN_ECONOMICS, window.params)
    if not rows:
        text = _NOT_ROLLED_UP.format(span=span(window))
        return [
            empty("spend_budget", "Spend against budget", text),
            empty("cpa_roas", "CPA and ROAS", text),
        ]
    budgets = _budgets(backend, window)
    days = (window.until - window.since) / 86400.0
    names = [str(r[0]) for r in rows]
    spend = [float(r[1]) for r in rows]
    conversions = [int(r[3]) for r in rows]
    value = [float(r[4]) for r in rows]
    budget = [budgets.get(c, 0.0) * days for c in names]
    spend_fig = {
        "data": [
            {"type": "bar", "name": "spend", "x": names, "y": spend},
            {
                "type": "bar",
                "name": "budget for the window",
                "x": names,
                "y": [round(b, 6) for b in budget],
                "marker": {"color": "rgba(150,150,150,0.6)"},
            },
            {
                "type": "scatter",
                "mode": "markers",
                "name": "pacing (spend / budget)",
                "x": names,
                "y": [s / b if b > 0 else None for s, b in zip(spend, budget, strict=True)],
                "yaxis": "y2",
                "marker": {"symbol": "diamond", "size": 9, "color": "#d62728"},
            },
        ],
        "layout": base_layout(
            f"Billed spend against budget (top {window.top} campaigns by spend; hourly rollups)",
            barmode="group",
            xaxis={"type": "category", "tickangle": -40},
            yaxis={"title": {"text": "spend"}, "rangemode": "tozero"},
            yaxis2={
                "title": {"text": "pacing"},
                "overlaying": "y",
                "side": "right",
                "rangemode": "tozero",
                "tickformat": ".2~f",
            },
        ),
    }
    cpa = [s / c if c else None for s, c in zip(spend, conversions, strict=True)]
    roas = [v / s if s > 0 else None for v, s in zip(value, spend, strict=True)]
    econ_fig = {
        "data": [
            {
                "type": "bar",
                "name": "CPA (spend / conversion)",
                "x": names,
                "y": cpa,
                "customdata": conversions,
                "hovertemplate": "%{x}: CPA %{y:.2f} (%{customdata} conversions)<extra></extra>",
            },
            {
                "type": "scatter",
                "mode": "markers",
                "name": "ROAS (value / spend)",
                "x": names,
                "y": roas,
                "yaxis": "y2",
                "marker": {"symbol": "circle", "size": 9, "color": "#9467bd"},
            },
        ],
        "layout": base_layout(
            "CPA and ROAS per campaign (billed spend; conversions as recorded, before attribution)",
            xaxis={"type": "category", "tickangle": -40},
            yaxis={"title": {"text": "CPA"}, "rangemode": "tozero"},
            yaxis2={
                "title": {"text": "ROAS"},
                "overlaying": "y",
                "side": "right",
                "rangemode": "tozero",
                "tickformat": ".2~f",
            },
        ),
    }
    return [
        panel("spend_budget", "Spend against budget", spend_fig),
        panel("cpa_roas", "CPA and ROAS", econ_fig),
    ]


def online_auc(backend: Backend, window: q.Window) -> Panel:
    """Online AUC of the served pctr per (coarse) bucket, for all traffic and per adapter."""
    bucket = window.coarse_bucket
    rows = backend.execute(q.ONLINE_AUC, {**window.params, "bucket": bucket})
    if not rows:
        return empty(
            "online_auc",
            "Online AUC",
            f"no bucket {span(window)} has impressions with pctr and both clicks and non-clicks",
        )
    series: dict[str, list[tuple[int, float, int, int]]] = defaultdict(list)
    for t, version, clicks, non_clicks, auc in rows:
        series[str(version)].append((int(t), float(auc), int(clicks), int(non_clicks)))
    data = []
    for version in sorted(series, key=lambda v: (v != "all", v)):
        points = series[version]
        data.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": "all traffic" if version == "all" else f"adapter {version}",
                "x": [stamp(t) for t, *_ in points],
                "y": [round(a, 6) for _, a, _, _ in points],
                "customdata": [[c, n] for _, _, c, n in points],
                "hovertemplate": "AUC %{y:.3f}<br>%{customdata[0]} clicks, %{customdata[1]} non-clicks"
                "<extra>%{fullData.name}</extra>",
                "line": {"width": 3 if version == "all" else 1.5},
            }
        )
    layout = base_layout(
        f"Online AUC of served pctr vs clicks ({bucket} s buckets)",
        yaxis={"title": {"text": "AUC"}, "range": [0.0, 1.0]},
        xaxis={"type": "date"},
        shapes=[
            {
                "type": "line",
                "xref": "paper",
                "x0": 0,
                "x1": 1,
                "y0": 0.5,
                "y1": 0.5,
                "line": {"dash": "dot", "color": "#999"},
            }
        ],
    )
    return panel("online_auc", "Online AUC", {"data": data, "layout": layout})


def adapter_versions(backend: Backend, window: q.Window) -> Panel:
    """Each adapter version's share of the served impressions per bucket."""
    rows = backend.execute(q.ADAPTER_MIX, window.params)
    if not rows:
        return empty("adapter_versions", "Adapter versions", f"no impressions {span(window)}")
    counts: dict[str, dict[int, int]] = defaultdict(dict)
    for t, version, n in rows:
        counts[str(version)][int(t)] = int(n)
    axis = sorted({int(r[0]) for r in rows})  # buckets with impressions: a share needs some
    data = [
        {
            "type": "scatter",
            "mode": "lines",
            "stackgroup": "versions",
            "groupnorm": "percent",
            "name": version,
            "x": [stamp(t) for t in axis],
            "y": [counts[version].get(t, 0) for t in axis],
        }
        for version in sorted(counts)
    ]
    layout = base_layout(
        "Adapter versions serving (share of impressions)",
        yaxis={"title": {"text": "% of impressions"}, "range": [0, 100]},
        xaxis={"type": "date"},
    )
    return panel("adapter_versions", "Adapter versions", {"data": data, "layout": layout})
