"""`Processor.on_batch_json` (the worker's path: the fake negatives built as bytes, as a batch,
`streams.join.fake_negatives_json`) gives the adapter ids and the bytes `example_json` gives the
examples `on_batch` makes, in the same order, with the same states, pending labels and counts."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta, timezone

import numpy as np
import pytest
from streams_helpers import at, click, creative, dwell, impression
from test_streams_fold import _processor, stream

from schemas.codec import encode, example_json
from schemas.events import Impression, Message, TrainingExample, View
from schemas.settings import Settings
from schemas.user_record import encode_state
from streams.processor import Processor

Items = list[tuple[Message, bytes | None, float]]


def _same(one: Processor, two: Processor, items: Items, size: int) -> list[tuple[str, bytes]]:
    """`on_batch` on `one`, `on_batch_json` on `two`, batch by batch: equal in every respect."""
    want, got = [], []
    for i in range(0, len(items), size):
        want += [(e.adapter_id, example_json(e)) for e in one.on_batch(items[i : i + size])]
        got += two.on_batch_json(items[i : i + size])
    assert got == want
    assert one.counts == two.counts and one.join.counts == two.join.counts
    assert one.dirty_users == two.dirty_users and set(one.states) == set(two.states)
    assert all(encode_state(one.states[u]) == encode_state(two.states[u]) for u in one.states)
    assert set(one.join.pending) == set(two.join.pending)
    assert all(one.join.pending[k].to_bytes() == p.to_bytes() for k, p in two.join.pending.items())
    assert (one.join.billed, one.join.views) == (two.join.billed, two.join.views)
    assert not one.join.deferring and not two.join.deferring
    return got


@pytest.mark.parametrize(
    "settings",
    [
        Settings(),
        Settings(online={"label_mode": "fn_calibrated"}, adapter_scheme="advertiser"),
        Settings(online={"label_mode": "hold"}, streams={"attribution_window_s": 60.0}),
        Settings(adapter_scheme="slot+advertiser", streams={"attribution_window_s": 30.0}),
    ],
    ids=["defaults", "calibrated-advertiser", "hold", "slot+advertiser"],
)
@pytest.mark.parametrize("size", [1, 7, 500])
def test_the_worker_s_examples_are_the_bytes_of_the_batch_s_examples(settings: Settings, size: int) -> None:
    catalog, events = stream(1500, seed=11)
    got = _same(_processor(settings, catalog), _processor(settings, catalog), list(events), size)
    assert len(got) > 20
    kinds = {TrainingExample.model_validate_json(value).label_kind for _, value in got}
    assert kinds >= ({"final"} if settings.online.label_mode == "hold" else {"fake_negative", "click"})


FN = Settings(streams={"attribution_window_s": 60.0, "watermark_window": 1})


def _client(eid: str, t: float, user: str = "u1") -> Impression:
    """A client-rendered CPM impression: shown by its beacon (or its click), not when served."""
    return impression(eid, t, user).model_copy(update={"render": "client", "bid_type": "cpm", "price": 2.0})


def _view(eid: str, t: float, imp: str) -> View:
    return View(event_id=eid, ts=at(t), user_id="u1", impression_id=imp, ad_id="ad1")


def _cases() -> Items:
    east = impression("ie", 4)
    east = east.model_copy(update={"ts": east.ts.astimezone(timezone(timedelta(hours=2)))})
    events: list[Message] = [
        impression("i1", 0),  # shown when served: its fake negative at once
        dwell("d1", 0.5, "i1", 900),  # later in the batch: the fake negative keeps dwell 0
        _client("i2", 1),
        _view("v2", 2, "i2"),  # shown by its beacon: the fake negative at the view's time
        _client("i3", 2.5),
        click("c3", 3, "i3"),  # clicked before any beacon: shown (and learned) at the click
        _view("v5", 3.2, "i5"),  # the beacon before its impression: an orphan, joined later
        click("c6", 3.4, "i6"),  # a click before its impression
        east,  # a +02:00 time: the example's time is a UTC copy
        _client("i5", 5),
        impression("i6", 5.5),
        impression("i7", 3600 * 5 + 7, user="u2"),  # another hour, another user
        impression("i1", 0),  # a producer's retry: a duplicate, nothing
    ]
    return [(e, None, e.ts.timestamp()) for e in events]


@pytest.mark.parametrize("size", [1, 3, 100])
def test_every_way_an_impression_is_first_shown_gives_the_same_bytes(size: int) -> None:
    one, two = (Processor.from_settings(FN) for _ in range(2))
    for proc in (one, two):
        proc.on_event(creative())
        # a bot's state far beyond the contract's bound: its features are clipped (`_bounded`)
        proc.on_batch([(impression("b0", -10, user="bot"), None, at(-10).timestamp())])
        proc.states["bot"] = replace(proc.states["bot"], vector=np.full(proc.dim, 3e38, dtype=np.float32))
    items = [*_cases(), (impression("b1", 6, user="bot"), None, at(6).timestamp())]
    got = _same(one, two, items, size)
    examples = [TrainingExample.model_validate_json(value) for _, value in got]
    assert [encode(e) for e in examples] == [value for _, value in got]  # the contract's own bytes
    fake = {e.impression_id: e for e in examples if e.label_kind == "fake_negative"}
    assert set(fake) == {"i1", "i2", "i3", "i5", "i6", "ie", "i7", "b1"}
    assert fake["i1"].dwell_ms == 0 and fake["i1"].ts == at(0)
    assert fake["i2"].ts == at(2) and fake["i3"].ts == at(3) and fake["i5"].ts == at(5)
    assert fake["ie"].ts == at(4) and fake["ie"].ts.utcoffset() == timedelta(0)
    assert fake["i7"].hour == (at(3600 * 5 + 7).hour) and fake["i7"].user_id == "u2"
    assert max(fake["b1"].user_vector) == 1e6  # clipped to MAX_FEATURE
