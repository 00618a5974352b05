"""Poisoned time (reliability H3) and orphan rescans (H4): stream time one record cannot drag."""

from __future__ import annotations

import time
from datetime import timedelta

import numpy as np
import pytest
from streams_helpers import T0, at, click, creative, dwell, impression

from schemas.settings import Settings
from schemas.watermark import Watermark
from streams.in_memory import training_examples
from streams.ingest import ahead_of_record
from streams.join import LabelJoin

DAY = 86_400.0
VEC = np.zeros(2, dtype=np.float32)


def test_watermark_ignores_a_minority_of_far_future_records() -> None:
    wm = Watermark(window=8)
    for t in range(20):
        wm.observe(float(t))
    before = wm.value
    assert 14.0 <= before < 19.0
    for _ in range(4):  # half a window of records dated a day ahead: no effect
        assert wm.observe(19.0 + DAY) < 20.0
    wm.observe(float("nan"))
    assert wm.value < 20.0
    for t in range(20, 40):  # real time goes on, the outliers age out of the window
        wm.observe(float(t))
    assert 34.0 <= wm.value < 40.0
    wm.observe(-DAY)  # a record from the past never moves it back
    assert wm.value >= 34.0
    with pytest.raises(ValueError, match="window"):
        Watermark(window=0)


def _join_with_traffic(n: int, window_s: float = 60.0) -> LabelJoin:
    """A join that has seen `n` impressions one second apart (user u1), windows still open."""
    j = LabelJoin(window_s)
    for t in range(n):
        imp = impression(f"i{t}", t)
        j.on_impression(imp, "shoes", VEC, 0.0)
        j.advance(imp.ts.timestamp())
    return j


def test_one_far_future_event_closes_no_window() -> None:
    j = _join_with_traffic(40)
    assert not any(p.clicked for p in j.pending.values()) and len(j.pending) == 40
    poison = impression("poison", 23 * 3600)  # within the old 24 h skew allowance
    j.on_impression(poison, "shoes", VEC, 0.0)
    closed = j.advance(poison.ts.timestamp())
    assert closed == [], "one record dated 23 h ahead closed every open window"
    assert j.stream_ts < at(41).timestamp()
    # the real click that follows is joined, not counted as late
    out = j.on_click(click("c5", 42, "i5"), at(42).timestamp())
    assert [(e.impression_id, e.click) for e in out] == [("i5", True)]
    assert j.counts["late"] == 0


def test_windows_still_close_as_real_time_passes() -> None:
    events = [creative()] + [impression(f"i{t}", t) for t in range(0, 200, 2)]
    out = list(
        training_examples(events, Settings(streams={"attribution_window_s": 60.0}), close_open_windows=False)
    )
    closed = [e for e in out if not e.click]
    # impressions up to ~t=100 have closed (windows of 60 s, clock lagging by half a window of records)
    assert 30 <= len(closed) <= 70
    assert all(e.ts.timestamp() == pytest.approx(e.impression_ts.timestamp() + 60) for e in closed)


def test_a_restored_clock_is_a_floor() -> None:
    j = LabelJoin(60.0)
    j.stream_ts = at(1000).timestamp()  # as the worker restores it from Redis
    j.on_impression(impression("old", 10), "shoes", VEC, 0.0)
    assert j.advance(at(11).timestamp()) == [] and j.stream_ts == at(1000).timestamp()
    assert j.on_click(click("c", 20, "gone"), at(20).timestamp()) == [] and j.counts["late"] == 1


class _CountingDict(dict):  # type: ignore[type-arg]
    """Counts the entries a caller walks over (items/keys/values/iteration)."""

    visited = 0

    def items(self):  # type: ignore[no-untyped-def,override]
        _CountingDict.visited += len(self)
        return super().items()

    def __iter__(self):  # type: ignore[no-untyped-def]
        _CountingDict.visited += len(self)
        return super().__iter__()


def test_orphans_are_not_rescanned_on_every_advance() -> None:
    j = LabelJoin(60.0)
    j.orphans = _CountingDict()
    _CountingDict.visited = 0
    for k in range(2000):  # clicks whose impression never arrives
        j.on_click(click(f"c{k}", 0.001 * k, f"missing{k}"), at(0.001 * k).timestamp())
    assert len(j.orphans) == 2000
    for t in range(2000):
        j.advance(at(2 + 0.01 * t).timestamp())  # 2000 advances, none expires an orphan
    assert len(j.orphans) == 2000
    assert _CountingDict.visited < 10 * 2000, f"{_CountingDict.visited} orphan visits for 2000 advances"
    for t in range(100):
        j.advance(at(100 + t).timestamp())
    assert len(j.orphans) == 0 and j.counts["orphan_expired"] == 2000


def test_orphan_joined_by_its_impression_is_not_expired_later() -> None:
    j = LabelJoin(60.0)
    j.on_click(click("c1", 1, "i1"), at(1).timestamp())
    out = j.on_impression(impression("i1", 0), "shoes", VEC, 0.0, ts=at(0).timestamp())
    assert [e.click for e in out] == [True]
    j.on_dwell(dwell("d2", 3, "i2", 500), at(3).timestamp())
    for t in range(200):
        j.advance(at(10 + t).timestamp())
    assert j.counts["orphan_expired"] == 1 and not j.orphans


def test_event_ahead_of_wall_clock_is_dead_lettered_whatever_its_record_says() -> None:
    now = time.time()
    ahead = timedelta(seconds=now - T0.timestamp() + 2 * 3600)
    ev = impression("far", 0.0).model_copy(update={"ts": T0 + ahead})
    assert ev.ts.timestamp() == pytest.approx(now + 2 * 3600)
    skew = 1800.0
    # no record timestamp: judged against the wall clock
    bad = ahead_of_record(ev, "t.ad.clicks", 0, 1, b"{}", -1, skew, now_s=now)
    assert bad is not None and bad.reason == "future_timestamp"
    bad0 = ahead_of_record(ev, "t.ad.clicks", 0, 1, b"{}", 0, skew, now_s=now)
    assert bad0 is not None
    # a producer that also sets its record's CreateTime ahead: capped by the wall clock
    record_ms = int(ev.ts.timestamp() * 1000)
    forged = ahead_of_record(ev, "t.ad.clicks", 0, 1, b"{}", record_ms, skew, now_s=now)
    assert forged is not None and "wall clock" in forged.dead_letter.error
    # an old record replayed later is still judged against its own timestamp (deterministic)
    past = impression("old", 0.0)
    rec = int(past.ts.timestamp() * 1000)
    assert ahead_of_record(past, "t.ad.clicks", 0, 1, b"{}", rec, skew, now_s=now) is None
    assert ahead_of_record(past, "t.ad.clicks", 0, 1, b"{}", rec - 3_600_000, skew, now_s=now) is not None


def test_default_skew_is_within_the_attribution_window() -> None:
    s = Settings()
    assert s.streams.max_event_skew_s <= s.streams.attribution_window_s


def test_orphans_are_bounded_in_number_oldest_evicted_first() -> None:
    j = LabelJoin(60.0, max_orphans=100)
    for k in range(250):
        j.on_click(click(f"c{k}", 0.01 * k, f"missing{k}"), at(0.01 * k).timestamp())
    assert len(j.orphans) == 100 and j.counts["orphan_evicted"] == 150
    assert "missing249" in j.orphans and "missing149" not in j.orphans
