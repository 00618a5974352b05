"""Render beacons (`View`) over `POST /v1/events`: a view carrying the served ad's token goes to
ad.views; a forged token, a view naming another impression, user or ad than the token was made
for (an ad never served to that user), or no token at all is refused, naming `click_token`."""

from __future__ import annotations

import json
from typing import Any

import pytest

from schemas import topics
from schemas.ids import impression_event_id
from schemas.signing import click_token
from serving.collector import Limits, judge_batch

KEY = b"k" * 32
LIMITS = Limits(max_body_bytes=64 * 1024, max_events=10)
IID = impression_event_id("r1", 0)


def view(**over: Any) -> dict[str, Any]:
    ev = {
        "kind": "view", "event_id": f"v/{IID}", "ts": "2026-12-03T10:00:01+00:00", "user_id": "u1",
        "impression_id": IID, "ad_id": "ad1", "click_token": click_token(KEY, IID, "u1", "ad1"),
    }  # fmt: skip
    ev.update(over)
    return {k: v for k, v in ev.items() if v is not None}


def test_a_view_with_its_served_token_goes_to_the_views_topic() -> None:
    verdict = judge_batch(json.dumps({"events": [view()]}).encode(), LIMITS, KEY)
    assert verdict.rejected == [] and [(a.kind, a.topic, a.key) for a in verdict.accepted] == [
        ("view", topics.VIEWS, b"u1")
    ]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"click_token": "A" * 22}, "bad_click_token"),  # forged
        ({"impression_id": impression_event_id("r-never", 0)}, "bad_click_token"),  # never served
        ({"user_id": "u2"}, "bad_click_token"),  # served to another user
        ({"ad_id": "ad2"}, "bad_click_token"),  # another ad
        ({"click_token": None}, "no_click_token"),
    ],
)
def test_a_view_without_the_token_of_an_ad_served_to_that_user_is_refused(
    change: dict[str, Any], reason: str
) -> None:
    verdict = judge_batch(json.dumps({"events": [view(**change)]}).encode(), LIMITS, KEY)
    assert verdict.accepted == []
    [rej] = verdict.rejected
    assert (rej.index, rej.field, rej.reason) == (0, "click_token", reason)
    assert verdict.forged == ([rej] if reason == "bad_click_token" else [])  # counted apart


def test_a_view_with_an_unknown_field_is_refused_naming_it() -> None:
    verdict = judge_batch(json.dumps({"events": [view(dwell_ms=5)]}).encode(), LIMITS, KEY)
    [rej] = verdict.rejected
    assert (rej.field, rej.reason) == ("dwell_ms", "unknown_field")
