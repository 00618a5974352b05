"""The operations dashboard's CTR by slot and campaign (and Grafana's CTR panels, same rule) is
clicks over shown impressions (`schemas.billing`), on chDB: a client-rendered impression counts
once its render beacon is in `views`, a server-rendered one (or one from before render beacons)
when served; a click whose beacon was lost is a click, not a shown impression."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from attribution.dashboard import queries as q
from attribution.migrate import apply_migrations
from attribution.sql import ChdbBackend
from schemas.events import Click, Impression, Message, Render, View
from streams.sink import COLUMNS, row_of

T0 = 1767225600  # 2026-01-01T00:00:00Z
GRAFANA = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "dashboards" / "adstream.json"


def _at(t: int) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def _imp(eid: str, slot: str, render: Render | None) -> Impression:
    return Impression(event_id=eid, ts=_at(T0 + 10), user_id="u", request_id="r", ad_id="a", campaign_id="c",
                      advertiser_id="v", slot=slot, position=0, price=1.0, pctr=0.1, bid_type="cpc",
                      render=render)  # fmt: skip


def _db() -> ChdbBackend:
    db = ChdbBackend(f"shown_ctr_{uuid.uuid4().hex[:8]}")
    apply_migrations(db)
    events: list[Message] = [
        _imp("f1", "feed", "client"),  # viewed, clicked
        _imp("f2", "feed", "client"),  # viewed
        _imp("f3", "feed", "client"),  # served only
        _imp("f4", "feed", "client"),  # clicked, its beacon lost
        _imp("s1", "splash", "server"),  # shown when served
        _imp("s2", "splash", None),  # before render beacons: shown when served, clicked
        *(View(event_id=f"v{i}", ts=_at(T0 + 20), user_id="u", impression_id=i, ad_id="a")
          for i in ("f1", "f2")),
        *(Click(event_id=f"k{i}", ts=_at(T0 + 30), user_id="u", impression_id=i, ad_id="a", campaign_id="c")
          for i in ("f1", "f4", "s2")),
    ]  # fmt: skip
    rows: dict[type[Message], list[tuple[Any, ...]]] = {}
    for n, e in enumerate(events):
        rows.setdefault(type(e), []).append(row_of(e, 0, n)[1])
    for model, batch in rows.items():
        table, cols = COLUMNS[model]
        db.insert(table, (*cols, "kafka_partition", "kafka_offset"), batch)
    return db


def test_ctr_by_slot_and_campaign_is_clicks_over_shown() -> None:
    db = _db()
    window = q.Window(since=T0, until=T0 + 3600, bucket=3600)
    got = {(s, c): (int(n), int(k)) for s, c, n, k in db.execute(q.CTR_BY_SLOT_CAMPAIGN, window.params)}
    assert got == {("feed", "c"): (2, 2), ("splash", "c"): (2, 1)}


def test_grafana_ctr_panels_count_shown_alike() -> None:
    db = _db()
    panels = {p["title"]: p["targets"][0]["rawSql"] for p in json.loads(GRAFANA.read_text())["panels"]}

    def run(title: str) -> list[tuple[Any, ...]]:
        span = f"ts >= toDateTime({T0}) AND ts < toDateTime({T0 + 3600})"
        sql = panels[title].replace("$__timeFilter(ts)", span).replace("$__fromTime", f"toDateTime({T0})")
        sql = sql.replace("$__interval_s", "3600")
        return db.execute(sql)

    by_campaign = {(str(r[0]), str(r[1])): tuple(r[2:5]) for r in run("CTR by campaign and slot")}
    assert by_campaign == {("c", "feed"): (4, 2, 2), ("c", "splash"): (2, 2, 1)}  # served, shown, clicks
    by_slot = {str(r[1]): float(r[2]) for r in run("CTR by slot")}
    assert by_slot == {"feed": 1.0, "splash": 0.5}
