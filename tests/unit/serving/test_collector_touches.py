"""Outside touchpoints (`Touch`) over the HTTP events route: accepted onto ad.touches keyed by the
user (no signature or click token: the platform served nothing), refused by field otherwise."""

from __future__ import annotations

import json

from schemas import topics
from serving.collector import Limits, judge_batch

KEY = b"k" * 32
LIMITS = Limits(max_body_bytes=64 * 1024, max_events=10)
TOUCH = {
    "kind": "touch", "event_id": "tch1", "ts": "2026-12-03T10:00:00+00:00", "user_id": "u7",
    "advertiser_id": "adv", "source": "newsletter", "medium": "email", "interaction": "view",
}  # fmt: skip


def test_a_touch_goes_to_the_touches_topic_and_a_bad_one_is_named() -> None:
    bad = {**TOUCH, "event_id": "tch2", "source": ""}
    v = judge_batch(json.dumps({"events": [TOUCH, bad]}).encode(), LIMITS, KEY)
    assert [(a.index, a.topic, a.key) for a in v.accepted] == [(0, topics.TOUCHES, b"u7")]
    assert json.loads(v.accepted[0].value)["campaign"] is None
    assert [(r.index, r.field, r.reason) for r in v.rejected] == [(1, "source", "out_of_range")]
