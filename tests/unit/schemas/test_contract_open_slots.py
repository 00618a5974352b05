"""The open request contract (issue 34 item 5): slots are settings (`slots.names`, the three of
before by default), a slot is a bounded identifier, serving refuses one not configured; a request
may carry `query` text, bounded and printable."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from schemas.api import MAX_QUERY_CHARS, AdRequest, RankRequest
from schemas.errors import ConfigError
from schemas.events import SLOTS, Impression
from schemas.settings import Settings, env_example


def test_the_default_slots_are_the_three_of_before() -> None:
    assert Settings().slots.names == SLOTS == ("feed", "search", "splash")
    assert 'ADSTREAM_SLOTS__NAMES=["feed","search","splash"]' in env_example()


def test_slots_are_configured_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADSTREAM_SLOTS__NAMES", '["feed","search","splash","news","video-pre_roll"]')
    assert Settings().slots.names == ("feed", "search", "splash", "news", "video-pre_roll")


@pytest.mark.parametrize(
    ("names", "why"),
    [
        ([], "at least 1"),
        (["feed", "feed"], "more than once"),
        (["Feed"], "pattern"),
        (["news feed"], "pattern"),
        (["adv:x"], "pattern"),  # would read as an advertiser adapter id
        (["x" * 33], "pattern|at most"),
    ],
)
def test_bad_slot_settings_are_refused_naming_the_setting(names: list[str], why: str) -> None:
    with pytest.raises((ValidationError, ConfigError), match=rf"slots\.names(?s:.*)({why})"):
        Settings(slots={"names": names})


def test_per_slot_settings_take_configured_slots_only() -> None:
    s = Settings(slots={"names": [*SLOTS, "news"]}, serving={"shown_on_serve": ["news", "splash"]})
    assert s.serving.shown_on_serve == ["news", "splash"]
    with pytest.raises((ValidationError, ConfigError), match=r"serving\.shown_on_serve names \['news'\]"):
        Settings(serving={"shown_on_serve": ["news"]})


def test_a_slot_is_a_bounded_identifier_and_serving_limits_it_to_the_configured() -> None:
    assert AdRequest(user_id="u", slot="news").slot == "news"  # the contract alone: any identifier
    for bad in ("", "News", "a b", "é", "x" * 33, "1feed"):
        with pytest.raises(ValidationError) as err:
            AdRequest.model_validate({"user_id": "u", "slot": bad})
        assert err.value.errors()[0]["loc"] == ("slot",)
    body = b'{"user_id": "u", "slot": "news", "candidates": ["a1"]}'
    assert RankRequest.model_validate_json(body, context={"slots": ("feed", "news")}).slot == "news"
    with pytest.raises(ValidationError) as err:
        RankRequest.model_validate_json(body, context={"slots": SLOTS})
    (e,) = err.value.errors()
    assert e["loc"] == ("slot",) and "'news' is not a configured slot" in e["msg"]
    # events carry any slot name (a configured one, validated where the request came in)
    imp = {"event_id": "i", "ts": "2026-01-01T00:00:00Z", "user_id": "u", "request_id": "r", "ad_id": "a",
           "campaign_id": "c", "advertiser_id": "v", "slot": "news", "position": 0, "price": 0.1}  # fmt: skip
    assert Impression.model_validate_json(json.dumps(imp)).slot == "news"


def test_query_text_is_optional_bounded_and_printable() -> None:
    assert AdRequest(user_id="u", slot="search").query is None
    assert AdRequest(user_id="u", slot="search", query="chaussures de course rouges").query
    assert AdRequest(user_id="u", slot="search", query="q" * MAX_QUERY_CHARS).query
    for bad in ("", "q" * (MAX_QUERY_CHARS + 1), "red\nshoes", "a\u202eb", "\x00"):
        with pytest.raises(ValidationError) as err:
            AdRequest(user_id="u", slot="search", query=bad)
        assert err.value.errors()[0]["loc"] == ("query",)
