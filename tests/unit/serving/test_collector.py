"""The event collector's pure core: each refused event named by index, field and reason; batch
limits; the per-key token bucket on a fake clock."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from schemas import topics
from schemas.events import Impression
from schemas.ids import impression_event_id
from schemas.signing import click_token, sign_impression
from serving.collector import BatchRefused, Limits, TokenBucket, judge_batch, parse_batch, retry_after

KEY = b"k" * 32
LIMITS = Limits(max_body_bytes=64 * 1024, max_events=10)
TS = "2026-12-03T10:00:00+00:00"


def click(user: str = "u1", ad: str = "ad1", **over: Any) -> dict[str, Any]:
    iid = impression_event_id("r1", 0)
    ev = {
        "kind": "click",
        "event_id": f"c/{iid}",
        "ts": TS,
        "user_id": user,
        "impression_id": iid,
        "ad_id": ad,
        "campaign_id": "c1",
        "click_token": click_token(KEY, iid, user, ad),
    }
    ev.update(over)
    return ev


def impression(key: bytes | None = KEY) -> dict[str, Any]:
    imp = Impression(
        event_id="r1/0",
        ts=datetime(2026, 12, 3, 10, tzinfo=UTC),
        user_id="u1",
        request_id="r1",
        ad_id="ad1",
        campaign_id="c1",
        advertiser_id="v1",
        slot="feed",
        position=0,
        price=0.5,
    )
    if key is not None:
        imp = sign_impression(imp, key)
    return {k: v for k, v in json.loads(imp.model_dump_json()).items() if v is not None}


def batch(*events: Any) -> bytes:
    return json.dumps({"events": list(events)}).encode()


def only_rejection(*events: Any) -> tuple[int, str, str]:
    v = judge_batch(batch(*events), LIMITS, KEY)
    assert len(v.rejected) == 1, v.rejected
    r = v.rejected[0]
    assert r.message  # the contract's words
    return r.index, r.field, r.reason


def test_valid_events_go_to_their_topics_keyed_by_user() -> None:
    conv = {
        "kind": "conversion", "event_id": "cv1", "ts": TS, "user_id": "u9",
        "campaign_id": "c1", "advertiser_id": "v1", "value": 12.5,
    }  # fmt: skip
    v = judge_batch(batch(click(), impression(), conv), LIMITS, KEY)
    assert v.rejected == []
    assert [(a.index, a.topic, a.key) for a in v.accepted] == [
        (0, topics.CLICKS, b"u1"),
        (1, topics.IMPRESSIONS, b"u1"),
        (2, topics.CONVERSIONS, b"u9"),
    ]
    assert json.loads(v.accepted[0].value)["click_token"] == click()["click_token"]


@pytest.mark.parametrize(
    ("event", "field", "reason"),
    [
        ([1, 2], "<event>", "not_an_object"),
        ({k: v for k, v in click().items() if k != "kind"}, "kind", "missing_field"),
        ({**click(), "kind": "purchase"}, "kind", "unknown_kind"),
        ({**click(), "kind": 7}, "kind", "unknown_kind"),
        ({**click(), "kind": "ad"}, "kind", "kind_not_accepted"),
        ({**click(), "kind": "adapter_delta"}, "kind", "kind_not_accepted"),
        ({**click(), "extra": 1}, "extra", "unknown_field"),
        ({k: v for k, v in click().items() if k != "ad_id"}, "ad_id", "missing_field"),
        ({**click(), "campaign_id": 5}, "campaign_id", "wrong_type"),
        ({**click(), "ts": "2026-12-03T10:00:00"}, "ts", "naive_timestamp"),
        ({**click(), "user_id": ""}, "user_id", "out_of_range"),
        ({**click(), "user_id": "u\u202e1"}, "user_id", "invalid"),
        (click(click_token=None), "click_token", "no_click_token"),
        (click(click_token=click_token(KEY, "r1/0", "u2", "ad1")), "click_token", "bad_click_token"),
        (click(click_token=click_token(b"x" * 32, "r1/0", "u1", "ad1")), "click_token", "bad_click_token"),
        (impression(key=None), "sig", "unsigned"),
        ({**impression(), "price": 99.0}, "sig", "bad_signature"),
        (impression(key=b"y" * 32), "sig", "bad_signature"),
    ],
)
def test_each_refusal_names_index_field_and_reason(event: Any, field: str, reason: str) -> None:
    # the bad event sits between two good ones: only it is refused, by its own index
    good_before, good_after = click(user="a"), click(user="b", event_id="other")
    v = judge_batch(batch(good_before, event, good_after), LIMITS, KEY)
    assert [(r.index, r.field, r.reason) for r in v.rejected] == [(1, field, reason)]
    assert [a.index for a in v.accepted] == [0, 2]


def test_forged_tokens_and_signatures_are_singled_out() -> None:
    forged = click(click_token=click_token(KEY, "r1/0", "u2", "ad1"))
    v = judge_batch(batch(forged, {**impression(), "price": 9.0}, click(click_token=None)), LIMITS, KEY)
    assert [(r.index, r.field) for r in v.forged] == [(0, "click_token"), (1, "sig")]
    assert v.kinds == {0: "click", 1: "impression", 2: "click"}


def test_duplicate_key_and_duplicate_event_id() -> None:
    raw = batch(click()).replace(b'"user_id": "u1"', b'"user_id": "u1", "user_id": "u2"')
    assert [(r.index, r.field, r.reason) for r in judge_batch(raw, LIMITS, KEY).rejected] == [
        (0, "user_id", "duplicate_key")
    ]
    assert only_rejection(click(), click()) == (1, "event_id", "duplicate_event")


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_numbers_are_not_json(constant: bytes) -> None:
    with pytest.raises(BatchRefused, match="not JSON") as info:
        parse_batch(batch(click()).replace(b'"c1"', constant), LIMITS)
    assert info.value.status == 422


def test_lone_surrogates_are_refused_by_field_not_raised() -> None:
    raw = batch(click()).replace(b'"u1"', b'"\\ud800"', 1)
    assert [(r.index, r.field, r.reason) for r in judge_batch(raw, LIMITS, KEY).rejected] == [
        (0, "user_id", "invalid")
    ]


@pytest.mark.parametrize(
    "body",
    [
        b'{"events": [], "\\udc00": 1}',
        b'{"events": [{"kind": "click", "\\ud800": 1, "\\ud800": 2}]}',
        b'{"events": [{"kind": "click", "x\\ud800": 1}]}',
    ],
)
def test_answers_echo_no_lone_surrogate(body: bytes) -> None:
    try:
        answers = [str(r.model_dump_json()) for r in judge_batch(body, LIMITS, KEY).rejected]
    except BatchRefused as exc:
        answers = [exc.field, exc.message]
    assert answers and all(a.encode() for a in answers)


def test_huge_numbers_are_refused_by_the_contract_not_raised() -> None:
    raw = batch(click()).replace(b'"c1"', b"1" + b"0" * 40)
    assert [(r.index, r.field, r.reason) for r in judge_batch(raw, LIMITS, KEY).rejected] == [
        (0, "campaign_id", "wrong_type")
    ]


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        (b"not json", 422, "body"),
        (b"\xff\xfe", 422, "body"),
        (b"[1]", 422, "body"),
        (b'{"events": {}}', 422, "events"),
        (b'{"events": [], "more": 1}', 422, "more"),
        (b'{"events": [], "events": []}', 422, "events"),
        (batch(*[click(event_id=f"e{i}") for i in range(11)]), 422, "events"),
        (b" " * (64 * 1024 + 1), 413, "body"),
        (b"[" * 60_000, 422, "body"),
    ],
)
def test_body_as_a_whole(body: bytes, status: int, field: str) -> None:
    with pytest.raises(BatchRefused) as info:
        parse_batch(body, LIMITS)
    assert (info.value.status, info.value.field) == (status, field)
    assert info.value.message


def test_batch_at_the_limit_passes() -> None:
    v = judge_batch(batch(*[click(event_id=f"e{i}") for i in range(10)]), LIMITS, KEY)
    assert len(v.accepted) == 10
    assert judge_batch(b'{"events": []}', LIMITS, KEY).accepted == []


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_token_bucket_burst_refill_and_wait() -> None:
    clock = Clock()
    b = TokenBucket(rate=10.0, burst=20, clock=clock)
    assert b.take("k", 15) == 0.0
    assert b.take("k", 10) == pytest.approx(0.5)  # 5 left, 5 more at 10/s
    assert b.take("k", 5) == 0.0  # a refused take took nothing
    assert b.wait_s("k", 1) == pytest.approx(0.1)
    clock.t += 0.1
    assert b.take("k", 1) == 0.0
    clock.t += 100  # refills up to the burst, no further
    assert b.take("k", 20) == 0.0
    assert b.take("k", 1) > 0
    assert b.take("other", 20) == 0.0  # keys have their own buckets


def test_token_bucket_batch_larger_than_burst_needs_a_full_bucket() -> None:
    clock = Clock()
    b = TokenBucket(rate=1.0, burst=5, clock=clock)
    assert b.take("k", 50) == 0.0  # charged as the whole bucket
    assert b.take("k", 50) == pytest.approx(5.0)
    clock.t += 5
    assert b.take("k", 50) == 0.0


def test_token_bucket_forgets_least_recent_keys_beyond_max() -> None:
    clock = Clock()
    b = TokenBucket(rate=1.0, burst=2, clock=clock, max_keys=2)
    for k in ("a", "b", "c"):
        assert b.take(k, 2) == 0.0
    assert b.take("b", 1) > 0 and b.take("c", 1) > 0
    assert b.take("a", 2) == 0.0  # forgotten: full again


def test_retry_after_rounds_up_to_whole_seconds() -> None:
    assert [retry_after(w) for w in (0.0, 0.01, 1.0, 1.2)] == ["1", "1", "1", "2"]
