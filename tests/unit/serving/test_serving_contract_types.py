"""Reliability findings on the contract types serving reads (issue 14: H7, L3, L4, OpenAPI `k`)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from schemas.api import AdRequest
from schemas.delta import AdapterState
from schemas.events import AdapterDelta, Click, Impression
from serving.hotswap import version_of

TS = datetime(2026, 1, 1, tzinfo=UTC)


def _delta(seq: int) -> dict[str, object]:
    return dict(
        event_id="d",
        ts=TS,
        adapter_id="feed",
        base_version="v1",
        seq=seq,
        rank=2,
        payload=b"x",
        norm=0.0,
        created_at=TS,
    )


@pytest.mark.parametrize("seq", [10**61, 2**62, 2**53])
def test_adapter_delta_seq_is_bounded(seq: int) -> None:
    """H7: a seq past 2**53 - 1 (JSON-safe, ~285 years at a million deltas a second) is refused,
    naming the field, so no version string grows past 64 characters and no forged huge seq
    makes every later delta of an adapter stale."""
    with pytest.raises(ValidationError) as err:
        AdapterDelta(**_delta(seq))  # type: ignore[arg-type]
    assert err.value.errors()[0]["loc"] == ("seq",)


def test_largest_seq_gives_a_contract_version() -> None:
    top = AdapterDelta(**_delta(2**53 - 1))  # type: ignore[arg-type]
    version = version_of(AdapterState("feed", "v1", 2, top.seq))
    assert len(version) <= 64
    Impression(
        event_id="i",
        ts=TS,
        user_id="u",
        request_id="r",
        ad_id="a",
        campaign_id="c",
        advertiser_id="v",
        slot="feed",
        position=0,
        price=0.0,
        adapter_version=version,
    )


@pytest.mark.parametrize(
    "bad", ["u\x00", "line\nbreak", "\x1b[31mred", "a\u202eb", "zero\u200bwidth", "x\u2028", "\x7f"]
)
def test_ids_reject_control_and_bidi_characters(bad: str) -> None:
    """L3: ids (user, event, ad … ids) refuse NUL, newlines, ANSI escapes and bidi/format
    characters: they reach logs, Redis keys and ClickHouse."""
    with pytest.raises(ValidationError) as err:
        Click(event_id="e", ts=TS, user_id=bad, impression_id="i", ad_id="a", campaign_id="c")
    assert err.value.errors()[0]["loc"] == ("user_id",)
    with pytest.raises(ValidationError):
        AdRequest.model_validate_json(json.dumps({"user_id": bad, "slot": "feed"}))


def test_ids_keep_printable_unicode() -> None:
    for ok in ["user 1", "café-42", "用户", "adv:x", "feed/adv:v7"]:
        Click(event_id="e", ts=TS, user_id=ok, impression_id="i", ad_id=ok, campaign_id="c")


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1" * 400, "-" + "9" * 30])
def test_context_numbers_are_finite_and_bounded(value: str) -> None:
    """L4: context values NaN/Infinity and ints with hundreds of digits are refused (field named)."""
    body = '{"user_id": "u", "slot": "feed", "context": {"x": ' + value + "}}"
    with pytest.raises(ValidationError) as err:
        AdRequest.model_validate_json(body)
    assert all(e["loc"][:2] == ("context", "x") for e in err.value.errors())


def test_context_keeps_ordinary_values() -> None:
    req = AdRequest.model_validate_json(
        '{"user_id": "u", "slot": "feed", '
        '"context": {"a": 1, "b": 2.5, "c": "x", "d": true, "e": -9007199254740991}}'
    )
    assert req.context == {"a": 1, "b": 2.5, "c": "x", "d": True, "e": -9007199254740991}


@pytest.mark.parametrize("ts", ["1700000000", "1700000000.5", "-5", "0"])
def test_timestamps_are_iso_text_not_numbers(ts: str) -> None:
    """L4: a ts given as a numeric string is refused (pydantic would read it as unix seconds)."""
    body = json.dumps(dict(event_id="e", ts=ts, user_id="u", impression_id="i", ad_id="a", campaign_id="c"))
    with pytest.raises(ValidationError) as err:
        Click.model_validate_json(body)
    assert err.value.errors()[0]["loc"] == ("ts",)
    assert Click.model_validate_json(body.replace(ts, "2026-01-01T00:00:00Z")).ts == TS


def test_integral_floats_are_integers() -> None:
    """OpenAPI: `k: 61.0` is an integer in JSON Schema; the API accepts it as 61 (and 61.5 not)."""
    req = AdRequest.model_validate_json('{"user_id": "u", "slot": "feed", "k": 61.0, "deadline_ms": 20.0}')
    assert req.k == 61 and isinstance(req.k, int) and req.deadline_ms == 20
    with pytest.raises(ValidationError) as err:
        AdRequest.model_validate_json('{"user_id": "u", "slot": "feed", "k": 61.5}')
    assert err.value.errors()[0]["loc"] == ("k",)
    with pytest.raises(ValidationError):
        AdRequest.model_validate_json('{"user_id": "u", "slot": "feed", "k": true}')
