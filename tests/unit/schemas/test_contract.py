"""The wire contract rejects what it must, names the field, and round-trips what it accepts."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from schemas import topics
from schemas.codec import (
    MODEL_BY_TOPIC,
    decode,
    decode_any,
    encode,
    error_reason,
    key_of,
    model_for_topic,
    topic_of,
)
from schemas.errors import SchemaError
from schemas.events import AdapterDelta, AdCreative, Click, Conversion, DeadLetter, Dwell, Impression

TS = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def impression(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "event_id": "e1",
        "ts": "2026-11-29T12:00:00+01:00",
        "user_id": "u1",
        "request_id": "r1",
        "ad_id": "a1",
        "campaign_id": "c1",
        "advertiser_id": "v1",
        "slot": "feed",
        "position": 0,
        "price": 0.5,
    }
    base.update(over)
    return base


def raw(obj: dict[str, object]) -> bytes:
    return json.dumps(obj).encode()


def test_valid_impression_parses_with_aware_ts() -> None:
    msg = decode(Impression, raw(impression()))
    assert isinstance(msg, Impression)
    assert msg.ts.utcoffset() is not None
    assert msg.pctr is None


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"price": -0.01}, "price"),
        ({"position": -1}, "position"),
        ({"position": "3"}, "position"),
        ({"slot": "Banner ad"}, "slot"),  # a slot is a lowercase identifier
        ({"ts": "2026-11-29T12:00:00"}, "ts"),
        ({"ts": "yesterday"}, "ts"),
        ({"user_id": ""}, "user_id"),
        ({"user_id": "u" * 129}, "user_id"),
        ({"event_id": "e" * 65}, "event_id"),
        ({"pctr": 1.5}, "pctr"),
        ({"surprise": 1}, "surprise"),
        ({"price": "1.0"}, "price"),
        ({"kind": "click"}, "kind"),
        ({"ts": "1969-12-31T23:59:59Z"}, "ts"),
        ({"ts": "2106-01-01T00:00:00Z"}, "ts"),
        ({"ad_id": "😀" * 64}, "ad_id"),
        ({"user_id": "é" * 128}, "user_id"),
    ],
)
def test_impression_rejections_name_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(SchemaError, match=f"field '{field}'"):
        decode(Impression, raw(impression(**change)))


def test_missing_field_is_named() -> None:
    obj = impression()
    del obj["ad_id"]
    with pytest.raises(SchemaError, match="field 'ad_id': Field required"):
        decode(Impression, raw(obj))


@pytest.mark.parametrize("payload", [b"", b"\xff\xfe garbage", b"[1, 2]", b"null", b'{"event_id": '])
def test_garbage_is_a_schema_error_not_a_crash(payload: bytes) -> None:
    with pytest.raises(SchemaError):
        decode(Click, payload)


@pytest.mark.parametrize("dwell_ms", [-1, 3_600_001, 1.5])
def test_dwell_range(dwell_ms: object) -> None:
    obj = {"event_id": "d", "ts": "2026-11-29T12:00:00Z", "user_id": "u", "impression_id": "i", "ad_id": "a"}
    with pytest.raises(SchemaError, match="dwell_ms"):
        decode(Dwell, raw({**obj, "dwell_ms": dwell_ms}))
    assert decode(Dwell, raw({**obj, "dwell_ms": 3_600_000})).dwell_ms == 3_600_000  # type: ignore[attr-defined]


def test_nan_and_infinite_numbers_rejected() -> None:
    with pytest.raises(SchemaError, match="price"):
        decode(Impression, raw(impression()).replace(b'"price": 0.5', b'"price": NaN'))
    with pytest.raises(ValueError, match="value"):
        Conversion.model_validate(
            {
                "event_id": "c",
                "ts": TS,
                "user_id": "u",
                "campaign_id": "c",
                "advertiser_id": "v",
                "value": float("inf"),
            }
        )


def test_catalog_bid_and_budget_must_be_positive() -> None:
    ad = {
        "event_id": "x",
        "ts": TS,
        "ad_id": "a",
        "campaign_id": "c",
        "advertiser_id": "v",
        "category": "shoes",
        "title": "Red shoes",
        "bid": 1.0,
        "daily_budget": 100.0,
        "active": True,
    }
    AdCreative.model_validate(ad)
    for field in ("bid", "daily_budget"):
        with pytest.raises(ValueError, match=field):
            AdCreative.model_validate({**ad, field: 0})


def test_models_are_frozen() -> None:
    msg = decode(Impression, raw(impression()))
    with pytest.raises(ValueError):
        msg.price = 3.0  # type: ignore[misc]


def test_dead_letter_raw_is_standard_base64_and_round_trips() -> None:
    dl = DeadLetter(
        event_id="d", ts=TS, source_topic="ad.clicks", partition=2, offset=7, error="bad", raw=b"\xff\x00"
    )
    wire = json.loads(encode(dl))
    assert wire["raw"] == "/wA="
    assert decode(DeadLetter, encode(dl)) == dl
    with pytest.raises(SchemaError, match="raw"):
        decode(DeadLetter, encode(dl).replace(b"/wA=", b"not base64!"))


def test_adapter_delta_payload_limits() -> None:
    base = {
        "event_id": "d",
        "ts": TS,
        "adapter_id": "feed",
        "base_version": "m1",
        "seq": 0,
        "rank": 8,
        "norm": 0.1,
        "created_at": TS,
    }
    with pytest.raises(ValueError, match="payload"):
        AdapterDelta.model_validate({**base, "payload": b""})
    with pytest.raises(ValueError, match="seq"):
        AdapterDelta.model_validate({**base, "payload": b"x", "seq": -1})


def test_every_contract_topic_has_a_model_and_key() -> None:
    assert set(MODEL_BY_TOPIC) == {t.name for t in topics.TOPICS}
    for spec in topics.TOPICS:
        model = model_for_topic(spec.name)
        assert spec.key in model.model_fields or spec.key == "source_topic"


def test_unknown_topic_is_a_clear_error() -> None:
    with pytest.raises(SchemaError, match="not a contract topic"):
        model_for_topic("ad.unknown")
    assert model_for_topic("t1.ad.clicks", prefix="t1.") is Click


def test_keys_follow_the_contract() -> None:
    imp = decode(Impression, raw(impression()))
    assert key_of(imp) == b"u1"
    assert topic_of(imp) == topics.IMPRESSIONS
    ad = AdCreative(
        event_id="x",
        ts=TS,
        ad_id="a9",
        campaign_id="c",
        advertiser_id="v",
        category="k",
        title="t",
        bid=1.0,
        daily_budget=2.0,
        active=True,
    )
    assert key_of(ad) == b"a9"


def test_decode_any_dispatches_on_kind() -> None:
    imp = decode(Impression, raw(impression()))
    assert decode_any(encode(imp)) == imp
    with pytest.raises(SchemaError, match="kind"):
        decode_any(raw(impression()))
    with pytest.raises(SchemaError, match="unknown event kind"):
        decode_any(raw({**impression(), "kind": "bogus"}))


def test_error_reasons_are_low_cardinality() -> None:
    from pydantic import ValidationError

    cases = {
        b"garbage": "bad_json",
        raw(impression(extra=1)): "unknown_field",
        raw(impression(price=-1)): "out_of_range",
        raw(impression(position="x")): "wrong_type",
        raw(impression(ts="2026-11-29T12:00:00")): "naive_timestamp",
    }
    for payload, reason in cases.items():
        with pytest.raises(ValidationError) as info:
            Impression.model_validate_json(payload)
        assert error_reason(info.value) == reason, payload


def test_ids_may_be_unicode_within_255_bytes() -> None:
    msg = decode(Impression, raw(impression(ad_id="😀" * 63, user_id="é" * 127)))
    assert msg.ad_id == "😀" * 63  # type: ignore[attr-defined]
