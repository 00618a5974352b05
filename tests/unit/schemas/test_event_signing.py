"""The signing rule of impressions and click tokens (M10.a, M10.b): what verifies and what not."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from schemas.codec import decode, encode
from schemas.errors import ConfigError, SchemaError
from schemas.events import Click, Conversion, Dwell, Impression
from schemas.settings import Settings
from schemas.signing import (
    EVENT_KEY_FILE,
    check_event,
    click_token,
    event_key,
    impression_bytes,
    seal,
    sign_impression,
)

KEY = b"k" * 32
OTHER = b"o" * 32
TS = datetime(2026, 11, 29, 12, 0, 0, 123456, tzinfo=UTC)


def served(**over: object) -> Impression:
    fields: dict[str, object] = {
        "event_id": "req-1/0", "ts": TS, "user_id": "u1", "request_id": "req-1", "ad_id": "ad7",
        "campaign_id": "c7", "advertiser_id": "v7", "slot": "feed", "position": 0, "price": 0.8125,
        "pctr": 0.031, "model_version": "ranker-v3", "adapter_version": "feed@12",
    }  # fmt: skip
    fields.update(over)
    return Impression(**fields)  # type: ignore[arg-type]


def test_a_signed_impression_verifies_also_after_the_wire():
    imp = sign_impression(served(), KEY)
    assert imp.sig is not None and len(imp.sig) == 64
    assert check_event(imp, KEY) is None
    back = decode(Impression, encode(imp))  # JSON round trip: same instant, same floats
    assert check_event(back, KEY) is None
    # the same instant written in another offset is the same impression
    shifted = imp.model_copy(update={"ts": TS.astimezone(timezone(timedelta(hours=5)))})
    assert check_event(shifted, KEY) is None


TAMPERED = [
        ("event_id", "req-1/1"), ("ts", TS + timedelta(microseconds=1)), ("user_id", "u2"),
        ("request_id", "req-2"), ("ad_id", "ad8"), ("campaign_id", "c8"), ("advertiser_id", "v8"),
        ("slot", "search"), ("position", 1), ("price", 0.8126), ("pctr", None), ("pctr", 0.5),
        ("model_version", None), ("model_version", "ranker-v4"), ("adapter_version", None),
        ("variant_id", "zh-h0b1c0"), ("variant_propensity", 0.25),
        ("ab_arm", "control"), ("propensity", 0.125), ("explored", True), ("explored", False),
        ("bid_type", "cpm"), ("bid_type", "cpc"), ("render", "server"), ("render", "client"),
        ("query_match", 0.5), ("query_match", 0.0), ("query_match", -0.25),
]  # fmt: skip


@pytest.mark.parametrize(("name", "value"), TAMPERED)
def test_a_tampered_field_fails(name: str, value: object):
    forged = sign_impression(served(), KEY).model_copy(update={name: value})
    result = check_event(forged, KEY)
    assert result is not None and result[0] == "bad_signature"
    assert "bad impression signature" in result[1] and "req-1/" in result[1]


def test_every_field_but_sig_is_covered():
    # a new Impression field must join the canonical bytes and the tampering cases above
    assert {name for name, _ in TAMPERED} == set(Impression.model_fields) - {"sig", "kind"}


def test_fields_cannot_shift_into_a_neighbour():
    a = served(model_version="a|b", adapter_version="c")
    b = served(model_version="a", adapter_version="b|c")
    assert impression_bytes(a) != impression_bytes(b)
    assert impression_bytes(served(model_version=None)) != impression_bytes(served(model_version="-"))


def test_another_key_or_no_signature_fails():
    imp = sign_impression(served(), OTHER)
    assert check_event(imp, KEY) is not None and check_event(imp, KEY)[0] == "bad_signature"  # type: ignore[index]
    unsigned = check_event(served(), KEY)
    assert unsigned is not None and unsigned[0] == "unsigned" and "unsigned impression" in unsigned[1]
    assert check_event(served(), KEY, impressions=False) is None  # verification off


def test_a_malformed_signature_is_a_contract_error():
    with pytest.raises(SchemaError, match="sig"):
        decode(Impression, encode(served()).replace(b'"sig":null', b'"sig":"not-hex"'))


def test_click_tokens_name_the_impression_the_user_and_the_ad():
    token = click_token(KEY, "req-1/0", "u1", "ad7")
    assert len(token) == 22 and token == click_token(KEY, "req-1/0", "u1", "ad7")
    click = Click(event_id="k1", ts=TS, user_id="u1", impression_id="req-1/0", ad_id="ad7", campaign_id="c7")
    assert check_event(click.model_copy(update={"click_token": token}), KEY) is None
    for other in (
        {"user_id": "u2"}, {"impression_id": "req-1/1"}, {"ad_id": "ad8"},
    ):  # fmt: skip
        forged = click.model_copy(update={"click_token": token, **other})
        result = check_event(forged, KEY)
        assert result is not None and result[0] == "bad_click_token", other
    wrong_key = click.model_copy(update={"click_token": click_token(OTHER, "req-1/0", "u1", "ad7")})
    assert check_event(wrong_key, KEY) is not None
    missing = check_event(click, KEY)
    assert missing is not None and missing[0] == "no_click_token"
    assert check_event(click, KEY, clicks=False) is None
    dwell = Dwell(event_id="d1", ts=TS, user_id="u1", impression_id="req-1/0", ad_id="ad7", dwell_ms=5)
    assert check_event(dwell, KEY) is not None
    assert check_event(dwell.model_copy(update={"click_token": token}), KEY) is None


def test_seal_signs_what_names_an_impression_and_leaves_conversions():
    click = Click(event_id="k1", ts=TS, user_id="u1", impression_id="req-1/0", ad_id="ad7", campaign_id="c7")
    conv = Conversion(event_id="v1", ts=TS, user_id="u1", campaign_id="c7", advertiser_id="v7", value=3.0)
    assert check_event(seal(served(), KEY), KEY) is None
    assert seal(click, KEY).click_token == click_token(KEY, "req-1/0", "u1", "ad7")
    assert seal(conv, KEY) == conv  # attribution joins conversions by journey: nothing to vouch for
    assert check_event(conv, KEY) is None


def test_the_event_key_is_resolved_like_the_delta_key(tmp_path: Path):
    s = Settings(state_dir=tmp_path, event_signing_key="")
    assert event_key(s, create=False) is None
    key = event_key(s)
    assert key is not None and len(key) >= 32
    assert (tmp_path / EVENT_KEY_FILE).stat().st_mode & 0o777 == 0o600
    assert event_key(s) == key  # every process of the stack reads the same key
    assert event_key(Settings(state_dir=tmp_path, event_signing_key="z" * 40)) == b"z" * 40
    with pytest.raises(ConfigError, match="event_signing_key"):
        event_key(Settings(state_dir=tmp_path, event_signing_key="short"))


def test_the_canonical_bytes_are_pinned_and_the_same_with_a_known_time():
    # replicas sign with these bytes and workers of another version verify them: they never change
    imp = served()
    want = (
        b"adstream-impression-v1|7:req-1/0|2:u1|5:req-1|3:ad7|2:c7|2:v7|feed|1795953600.123456|0"
        b"|0.8125|0.031|9:ranker-v3|7:feed@12"
    )
    assert impression_bytes(imp) == want
    assert impression_bytes(imp, imp.ts.timestamp()) == want
    bare = served(pctr=None, model_version=None, adapter_version=None, price=2, user_id="ü|9:x")
    assert impression_bytes(bare) == (
        b"adstream-impression-v1|7:req-1/0|5:\xc3\xbc|9:x|5:req-1|3:ad7|2:c7|2:v7|feed|1795953600.123456|0"
        b"|2.0|-|-|-"
    )
    sig = sign_impression(imp, KEY).sig
    assert sig is not None and check_event(sign_impression(imp, KEY), KEY, ts=imp.ts.timestamp()) is None
