"""`Processor.on_batch` (the user states folded per user, the vectors stepped as arrays:
`streams.fold`) gives what `on_event` gives event by event, bit for bit: the same user records,
pending labels, examples (and their JSON) and counts, whatever the batch boundaries."""

from __future__ import annotations

import functools
import random

import pytest

from schemas.codec import encode, example_json
from schemas.events import AdCreative, Message
from schemas.settings import Settings
from schemas.user_record import encode_state
from streams.processor import Processor
from workloads.config import MarketConfig
from workloads.market import Market


@functools.cache
def stream(n: int, seed: int) -> tuple[list[AdCreative], list[tuple[Message, bytes, float]]]:
    """A market's catalog and about n user events (with repeats, late ones and a few catalog
    updates among them), as (event, raw, ts)."""
    market = Market(MarketConfig(seed=seed, n_users=150, n_ads=40, rate=40.0))
    catalog: list[AdCreative] = []
    events: list[tuple[Message, bytes, float]] = []
    for e in market.open_loop(n):
        if isinstance(e, AdCreative) and not events:
            catalog.append(e)
        else:
            events.append((e, encode(e), e.ts.timestamp()))
        if len(events) >= n:
            break
    rnd = random.Random(seed)
    events += [events[rnd.randrange(len(events))] for _ in range(n // 20)]  # producer retries
    tail = events[-n // 5 :]
    rnd.shuffle(tail)  # out of order: late events, clicks before their impressions
    events[-n // 5 :] = tail
    return catalog, events


def _processor(s: Settings, catalog: list[AdCreative]) -> Processor:
    proc = Processor.from_settings(s)
    for ad in catalog[: len(catalog) - 5]:  # the last few ads arrive mid-stream (unknown until then)
        proc.on_event(ad)
    return proc


@pytest.mark.parametrize(
    "settings",
    [
        Settings(),
        Settings(online={"label_mode": "hold"}, streams={"attribution_window_s": 60.0}),
        Settings(state={"evidence_half_life": 3.0, "evidence_surprise": True, "max_intents": 3}),
        Settings(state={"feedback_lr": 0.0, "session_gap_s": 1.0}, online={"label_mode": "fn_calibrated"}),
    ],
    ids=["defaults", "hold", "forgetting", "sessions"],
)
@pytest.mark.parametrize("size", [1, 7, 500])
def test_a_batch_folds_to_what_its_events_give_one_by_one(settings: Settings, size: int) -> None:
    catalog, events = stream(1500, seed=11)
    late_ads = catalog[len(catalog) - 5 :]
    items: list[tuple[Message, bytes | None, float]] = [*events[:200], *((a, None, 0.0) for a in late_ads)]
    items += events[200:]
    one, batched = _processor(settings, catalog), _processor(settings, catalog)
    want = [x for event, raw, ts in items for x in one.on_event(event, raw, ts)]
    got = [x for i in range(0, len(items), size) for x in batched.on_batch(items[i : i + size])]
    assert len(want) > 20 and got == want
    assert [example_json(x) for x in got] == [example_json(x) for x in want]
    assert one.counts == batched.counts and one.counts["duplicate"] > 0 and one.counts["unknown_ad"] > 0
    assert one.join.counts == batched.join.counts and one.dirty_users == batched.dirty_users
    assert set(one.states) == set(batched.states)
    assert all(encode_state(one.states[u]) == encode_state(batched.states[u]) for u in one.states)
    assert set(one.join.pending) == set(batched.join.pending)
    assert all(one.join.pending[k].to_bytes() == p.to_bytes() for k, p in batched.join.pending.items())
