"""Hostile inputs without services: dead letters that always fit the producer, floats the models
hold, money that stays finite, a merge that one silent input cannot hold back for ever."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from streams_helpers import T0, at, click, creative, impression

from schemas.codec import decode, encode
from schemas.errors import SchemaError
from schemas.events import MAX_FEATURE, AdCreative, Conversion, DeadLetter, Impression, TrainingExample
from schemas.settings import Settings
from schemas.user_record import UserState
from streams.ingest import Invalid, dead_letter, validate
from streams.merge import Item, PartitionMerge
from streams.processor import AdVectors, Processor

# aiokafka's default `max_request_size`, which every producer of ours keeps
PRODUCER_LIMIT = 1024 * 1024
INPUTS = ("ad.impressions", "ad.clicks", "ad.dwell", "ad.conversions")


@pytest.mark.parametrize("size", [800_000, 1_048_576, 5_000_000])
def test_dead_letter_of_a_huge_record_fits_the_producer_and_says_it_was_cut(size: int) -> None:
    raw = b'{"event_id": "' + b"\xff" * size + b'"}'  # not UTF-8 either: the worst case for JSON
    out = validate("ad.impressions", "p.ad.impressions", 1, 2, raw, 1_767_225_600_000)
    assert isinstance(out, Invalid)
    wire = encode(out.dead_letter)
    assert len(wire) < PRODUCER_LIMIT // 2, len(wire)
    dl = decode(DeadLetter, wire)
    assert isinstance(dl, DeadLetter)
    assert raw.startswith(dl.raw) and len(dl.raw) < len(raw)
    assert dl.raw_size == len(raw) and dl.raw_sha256 == hashlib.sha256(raw).hexdigest()
    assert "truncated" in dl.error


def test_dead_letter_with_the_longest_error_still_fits() -> None:
    # an error of control characters is escaped 6× by JSON; the topic name is the longest allowed
    error = "\x01" * 10_000
    out = dead_letter("t" * 249, 2**31 - 1, 2**62, b"\x00" * 10_000_000, 2**41, error, "invalid")
    assert len(encode(out.dead_letter)) < PRODUCER_LIMIT // 2


def test_small_dead_letter_keeps_every_byte() -> None:
    out = validate("ad.clicks", "ad.clicks", 0, 0, b"{oops", 0)
    assert isinstance(out, Invalid)
    assert out.dead_letter.raw == b"{oops" and out.dead_letter.raw_size is None


def _example(**over: object) -> dict[str, object]:
    base = json.loads(
        TrainingExample(
            event_id="te1", ts=T0, adapter_id="feed", impression_id="i1", impression_ts=T0, user_id="u1",
            ad_id="ad1", campaign_id="c1", advertiser_id="v1", category="shoes", slot="feed",
            position=0, hour=12, user_vector=[0.1, 0.2], intent_score=1.0, click=True,
        ).model_dump_json()
    )  # fmt: skip
    return {**base, **over}


@pytest.mark.parametrize(
    ("field", "value"),
    [("intent_score", 1e39), ("intent_score", -1e39), ("recall_score", 3.5e38), ("user_vector", [0.0, 1e39])],
)
def test_training_example_floats_must_hold_in_float32(field: str, value: object) -> None:
    with pytest.raises(SchemaError, match=field):
        decode(TrainingExample, json.dumps(_example(**{field: value})).encode())


def test_every_accepted_feature_float_is_finite_in_float32() -> None:
    edge = _example(intent_score=MAX_FEATURE, recall_score=-MAX_FEATURE, user_vector=[MAX_FEATURE])
    ex = decode(TrainingExample, json.dumps(edge).encode())
    assert isinstance(ex, TrainingExample)
    values = np.array([ex.intent_score, ex.recall_score, *ex.user_vector], dtype=np.float32)
    assert np.isfinite(values).all()


@pytest.mark.parametrize(
    ("model", "field"),
    [(Conversion, "value"), (AdCreative, "bid"), (AdCreative, "daily_budget"), (Impression, "price")],
)
def test_money_has_an_upper_bound(model: type, field: str) -> None:
    if model is AdCreative:
        good = json.loads(encode(creative()))
    elif model is Impression:
        good = json.loads(encode(impression("i1", 0)))
    else:
        good = {
            "event_id": "cv1", "ts": at(0).isoformat(), "user_id": "u1", "campaign_id": "c1",
            "advertiser_id": "v1", "value": 1.0, "kind": "conversion",
        }  # fmt: skip
    decode(model, json.dumps(good).encode())
    with pytest.raises(SchemaError, match=field):
        decode(model, json.dumps({**good, field: 1.7e308}).encode())


def _imp(offset: int, t: float) -> Item:
    ev = impression(f"i{offset}", t)
    return Item("ad.impressions", offset, ev, ev.ts.timestamp())


def test_a_silent_input_holds_the_merge_back_only_for_max_idle_s() -> None:
    merge = PartitionMerge(max_idle_s=5.0)
    for off in range(3):
        merge.push(_imp(off, off))
    never = lambda topic, last: False  # noqa: E731  (clicks never answer)
    assert list(merge.release(never, INPUTS, now=100.0)) == []
    assert list(merge.release(never, INPUTS, now=104.0)) == []
    out = list(merge.release(never, INPUTS, now=105.0))
    assert [it.offset for it in out] == [0, 1, 2]
    assert merge.forced == 3  # clicks, dwell and conversions were passed over once each
    # a record arriving on the silent input makes it count again
    merge.push(Item("ad.clicks", 0, click("c0", 10, "i0"), at(10).timestamp()))
    merge.push(_imp(3, 11))
    assert [it.offset for it in merge.release(never, INPUTS, now=106.0)] == [0]  # the click
    assert list(merge.release(never, INPUTS, now=110.0)) == []
    assert [it.offset for it in merge.release(never, INPUTS, now=111.0)] == [3]
    assert merge.forced == 4


def test_a_silent_input_holds_back_at_most_max_buffered_records() -> None:
    merge = PartitionMerge(max_buffered=4)
    never = lambda topic, last: False  # noqa: E731
    for off in range(3):
        merge.push(_imp(off, off))
    assert list(merge.release(never, INPUTS, now=0.0)) == []
    merge.push(_imp(3, 3))
    assert [it.offset for it in merge.release(never, INPUTS, now=0.0)] == [0, 1, 2, 3]


def test_merge_without_bounds_still_waits_for_ever() -> None:
    merge = PartitionMerge()
    merge.push(_imp(0, 0))
    assert list(merge.release(lambda t, last: False, INPUTS, now=1e12)) == []


def test_a_huge_intent_score_never_stops_the_join() -> None:
    """The worker builds TrainingExamples from user state: a state beyond the contract's feature
    bound (a bot clicking millions of times) must give a valid example, not a crashed worker."""
    catalog = AdVectors(4)
    catalog.update(creative())
    proc = Processor.from_settings(Settings(state_dim=4), catalog)
    t = at(0).timestamp()
    proc.states["u1"] = UserState(
        user_id="u1", dim=4, vector=np.array([1e30, 0, 0, 0], dtype=np.float32),
        intents={"shoes": 1e300}, last_ts=t, session_start_ts=t, events=1, version=1,
    )  # fmt: skip
    proc.on_event(impression("i1", 0))
    out = proc.on_event(click("c1", 1, "i1"))
    assert len(out) == 1 and out[0].click
    assert abs(out[0].intent_score) <= MAX_FEATURE and max(map(abs, out[0].user_vector)) <= MAX_FEATURE


@pytest.mark.filterwarnings("ignore:overflow encountered in dot:RuntimeWarning")  # as the worker does
def test_the_feature_bound_check_is_the_component_wise_one() -> None:

    from streams.processor import within_bound

    edge = np.nextafter(np.float32(MAX_FEATURE), np.float32(np.inf))  # the first float32 over it
    rng = np.random.default_rng(0)
    cases = [
        [MAX_FEATURE], [edge], [-edge], [MAX_FEATURE, -MAX_FEATURE], [0.0] * 31 + [edge],
        [9e5] * 32, [1e5] * 32, [np.nan], [np.inf], [-np.inf], [1e20], [3e19, 1.0], [],
        *(rng.normal(0, scale, 32) for scale in (1.0, 3e5, 1e6, 1e7)),
    ]  # fmt: skip
    for values in cases:
        vec = np.asarray(values, dtype=np.float32)
        want = bool(np.abs(vec).max() <= MAX_FEATURE) if len(vec) else True
        assert within_bound(vec) == want, values
