"""DelayBuffer: release by event-time watermark, in impression order; commit bound."""

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
    buf = DelayBuffer(delay_s=20.0)
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
