"""Ad titles refuse control and bidi characters (issue 14: L3), on both decoding paths."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from schemas.codec import decode, encode
from schemas.decode import BatchDecoder
from schemas.errors import SchemaError
from schemas.events import AdCreative

TS = datetime(2026, 1, 1, tzinfo=UTC)


def _ad_json(title: str) -> bytes:
    ok = AdCreative(
        event_id="e1", ts=TS, ad_id="a1", campaign_id="c1", advertiser_id="v1", category="shoes",
        title="t", bid=1.0, daily_budget=100.0, active=True,
    )  # fmt: skip
    return json.dumps({**json.loads(encode(ok)), "title": title}, ensure_ascii=False).encode()


@pytest.mark.parametrize(
    "bad", ["red\x00shoes", "line\nbreak", "\x1b[31mSALE\x1b[0m", "tab\there", "\x7fdel", "\x85nel",
            "evil\u202egnp.exe", "\u2066isolate\u2069", "lre\u202a", "rlo\u202e"],
)  # fmt: skip
def test_titles_refuse_control_and_bidi_characters(bad: str) -> None:
    """A title reaches ClickHouse, dashboards and logs: NUL, newlines, ANSI escapes and bidi
    overrides (Trojan Source) are refused, naming the field; the fast path refuses them too."""
    raw = _ad_json(bad)
    with pytest.raises(SchemaError, match="title"):
        decode(AdCreative, raw)
    assert BatchDecoder(AdCreative).fast([raw]) == [None]


@pytest.mark.parametrize("ok", ["Red shoes -40%", "用户 最爱", "café crème", "👩‍👩‍👧 family pack", "a'b\"c"])
def test_titles_keep_printable_text(ok: str) -> None:
    """Printable text of any script stays, emoji joined by U+200D (a format character) too."""
    ad = decode(AdCreative, _ad_json(ok))
    assert isinstance(ad, AdCreative) and ad.title == ok
