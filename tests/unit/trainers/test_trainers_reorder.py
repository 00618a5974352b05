"""DelayBuffer: release by event-time watermark, in impression order; commit bound; one
far-future example cannot release what is held (reliability H3)."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
from helpers_trainers import make_examples

from trainers.reorder import DelayBuffer


def test_release_after_window_in_impression_order() -> None:
    exs = make_examples(50, dim=2)
    shuffled = exs[:]
    random.Random(0).shuffle(shuffled)
    buf = DelayBuffer(delay_s=20.0, watermark_window=1)  # a window of 1: the running max
    for off, e in enumerate(shuffled):
        buf.push(e, off % 2, off)
    first = buf.pop_ready()  # watermark T0 + 49 s: impressions up to T0 + 29 s are due
    assert [e.impression_id for e, _ in first] == [e.impression_id for e in exs[:30]]
    tick = exs[0].model_copy(
        update={"event_id": "t", "impression_id": "t", "ts": exs[0].ts + timedelta(seconds=69)}
    )
    buf.push(tick, 0, 99)
    rest = buf.pop_ready()
    times = [e.impression_ts for e, _ in rest]
    assert times == sorted(times) and len(rest) == 21  # T0+30 … T0+49 and the tick
    assert len(buf) == 0 and buf.low_offsets() == {}


def test_low_offsets_and_drain() -> None:
    exs = make_examples(6, dim=2)
    buf = DelayBuffer(delay_s=1000.0)
    for off, e in zip([5, 3, 9, 4, 8, 7], exs, strict=True):
        buf.push(e, off % 2, off)
    assert buf.low_offsets() == {1: 3, 0: 4}
    drained = buf.drain()
    assert [e.impression_id for e, _ in drained] == [e.impression_id for e in exs]
    with pytest.raises(ValueError, match="delay_s"):
        DelayBuffer(-1)


def test_one_far_future_example_releases_nothing() -> None:
    exs = make_examples(40, dim=2)  # emitted at T0 … T0 + 39 s
    buf = DelayBuffer(delay_s=30.0)
    for off, e in enumerate(exs):
        buf.push(e, 0, off)
    assert buf.pop_ready() == []  # the watermark (about T0 + 23 s) is before every T0 + 30 s
    poison = exs[-1].model_copy(
        update={"event_id": "p", "impression_id": "p", "ts": exs[-1].ts + timedelta(hours=23)}
    )
    buf.push(poison, 0, 40)
    assert buf.pop_ready() == [], "one example dated 23 h ahead released everything held"
    assert buf.watermark is not None and buf.watermark < exs[-1].ts
    more = make_examples(80, seed=1, dim=2)[40:]  # real time goes on: T0 + 40 … 79 s
    for off, e in enumerate(more, start=41):
        buf.push(e, 0, off)
    released = [e.impression_id for e, _ in buf.pop_ready()]
    assert released[:3] == ["imp0-0", "imp0-1", "imp0-2"] and "p" not in released
