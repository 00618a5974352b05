"""The worker's check of signatures and click tokens (M10) on both decode paths."""

from __future__ import annotations

from streams_helpers import click, impression

from schemas import topics
from schemas.codec import encode
from schemas.decode import BatchDecoder
from schemas.events import Click, Impression
from schemas.signing import seal
from streams.ingest import Invalid, unvouched, validate

KEY = b"w" * 32


def _judged(model: type, topic: str, value: bytes, fast: bool) -> Invalid | None:
    event = BatchDecoder(model).fast([value])[0] if fast else validate(topic, topic, 0, 7, value, 0)
    assert event is not None and not isinstance(event, Invalid)
    return unvouched(event, topic, 0, 7, value, 0, KEY)


def test_signed_events_pass_and_forged_ones_are_dead_lettered_on_both_paths() -> None:
    signed = seal(impression("req-1/0", 0.0), KEY)
    twin = signed.model_copy(update={"price": 99.0})
    token_click = seal(click("k1", 1.0, "req-1/0"), KEY)
    other_user = token_click.model_copy(update={"user_id": "u2"})
    for fast in (True, False):  # the fast decoder keeps `sig` / `click_token` as the contract does
        assert _judged(Impression, topics.IMPRESSIONS, encode(signed), fast) is None
        assert _judged(Click, topics.CLICKS, encode(token_click), fast) is None
        for model, topic, bad, reason in (
            (Impression, topics.IMPRESSIONS, twin, "bad_signature"),
            (Impression, topics.IMPRESSIONS, impression("req-1/0", 0.0), "unsigned"),
            (Click, topics.CLICKS, other_user, "bad_click_token"),
            (Click, topics.CLICKS, click("k1", 1.0, "req-1/0"), "no_click_token"),
        ):
            letter = _judged(model, topic, encode(bad), fast)
            assert letter is not None and letter.reason == reason
            assert letter.dead_letter.raw == encode(bad) and letter.dead_letter.offset == 7
    assert unvouched(twin, topics.IMPRESSIONS, 0, 7, b"", 0, KEY, impressions=False) is None
    assert unvouched(other_user, topics.CLICKS, 0, 7, b"", 0, KEY, clicks=False) is None
