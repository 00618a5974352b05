"""Declared interests on the real ad server: a brand-new user is ranked towards them, bad lists
are refused naming the field, unknown categories are ignored and counted."""

from __future__ import annotations

import uuid

import httpx
import pytest

from schemas.events import AdCreative

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.kafka]


def ads(server: httpx.Client, preview: bool = True, **body: object) -> list[str]:
    user = f"new-{uuid.uuid4().hex[:12]}"  # never seen: no state record, no frequency caps
    r = server.post("/v1/ads", json={"user_id": user, "slot": "feed", "k": 10, "preview": preview, **body})
    assert r.status_code == 200, r.text
    assert r.json()["served_by"] == "adapter"
    return [a["ad_id"] for a in r.json()["ads"]]


def test_a_new_user_with_interests_is_ranked_towards_them(
    server: httpx.Client, catalog: list[AdCreative]
) -> None:
    category = {a.ad_id: a.category for a in catalog}
    # what the replica served before counts: a new user's recall falls back to popular ads
    # (impressions + 1), so earlier traffic that favoured one category makes a user without
    # interests see that category too (the session's other tests serve this replica first).
    # Declared interests must steer the ranking whatever the popularity prior says.
    for _ in range(30):
        ads(server, preview=False, interests=["travel"])
    without = ads(server)
    for wanted, other in (("travel", "shoes"), ("shoes", "travel")):
        steered = ads(server, interests=[wanted])
        assert {category[a] for a in steered} == {wanted}
        assert steered != without
        assert {category[a] for a in ads(server, interests=[other])} == {other}
    assert ads(server, interests=["garden"]) == without  # unknown here: today's cold start


def test_bad_interests_are_refused_and_unknown_ones_counted(server: httpx.Client) -> None:
    r = server.post("/v1/ads", json={"user_id": "u", "slot": "feed", "interests": ["food", "food"]})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][0] == "interests"
    r = server.post(
        "/v1/ads", json={"user_id": "u", "slot": "feed", "interests": [f"c{i}" for i in range(9)]}
    )
    assert r.status_code == 422 and "interests" in r.json()["error"]
    ads(server, interests=["garden", "food"])
    metrics = server.get("/metrics").text
    assert 'adstream_serving_interests_total{outcome="unknown"}' in metrics
    assert 'adstream_serving_interests_total{outcome="used"}' in metrics
