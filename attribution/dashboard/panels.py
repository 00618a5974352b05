"""The dashboard's panels: each runs its statements on a Backend and returns a Plotly figure dict.

A panel is `{"id", "title", "figure", "empty", "error"}`: `figure` is a Plotly `{data, layout}`
dict when there is something to draw; otherwise `empty` says what is missing (no data in the
window, no attribution run stored yet) or `error` says what failed (a missing table, a query
error), so one failing panel never blanks the page.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from attribution.dashboard import queries as q
from attribution.sql import Backend
from schemas.errors import StoreError

log = logging.getLogger(__name__)

Panel = dict[str, Any]
Figure = dict[str, Any]
MAX_FILLED_BUCKETS = 5000  # beyond this a time axis is drawn from the rows only (no zero fill)
SLOT_COLOURS = {"feed": "#1f77b4", "search": "#ff7f0e", "splash": "#2ca02c"}


def stamp(epoch: int) -> str:
    """A UTC time as Plotly reads dates ('YYYY-MM-DD HH:MM:SS')."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S")


def data_bounds(backend: Backend) -> tuple[int, int] | None:
    """(earliest, latest) event time in epoch seconds, or None when there are no events."""
    lo, hi, n = backend.execute(q.BOUNDS)[0]
    return (int(lo), int(hi)) if n else None


def _layout(title: str, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "title": {"text": title, "font": {"size": 15}},
        "margin": {"l": 60, "r": 60, "t": 20, "b": 60},
        "legend": {"orientation": "h", "y": -0.2},
        "height": 360,
    }
    base.update(extra)
    return base


def _time_axis(window: q.Window) -> list[int] | None:
    buckets = window.buckets
    return buckets if len(buckets) <= MAX_FILLED_BUCKETS else None


def _span(window: q.Window) -> str:
    return f"between {stamp(window.since)} and {stamp(window.until)} UTC"


# -- raw-event panels ---------------------------------------------------------------------------
def event_rates(backend: Backend, window: q.Window) -> Panel:
    rows = backend.execute(q.EVENT_RATES, window.params)
    if not rows:
        return _empty("event_rates", "Event rates", f"no events {_span(window)}")
    by_kind: dict[str, dict[int, int]] = defaultdict(dict)
    for kind, t, n in rows:
        by_kind[kind][int(t)] = int(n)
    axis = _time_axis(window)
    data = []
    kinds = ["impressions", "clicks", "dwell", "conversions"]
    if "holdout impressions" in by_kind:  # only where serving holds users out
        kinds.insert(1, "holdout impressions")
    for kind in kinds:
        counts = by_kind.get(kind, {})
        ts = axis if axis is not None else sorted(counts)
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": kind if kind.endswith("impressions") else f"{kind} (right axis)",
                "x": [stamp(t) for t in ts],
                "y": [counts.get(t, 0) / window.bucket for t in ts],
                "yaxis": "y" if kind.endswith("impressions") else "y2",
            }
        )
    layout = _layout(
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
    return _panel("event_rates", "Event rates", {"data": data, "layout": layout})


def ctr(backend: Backend, window: q.Window) -> Panel:
    rows = backend.execute(q.CTR_BY_SLOT_CAMPAIGN, window.params)
    if not rows:
        return _empty("ctr", "CTR by slot and campaign", f"no impressions {_span(window)}")
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
                "%{customdata[0]} impressions<extra></extra>",
                "marker": {"color": SLOT_COLOURS.get(slot)},
            }
        )
    layout = _layout(
        f"CTR by slot and campaign (top {window.top} campaigns by impressions)",
        barmode="group",
        yaxis={"title": {"text": "CTR (%)"}, "rangemode": "tozero"},
        xaxis={"type": "category", "tickangle": -40},
    )
    return _panel("ctr", "CTR by slot and campaign", {"data": data, "layout": layout})


def _budgets(backend: Backend, window: q.Window) -> dict[str, float]:
    return {str(c): float(b) for c, b in backend.execute(q.BUDGETS, window.params)}


def pacing(backend: Backend, window: q.Window) -> Panel:
    """Cumulative spend against the plan: the active ads' daily budgets spread evenly over time."""
    rows = backend.execute(q.SPEND_OVER_TIME, window.params)
    if not rows:
        return _empty("pacing", "Spend against budget pacing", f"no impressions {_span(window)}")
    spend = {int(t): float(s) for t, s in rows}
    axis = _time_axis(window) or sorted(spend)
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
    title = "Spend against budget pacing (cumulative)"
    if daily <= 0:
        title += " · no active ad budgets in the catalog"
    layout = _layout(title, yaxis={"title": {"text": "spend"}, "rangemode": "tozero"}, xaxis={"type": "date"})
    return _panel("pacing", "Spend against budget pacing", {"data": data, "layout": layout})


