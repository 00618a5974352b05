"""The dashboard's panels, in page order: each runs its statements on a Backend and returns
Plotly figure dicts (see `figures` for the panel shape; `events` and `runs` make them)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from attribution.dashboard import queries as q
from attribution.dashboard.advertiser import campaign_table, pacing_alerts, spend_per_campaign
from attribution.dashboard.arms import ab_ctr
from attribution.dashboard.events import (
    adapter_versions,
    campaign_economics,
    ctr,
    event_rates,
    online_auc,
    pacing,
)
from attribution.dashboard.figures import Panel, error, stamp
from attribution.dashboard.runs import RUN_PANELS, attribution_runs, recent_runs
from attribution.dashboard.variants import variant_ctr
from attribution.sql import Backend
from schemas.errors import StoreError

__all__ = ["PANELS", "PANEL_IDS", "Panel", "attribution_runs", "build", "data_bounds", "stamp"]

log = logging.getLogger(__name__)


def data_bounds(backend: Backend) -> tuple[int, int] | None:
    """(earliest, latest) event time in epoch seconds, or None when there are no events."""
    lo, hi, n = backend.execute(q.BOUNDS)[0]
    return (int(lo), int(hi)) if n else None


PanelFn = Callable[[Backend, q.Window], "Panel | list[Panel]"]
# the page's order; ids of the panels each function returns (for error placeholders)
PANELS: tuple[tuple[PanelFn, tuple[tuple[str, str], ...]], ...] = (
    (event_rates, (("event_rates", "Event rates"),)),
    (ctr, (("ctr", "CTR by slot and campaign"),)),
    (ab_ctr, (("ab_ctr", "CTR per arm"),)),
    (variant_ctr, (("variants", "Creative variants per ad"),)),
    (pacing, (("pacing", "Spend against budget pacing"),)),
    (campaign_economics, (("spend_budget", "Spend against budget"), ("cpa_roas", "CPA and ROAS"))),
    (attribution_runs, RUN_PANELS),
    (online_auc, (("online_auc", "Online AUC"),)),
    (adapter_versions, (("adapter_versions", "Adapter versions"),)),
    (recent_runs, (("recent_runs", "Attribution runs"),)),
)
PANEL_IDS: tuple[str, ...] = tuple(pid for _, ids in PANELS for pid, _ in ids)
# the advertiser's view: their campaigns only, every panel from the hourly rollups (no stored
# attribution run: a run's channels span every advertiser)
ADVERTISER_PANELS: tuple[tuple[PanelFn, tuple[tuple[str, str], ...]], ...] = (
    (campaign_table, (("adv_campaigns", "Campaigns"),)),
    (pacing_alerts, (("adv_pacing", "Pacing alerts"),)),
    (spend_per_campaign, (("adv_spend", "Spend per campaign"),)),
)
ADVERTISER_PANEL_IDS: tuple[str, ...] = tuple(pid for _, ids in ADVERTISER_PANELS for pid, _ in ids)


def build(backend: Backend, window: q.Window) -> list[Panel]:
    """Every panel of the window's view, in page order; a failing query marks its panels as errors."""
    out: list[Panel] = []
    for fn, ids in ADVERTISER_PANELS if window.view.name == "advertiser" else PANELS:
        try:
            got = fn(backend, window)
        except StoreError as exc:
            log.warning("dashboard panel %s failed: %s", fn.__name__, exc)
            out.extend(error(pid, title, _hint(str(exc))) for pid, title in ids)
            continue
        out.extend(got if isinstance(got, list) else [got])
    return out


def _hint(message: str) -> str:
    if "doesn't exist" in message or "does not exist" in message or "UNKNOWN_TABLE" in message:
        return f"{message} (are the migrations applied? run `adstream migrate`)"
    return message
