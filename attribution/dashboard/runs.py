"""Panels over a stored attribution run (attribution.runs): model comparison with CIs, ROI and
CPA per model, and the budget moves each model recommends."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from attribution.dashboard import queries as q
from attribution.dashboard.figures import Panel, base_layout, empty, num, panel, stamp
from attribution.sql import Backend

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
        "layout": base_layout(
            f"Model comparison: credited conversions with 95% bootstrap CI ({about})",
            barmode="group",
            xaxis={"type": "category", "tickangle": -40},
            yaxis={"title": {"text": "credited conversions"}, "rangemode": "tozero"},
        ),
    }
    moves_fig = {
        "data": moves,
        "layout": base_layout(
            "Budget moves per model: recommended − current spend (hatched: low confidence, CIs overlap)",
            barmode="group",
            xaxis={"type": "category", "tickangle": -40},
            yaxis={"title": {"text": "spend change"}, "zeroline": True},
        ),
    }
    roi_fig = {
        "data": returns,
        "layout": base_layout(
            "ROI per channel under each model: (credited value − spend) / spend",
            barmode="group",
            xaxis={"type": "category", "tickangle": -40},
            yaxis={"title": {"text": "ROI"}, "zeroline": True, "tickformat": ".2~f"},
        ),
    }
    return [
        panel("model_comparison", "Model comparison", comparison_fig),
        panel("model_roi", "ROI and CPA by model", roi_fig),
        panel("budget_moves", "Budget moves", moves_fig),
    ]


def _credit_trace(model: str, cells: dict[str, dict[str, Any]], channels: list[str]) -> dict[str, Any]:
    def col(name: str) -> list[float | None]:
        return [num(cells[c][name]) if c in cells else None for c in channels]

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
    roi = [num(cells[c]["roi"]) if c in cells else None for c in channels]
    cpa = [num(cells[c]["cpa"]) if c in cells else None for c in channels]
    return {
        "type": "bar",
        "name": model,
        "x": channels,
        "y": roi,
        "customdata": cpa,
        "hovertemplate": "%{x} · " + model + ": ROI %{y:.2f}, CPA %{customdata:.2f}<extra></extra>",
    }


def _move_trace(model: str, cells: dict[str, dict[str, Any]], channels: list[str]) -> dict[str, Any]:
    spend = [num(cells[c]["spend"]) if c in cells else None for c in channels]
    recommended = [num(cells[c]["recommended_spend"]) if c in cells else None for c in channels]
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
    return [empty(pid, title, text) for pid, title in RUN_PANELS]


def _pct(x: float | None) -> float | None:
    return None if x is None else 100.0 * x


def recent_runs(backend: Backend, window: q.Window) -> Panel:
    """The latest stored runs (the `top` newest), the one shown marked, to pick one with `?run=`."""
    rows = backend.execute(q.RECENT_RUNS, window.params)
    if not rows:
        return empty("recent_runs", "Attribution runs", "no attribution run stored yet")
    shown = window.run_id or str(rows[0][0])
    columns = list(zip(*rows, strict=True))
    header = ["run (?run=…)", "created (UTC)", "window (UTC)", "by", "models", "conversions", "value"]
    cells = [
        [f"▶ {r}" if r == shown else str(r) for r in columns[0]],
        [stamp(int(t)) for t in columns[1]],
        [f"{stamp(int(lo))} – {stamp(int(hi))}" for lo, hi in zip(columns[2], columns[3], strict=True)],
        [str(g) for g in columns[4]],
        [str(m) for m in columns[5]],
        [round(float(c), 2) for c in columns[6]],
        [round(float(v), 2) for v in columns[7]],
    ]
    figure = {
        "data": [
            {
                "type": "table",
                "columnwidth": [1.2, 1.2, 2.4, 0.8, 2.6, 1, 1],
                "header": {"values": header, "align": "left", "fill": {"color": "#e5e7eb"}},
                "cells": {"values": cells, "align": "left", "height": 24},
            }
        ],
        "layout": base_layout(
            f"Attribution runs (latest {window.top}; ▶ shown above)",
            height=90 + 32 * len(rows),
            margin={"l": 10, "r": 10, "t": 10, "b": 10},
        ),
    }
    return panel("recent_runs", "Attribution runs", figure)
