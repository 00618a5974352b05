"""The label join and the offline replay: positives at click time, negatives at window close."""

from __future__ import annotations

import numpy as np
import pytest
from streams_helpers import click, creative, dwell, impression

from schemas.events import Impression
from schemas.ids import adapter_id_for as adapter_id
from schemas.settings import Settings
from streams.in_memory import replay, training_examples
from streams.join import LabelJoin, Pending, example_id

# hold mode (fake negatives: test_join_fake_negatives.py); a watermark window of 1 record is the
# running max: these tests are about the join's rules; the
# watermark that one record cannot drag (the default) is tested in test_watermark.py
S = Settings(streams={"attribution_window_s": 60.0, "watermark_window": 1}, online={"label_mode": "hold"})


def test_adapter_id_schemes() -> None:
    assert adapter_id("feed", "acme", "slot") == "feed"
    assert adapter_id("feed", "acme", "advertiser") == "adv:acme"
    assert adapter_id("feed", "acme", "slot+advertiser") == "feed/adv:acme"
    long = adapter_id("search", "x" * 64, "slot+advertiser")
    assert len(long) <= 64 and long != adapter_id("search", "x" * 63 + "y", "slot+advertiser")


def test_positive_at_click_negative_at_window_close() -> None:
    events = [
        creative(),
        impression("i1", 0),
        impression("i2", 1),
        click("c1", 5, "i1"),
        dwell("d2", 6, "i2", 4000),
        impression("i3", 100),  # moves stream time past both windows
    ]
    out = list(training_examples(events, S, close_open_windows=False))
    assert [(e.impression_id, e.click) for e in out] == [("i1", True), ("i2", False)]
    pos, neg = out
    assert pos.ts == click("c1", 5, "i1").ts and pos.adapter_id == "feed" and pos.category == "shoes"
    assert neg.ts.timestamp() == pytest.approx(impression("i2", 1).ts.timestamp() + 60)
    assert neg.dwell_ms == 4000 and pos.event_id == example_id("i1")
    assert pos.hour == 12 and pos.impression_ts.hour == 12
    # the second impression's features include the first impression and click
    assert any(abs(x) > 0 for x in neg.user_vector) and neg.intent_score > 0
    assert all(x == 0 for x in pos.user_vector) and pos.intent_score == 0


def test_close_all_emits_open_windows() -> None:
    out = list(training_examples([creative(), impression("i1", 0)], S))
    assert len(out) == 1 and not out[0].click


def test_duplicates_late_and_out_of_order_are_counted() -> None:
    events = [
        creative(),
        click("c0", 1, "i0"),  # before its impression: out of order, joined when it arrives
        impression("i0", 0),
        impression("i1", 2),
        impression("i1", 2),  # producer retry: same event id
        click("c1", 3, "i1"),
        click("c1b", 4, "i1"),  # a second click on the same impression
        impression("i9", 500),
        click("c9", 200, "i1"),  # the window of i1 closed long ago
    ]
    r = replay(events, S)
    assert [(e.impression_id, e.click) for e in r.examples] == [("i0", True), ("i1", True)]
    assert r.counts["duplicate"] == 1
    assert r.counts["out_of_order"] == 1
    assert r.counts["repeat_click"] == 1
    assert r.counts["late"] == 1
    st = r.states["u1"]
    assert st.impressions == 3 and st.clicks == 4 and st.late == 2


def test_pending_round_trip() -> None:
    j = LabelJoin(60.0)
    imp: Impression = impression("i1", 0)
    j.on_impression(imp, "shoes", np.array([0.5, -0.25], dtype=np.float32), 0.3)
    data = j.pending["i1"].to_bytes()
    back = Pending.from_bytes(data)
    assert back.same(j.pending["i1"])
    back.dwell_ms = 5
    assert not back.same(j.pending["i1"])
    assert j.dirty == {"i1"}


def test_one_example_per_impression_many_users() -> None:
    events = [creative()]
    for u in range(20):
        for k in range(5):
            t = u * 3 + k * 10
            events.append(impression(f"i{u}-{k}", t, user=f"u{u}"))
            if k % 2 == 0:
                events.append(click(f"c{u}-{k}", t + 1, f"i{u}-{k}", user=f"u{u}"))
    events.sort(key=lambda e: e.ts)
    out = list(training_examples(events, S))
    assert len(out) == 100 and len({e.impression_id for e in out}) == 100
    assert sum(e.click for e in out) == 60


def test_every_ab_arm_and_explored_impression_trains() -> None:
    # the control and correction arms are served without adapters, but their labels still train
    # them; an explored pick is a label like any other (its propensity only weighs off-policy reads)
    arms = {
        "i1": ("control", 1.0, False),
        "i2": ("correction", 0.0125, True),
        "i3": ("learning", 0.95, False),
    }
    events = [creative()]
    for k, (eid, (arm, p, explored)) in enumerate(arms.items()):
        events.append(
            impression(eid, k).model_copy(update={"ab_arm": arm, "propensity": p, "explored": explored})
        )
    events.append(click("c1", 5, "i1"))
    out = list(training_examples(events, S))
    assert sorted(e.impression_id for e in out) == ["i1", "i2", "i3"]
    assert {e.impression_id for e in out if e.click} == {"i1"}
