"""The A/B panel: each arm's CTR per hour with its 95 % interval band, from the A/B rollup."""

from __future__ import annotations

from collections import defaultdict

from attribution.ab_rollups import HOURLY_CTR_SQL
from attribution.dashboard import queries as q
from attribution.dashboard.figures import Panel, base_layout, empty, num, panel, span
from attribution.rollups import hour_bounds
from attribution.sql import Backend

ARM_COLOURS = {"learning": "#1f77b4", "correction": "#ff7f0e", "control": "#7f7f7f"}
ARM_FILLS = {"learning": "rgba(31,119,180,0.18)", "correction": "rgba(255,127,14,0.18)"}
GREY_FILL = "rgba(127,127,127,0.18)"


def ab_ctr(backend: Backend, window: q.Window) -> Panel:
    """CTR per arm and hour (the rollup's grain) with the delta-method 95 % band over users."""
    lo, hi = hour_bounds(window.since, window.until)
    rows = backend.execute(HOURLY_CTR_SQL, {"since": lo, "until": hi, "slot": ""})
    if not rows:
        return empty(
            "ab_ctr",
            "CTR per arm",
            f"no A/B rollup rows {span(window)} (serving records no arm, or `adstream ab` has not "
            "refreshed the rollup yet)",
        )
    series: dict[str, list[tuple[str, float, float | None, int, int, int]]] = defaultdict(list)
    for hour, arm, users, imps, clicks, ctr, half in rows:
        t = hour if isinstance(hour, str) else hour.strftime("%Y-%m-%d %H:%M:%S")  # driver: a datetime
        series[str(arm)].append((t, float(ctr), num(half), int(users), int(imps), int(clicks)))
    data: list[dict[str, object]] = []
    for arm in sorted(
        series, key=lambda a: (a not in ARM_COLOURS, list(ARM_COLOURS).index(a) if a in ARM_COLOURS else 0, a)
    ):
        pts = series[arm]
        x = [p[0] for p in pts]
        y = [100.0 * p[1] for p in pts]
        half = [100.0 * p[2] if p[2] is not None else None for p in pts]
        colour = ARM_COLOURS.get(arm)
        upper = [v + h if h is not None else None for v, h in zip(y, half, strict=True)]
        lower = [v - h if h is not None else None for v, h in zip(y, half, strict=True)]
        band = {"type": "scatter", "mode": "lines", "x": x, "line": {"width": 0}, "hoverinfo": "skip",
                "showlegend": False, "legendgroup": arm}  # fmt: skip
        data.append({**band, "y": upper, "name": f"{arm} upper"})
        data.append({**band, "y": lower, "name": f"{arm} 95 % band", "fill": "tonexty",
                     "fillcolor": ARM_FILLS.get(arm, GREY_FILL)})  # fmt: skip
        data.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": arm,
                "legendgroup": arm,
                "x": x,
                "y": y,
                "error_y": {
                    "type": "data",
                    "array": [h or 0.0 for h in half],
                    "visible": True,
                    "thickness": 1,
                },
                "customdata": [[p[3], p[4], p[5]] for p in pts],
                "hovertemplate": "CTR %{y:.2f}% ± %{error_y.array:.2f}<br>%{customdata[2]} clicks / "
                "%{customdata[1]} impressions, %{customdata[0]} users<extra>%{fullData.name}</extra>",
                "line": {"color": colour},
                "marker": {"color": colour},
            }
        )
    layout = base_layout(
        "CTR per arm, hourly, with 95 % intervals over users (A/B rollup)",
        yaxis={"title": {"text": "CTR (%)"}, "rangemode": "tozero"},
        xaxis={"type": "date"},
    )
    return panel("ab_ctr", "CTR per arm", {"data": data, "layout": layout})
