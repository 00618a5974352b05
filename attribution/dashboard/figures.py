"""What every dashboard panel is made of: the panel dict, Plotly layout defaults, time axes.

A panel is `{"id", "title", "figure", "empty", "error"}`: `figure` is a Plotly `{data, layout}`
dict when there is something to draw; otherwise `empty` says what is missing (no data in the
window, no attribution run stored yet) or `error` says what failed (a missing table, a query
error), so one failing panel never blanks the page.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

from attribution.dashboard import queries as q

Panel = dict[str, Any]
Figure = dict[str, Any]
MAX_FILLED_BUCKETS = 5000  # beyond this a time axis is drawn from the rows only (no zero fill)


def stamp(epoch: int) -> str:
    """A UTC time as Plotly reads dates ('YYYY-MM-DD HH:MM:SS')."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S")


def base_layout(title: str, **extra: Any) -> dict[str, Any]:
    """The layout every chart starts from (the title moves to the panel heading: `panel`)."""
    base: dict[str, Any] = {
        "title": {"text": title, "font": {"size": 15}},
        "margin": {"l": 60, "r": 60, "t": 20, "b": 60},
        "legend": {"orientation": "h", "y": -0.2},
        "height": 360,
    }
    base.update(extra)
    return base


def time_axis(window: q.Window) -> list[int] | None:
    """Every bucket of the window, for zero-filled series (None when there are too many)."""
    buckets = window.buckets
    return buckets if len(buckets) <= MAX_FILLED_BUCKETS else None


def span(window: q.Window) -> str:
    """The window in words, for "no data" messages."""
    return f"between {stamp(window.since)} and {stamp(window.until)} UTC"


def num(x: Any) -> float | None:
    """A finite float, or None (NaN CIs without a bootstrap; chDB's JSON gives them as null)."""
    if x is None:
        return None
    v = float(x)
    return v if math.isfinite(v) else None


def panel(pid: str, title: str, figure: Figure) -> Panel:
    """A panel with data; the figure's detailed title becomes the panel's heading (the page shows
    it above the chart, where a long one wraps instead of being cut)."""
    detail = figure["layout"].pop("title", {}).get("text") or title
    return {"id": pid, "title": detail, "figure": figure, "empty": None, "error": None}


def empty(pid: str, title: str, why: str) -> Panel:
    """A panel with nothing to draw, saying why."""
    return {"id": pid, "title": title, "figure": None, "empty": why, "error": None}


def error(pid: str, title: str, why: str) -> Panel:
    """A panel whose query failed, saying how."""
    return {"id": pid, "title": title, "figure": None, "empty": None, "error": why}