def campaign_economics(backend: Backend, window: q.Window) -> list[Panel]:
    """Spend against each campaign's budget for the window, and its CPA and ROAS."""
    rows = backend.execute(q.CAMPAIGN_ECONOMICS, window.params)
    if not rows:
        text = f"no impressions {_span(window)}"
        return [
            _empty("spend_budget", "Spend against budget", text),
            _empty("cpa_roas", "CPA and ROAS", text),
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
        "layout": _layout(
            f"Spend against budget (top {window.top} campaigns by spend)",
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
        "layout": _layout(
            "CPA and ROAS per campaign (conversions as recorded, before attribution)",
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
        _panel("spend_budget", "Spend against budget", spend_fig),
        _panel("cpa_roas", "CPA and ROAS", econ_fig),
    ]


def online_auc(backend: Backend, window: q.Window) -> Panel:
    bucket = window.coarse_bucket
    rows = backend.execute(q.ONLINE_AUC, {**window.params, "bucket": bucket})
    if not rows:
        return _empty(
            "online_auc",
            "Online AUC",
            f"no bucket {_span(window)} has impressions with pctr and both clicks and non-clicks",
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
    layout = _layout(
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
    return _panel("online_auc", "Online AUC", {"data": data, "layout": layout})


def adapter_versions(backend: Backend, window: q.Window) -> Panel:
    rows = backend.execute(q.ADAPTER_MIX, window.params)
    if not rows:
        return _empty("adapter_versions", "Adapter versions", f"no impressions {_span(window)}")
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
    layout = _layout(
        "Adapter versions serving (share of impressions)",
        yaxis={"title": {"text": "% of impressions"}, "range": [0, 100]},
        xaxis={"type": "date"},
    )
    return _panel("adapter_versions", "Adapter versions", {"data": data, "layout": layout})


# -- attribution-run panels ----------------------------------------------------------------------
RUN_PANELS = (
    ("model_comparison", "Model comparison"),
    ("model_roi", "ROI and CPA by model"),
    ("budget_moves", "Budget moves"),
)
RESULT_COLUMNS = (
    "model",
    "channel",
    "conversions",
    "value",
    "share",
    "ci_low",
    "ci_high",
    "spend",
    "roi",
    "cpa",
    "recommended_spend",
    "low_confidence",
)  # fmt: skip (RUN_RESULTS' columns, in order)


def attribution_runs(backend: Backend, window: q.Window) -> list[Panel]:
    """The stored run's model comparison (credited conversions with their bootstrap CIs) and
    its budget moves per model (recommended − current spend, hatched where low-confidence)."""
    info = backend.execute(q.RUN_INFO, window.params)
    if not info:
        what = f"no attribution run {window.run_id!r}" if window.run_id else "no attribution run stored yet"
        return _no_run(f"{what}: run `adstream attribution --model … --by …` first")
    run_id, _, lo, hi, granularity, conversions, _, _ = info[0]
    rows = [dict(zip(RESULT_COLUMNS, r, strict=True)) for r in backend.execute(q.RUN_RESULTS, window.params)]
    if not rows:
        return _no_run(f"attribution run {run_id} has no per-channel results")
    about = (
        f"run {run_id} · by {granularity} · {stamp(int(lo))} – {stamp(int(hi))} · "
        f"{float(conversions):,.1f} conversions"
    )
    by_model: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        by_model[str(r["model"])][str(r["channel"])] = r
    channels = sorted({str(r["channel"]) for r in rows})
    comparison = [_credit_trace(model, cells, channels) for model, cells in by_model.items()]
    moves = [_move_trace(model, cells, channels) for model, cells in by_model.items()]
    returns = [_roi_trace(model, cells, channels) for model, cells in by_model.items()]
    comparison_fig = {
        "data": comparison,
        "layout": _layout(
            f"Model comparison: credited conversions with 95% bootstrap CI ({about})",
            barmode="group",
            xaxis={"type": "category", "tickangle": -40},
            yaxis={"title": {"text": "credited conversions"}, "rangemode": "tozero"},
        ),
    }
    moves_fig = {
        "data": moves,
        "layout": _layout(
            "Budget moves per model: recommended − current spend (hatched: low confidence, CIs overlap)",
            barmode="group",
            xaxis={"type": "category", "tickangle": -40},
            yaxis={"title": {"text": "spend change"}, "zeroline": True},
        ),
    }
    roi_fig = {
        "data": returns,
        "layout": _layout(
            "ROI per channel under each model: (credited value − spend) / spend",
            barmode="group",
            xaxis={"type": "category", "tickangle": -40},
            yaxis={"title": {"text": "ROI"}, "zeroline": True, "tickformat": ".2~f"},
        ),
    }
    return [
        _panel("model_comparison", "Model comparison", comparison_fig),
        _panel("model_roi", "ROI and CPA by model", roi_fig),
        _panel("budget_moves", "Budget moves", moves_fig),
    ]


def _credit_trace(model: str, cells: dict[str, dict[str, Any]], channels: list[str]) -> dict[str, Any]:
    def col(name: str) -> list[float | None]:
        return [_num(cells[c][name]) if c in cells else None for c in channels]

    conv, low, high = col("conversions"), col("ci_low"), col("ci_high")
    share, roi, cpa = col("share"), col("roi"), col("cpa")
    return {
        "type": "bar",
        "name": model,
        "x": channels,
        "y": conv,
        "error_y": {  # none drawn where the run had no bootstrap (NaN CIs)
            "type": "data",
            "symmetric": False,
            "array": [
                None if h is None or v is None else max(h - v, 0.0) for v, h in zip(conv, high, strict=True)
            ],
            "arrayminus": [
                None if lw is None or v is None else max(v - lw, 0.0) for v, lw in zip(conv, low, strict=True)
            ],
        },
        "customdata": [
            [_pct(s), lw, h, r, c] for s, lw, h, r, c in zip(share, low, high, roi, cpa, strict=True)
        ],
        "hovertemplate": "%{x} · " + model + ": %{y:.1f} conversions (%{customdata[0]:.1f}% of credit)"
        "<br>95% CI %{customdata[1]:.1f} – %{customdata[2]:.1f}<br>ROI %{customdata[3]:.2f}, "
        "CPA %{customdata[4]:.2f}<extra></extra>",
    }


def _roi_trace(model: str, cells: dict[str, dict[str, Any]], channels: list[str]) -> dict[str, Any]:
    roi = [_num(cells[c]["roi"]) if c in cells else None for c in channels]
    cpa = [_num(cells[c]["cpa"]) if c in cells else None for c in channels]
    return {
        "type": "bar",
        "name": model,
        "x": channels,
        "y": roi,
        "customdata": cpa,
        "hovertemplate": "%{x} · " + model + ": ROI %{y:.2f}, CPA %{customdata:.2f}<extra></extra>",
    }


def _move_trace(model: str, cells: dict[str, dict[str, Any]], channels: list[str]) -> dict[str, Any]:
    spend = [_num(cells[c]["spend"]) if c in cells else None for c in channels]
    recommended = [_num(cells[c]["recommended_spend"]) if c in cells else None for c in channels]
    flagged = [bool(cells[c]["low_confidence"]) if c in cells else False for c in channels]
    return {
        "type": "bar",
        "name": model,
        "x": channels,
        "y": [None if a is None or b is None else b - a for a, b in zip(spend, recommended, strict=True)],
        "marker": {"pattern": {"shape": ["/" if f else "" for f in flagged]}},
        "customdata": [
            [a, b, "low confidence" if f else "confident"]
            for a, b, f in zip(spend, recommended, flagged, strict=True)
        ],
        "hovertemplate": "%{x} · " + model + ": %{customdata[0]:.2f} → %{customdata[1]:.2f} "
        "(%{customdata[2]})<extra></extra>",
    }


def _no_run(text: str) -> list[Panel]:
    return [_empty(pid, title, text) for pid, title in RUN_PANELS]


def _pct(x: float | None) -> float | None:
    return None if x is None else 100.0 * x


# -- assembly ------------------------------------------------------------------------------------
PanelFn = Callable[[Backend, q.Window], "Panel | list[Panel]"]
# the page's order; ids of the panels each function returns (for error placeholders)
PANELS: tuple[tuple[PanelFn, tuple[tuple[str, str], ...]], ...] = (
    (event_rates, (("event_rates", "Event rates"),)),
    (ctr, (("ctr", "CTR by slot and campaign"),)),
    (pacing, (("pacing", "Spend against budget pacing"),)),
    (campaign_economics, (("spend_budget", "Spend against budget"), ("cpa_roas", "CPA and ROAS"))),
    (attribution_runs, RUN_PANELS),
    (online_auc, (("online_auc", "Online AUC"),)),
    (adapter_versions, (("adapter_versions", "Adapter versions"),)),
)
PANEL_IDS: tuple[str, ...] = tuple(pid for _, ids in PANELS for pid, _ in ids)


def build(backend: Backend, window: q.Window) -> list[Panel]:
    """Every panel for the window, in page order; a failing query marks its panels as errors."""
    out: list[Panel] = []
    for fn, ids in PANELS:
        try:
            got = fn(backend, window)
        except StoreError as exc:
            log.warning("dashboard panel %s failed: %s", fn.__name__, exc)
            out.extend(_error(pid, title, _hint(str(exc))) for pid, title in ids)
            continue
        out.extend(got if isinstance(got, list) else [got])
    return out


def _hint(message: str) -> str:
    if "doesn't exist" in message or "does not exist" in message or "UNKNOWN_TABLE" in message:
        return f"{message} (are the migrations applied? run `adstream migrate`)"
    return message


def _num(x: Any) -> float | None:
    """A finite float, or None (NaN CIs without a bootstrap; chDB's JSON gives them as null)."""
    if x is None:
        return None
    v = float(x)
    return v if math.isfinite(v) else None


def _panel(pid: str, title: str, figure: Figure) -> Panel:
    """A panel with data; the figure's detailed title becomes the panel's heading (the page shows
    it above the chart, where a long one wraps instead of being cut)."""
    detail = figure["layout"].pop("title", {}).get("text") or title
    return {"id": pid, "title": detail, "figure": figure, "empty": None, "error": None}


def _empty(pid: str, title: str, why: str) -> Panel:
    return {"id": pid, "title": title, "figure": None, "empty": why, "error": None}


def _error(pid: str, title: str, why: str) -> Panel:
    return {"id": pid, "title": title, "figure": None, "empty": None, "error": why}
