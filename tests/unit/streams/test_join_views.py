"""Served, shown, billed in the label join (`schemas.billing`): a render beacon makes a served
impression shown once; CPM pays on that showing, CPC on the first click; duplicate, late and
unserved beacons are counted and never billed; server-rendered slots are shown when served."""

from __future__ import annotations

import numpy as np
import pytest
from streams_helpers import at, click, creative, impression

from schemas.billing import cost_when_clicked, cost_when_shown, counts_as_shown, day_of
from schemas.events import BidType, Impression, Render, View
from schemas.settings import Settings
from streams.join import _PENDING, Pending
from streams.processor import Processor

S = Settings(streams={"attribution_window_s": 60.0, "watermark_window": 1}, online={"label_mode": "hold"})


def served(
    eid: str, t: float, bid_type: BidType | None = "cpm", render: Render | None = "client"
) -> Impression:
    imp = impression(eid, t)
    return imp.model_copy(update={"bid_type": bid_type, "render": render, "price": 2.0, "pctr": 0.05})


def view(eid: str, t: float, imp: str) -> View:
    return View(event_id=eid, ts=at(t), user_id="u1", impression_id=imp, ad_id="ad1")


def run(events: list) -> Processor:  # type: ignore[type-arg]
    proc = Processor.from_settings(S)
    proc.on_batch([(creative(), None, at(-1).timestamp())])
    proc.on_batch([(e, None, e.ts.timestamp()) for e in events])
    return proc


def test_the_first_view_makes_a_cpm_impression_shown_and_billed_once() -> None:
    proc = run([served("i1", 0), view("v1", 2, "i1"), view("v1", 2, "i1"), view("v2", 3, "i1")])
    join = proc.join
    assert [(v.event_id, ts) for v, ts in join.views] == [("v1", at(2).timestamp())]
    assert join.billed == [("camp-ad1", at(2).timestamp(), pytest.approx(0.002))]
    assert join.pending["i1"].shown and "i1" in join.dirty
    assert join.counts["shown"] == 1 and join.counts["view_repeat"] == 2


def test_a_served_ad_never_shown_costs_nothing_and_is_no_view() -> None:
    join = run([served("i1", 0), served("i2", 1, "cpc")]).join
    assert join.views == [] and join.billed == [] and not join.pending["i1"].shown


def test_cpc_pays_its_price_on_the_first_click_only_and_nothing_on_views() -> None:
    join = run([served("i1", 0, "cpc"), view("v1", 1, "i1"), click("c1", 2, "i1"), click("c2", 3, "i1")]).join
    assert [v.event_id for v, _ in join.views] == ["v1"]  # shown (attribution's view), not billed
    assert join.billed == [("camp-ad1", at(2).timestamp(), 2.0)]


def test_a_click_of_a_shown_cpm_impression_costs_nothing_more() -> None:
    join = run([served("i1", 0), view("v1", 1, "i1"), click("c1", 2, "i1")]).join
    assert join.billed == [("camp-ad1", at(1).timestamp(), pytest.approx(0.002))]
    assert join.pending["i1"].clicked and join.pending["i1"].shown


def test_server_rendered_slots_are_shown_and_billed_when_served() -> None:
    join = run([served("i1", 0, "cpm", "server"), view("v1", 1, "i1")]).join
    assert join.pending["i1"].shown and join.views == []  # the beacon adds nothing
    assert join.billed == [("camp-ad1", at(0).timestamp(), pytest.approx(0.002))]
    assert join.counts["view_repeat"] == 1


def test_impressions_from_before_bid_types_are_shown_and_billed_their_price_when_served() -> None:
    legacy = impression("i1", 0)  # no bid_type, no render: the rollups' old rule, now everyone's
    assert counts_as_shown(legacy) and cost_when_shown(legacy) == 0.5 and cost_when_clicked(legacy) == 0.0
    join = run([legacy, click("c1", 1, "i1"), click("c2", 2, "i1")]).join
    assert join.pending["i1"].shown and join.billed == [("camp-ad1", at(0).timestamp(), 0.5)]


def test_a_late_view_is_counted_not_billed() -> None:
    join = run([served("i1", 0), view("v1", 61, "i1")]).join  # the window is 60 s
    assert join.views == [] and join.billed == [] and join.counts["view_late"] == 1


def test_a_view_before_its_impression_is_applied_when_it_comes() -> None:
    join = run([view("v1", 1, "i1"), served("i1", 0)]).join
    assert [v.event_id for v, _ in join.views] == ["v1"]
    assert join.billed == [("camp-ad1", at(1).timestamp(), pytest.approx(0.002))]


def test_a_view_of_an_ad_never_served_expires_unserved_and_unbilled() -> None:
    join = run([view("v1", 1, "nope"), served("i9", 100)]).join  # stream time passes its window
    assert join.views == [] and join.billed == [] and join.counts["view_unserved"] == 1


def test_pending_keeps_shown_and_reads_records_from_before_it() -> None:
    join = run([served("i1", 0), view("v1", 2, "i1"), click("c1", 3, "i1")]).join
    p = join.pending["i1"]
    back = Pending.from_bytes(p.to_bytes())
    assert back.same(p) and back.shown and back.clicked
    # a record written before `shown` existed: its flags byte is the old `clicked` (0 or 1)
    old = bytearray(p.to_bytes())
    old[16] = 1  # deadline (8), intent (8), then the flags byte
    assert _PENDING.unpack_from(bytes(old), 0)[2] == 1
    restored = Pending.from_bytes(bytes(old))
    assert restored.clicked and not restored.shown


def test_a_restored_shown_impression_is_not_billed_again() -> None:
    first = run([served("i1", 0), view("v1", 2, "i1")])
    again = Processor.from_settings(S)
    again.join.load({"i1": Pending.from_bytes(first.join.pending["i1"].to_bytes())})
    again.on_batch([(view("v2", 3, "i1"), None, at(3).timestamp())])
    assert again.join.billed == [] and again.join.views == []


def test_spend_days_are_utc() -> None:
    assert day_of(at(0).timestamp()) == "20260101"
    assert np.isclose(cost_when_shown(served("i1", 0)), 0.002)  # CPM price 2.0 per thousand


# -- training learns what billing bills (issue 34 item 3): an example only of a shown impression


def _examples(events: list, settings: Settings = S) -> tuple[list, Processor]:  # type: ignore[type-arg]
    proc = Processor.from_settings(settings)
    proc.on_batch([(creative(), None, at(-1).timestamp())])
    out = proc.on_batch([(e, None, e.ts.timestamp()) for e in events])
    return [(e.impression_id, e.label_kind, e.click) for e in out], proc


def test_a_served_ad_never_shown_is_no_training_example_and_is_counted() -> None:
    got, proc = _examples([
        served("i1", 0),  # client-rendered, no beacon: the user never saw it
        served("i2", 0, "cpc", "server"),  # shown when served
        served("i3", 1, "cpc"), view("v3", 2, "i3"),  # shown at its beacon
        impression("i4", 1),  # from before render beacons: shown when served
        served("i9", 100),  # stream time passes every window above
    ])  # fmt: skip
    assert sorted(got) == [("i2", "final", False), ("i3", "final", False), ("i4", "final", False)]
    assert proc.join.counts["unshown"] == 1 and proc.join.counts["negative"] == 3
    assert all(counts_as_shown(e) for e in (served("x", 0, "cpc", "server"), impression("y", 0)))


def test_a_click_shows_its_impression_billed_and_learned_once() -> None:
    # no beacon before the click (lost, blocked, late): a click implies the ad was seen
    got, proc = _examples([served("i1", 0), click("c1", 2, "i1"), view("v1", 3, "i1"), served("i9", 100)])
    join = proc.join
    assert got == [("i1", "final", True)]
    assert join.billed == [("camp-ad1", at(2).timestamp(), pytest.approx(0.002))]  # its showing, once
    assert [v.event_id for v, _ in join.views] == ["v1"]  # the beacon is still the stored view
    assert join.counts["unshown"] == 0


def test_fake_negatives_are_emitted_at_the_showing_never_for_an_unshown_ad() -> None:
    fn = S.model_copy(update={"online": S.online.model_copy(update={"label_mode": "fn_weighted"})})
    got, proc = _examples(
        [
            served("i1", 0),  # never shown
            served("i2", 0),
            view("v2", 3, "i2"),  # its fake negative now, at the view
            served("i3", 1, "cpc"),
            click("c3", 4, "i3"),  # shown by its click: fake negative, then the click
            impression("i4", 5),  # shown when served: at once
            served("i9", 100),
        ],
        fn,
    )
    assert got == [
        ("i2", "fake_negative", False),
        ("i3", "fake_negative", False),
        ("i3", "click", True),
        ("i4", "fake_negative", False),
    ]
    assert proc.join.counts["unshown"] == 1  # i1
    assert proc.join.close_all() == [] and proc.join.counts["unshown"] == 2  # i9 at the end of input
