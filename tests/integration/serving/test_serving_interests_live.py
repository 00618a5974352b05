"""Declared interests on the real ad server: a brand-new user is ranked towards them, bad lists
are refused naming the field, unknown categories are ignored and counted."""

from __future__ import annotations

import uuid

import httpx
import pytest

from schemas.events import AdCreative

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.kafka]


def ads(server: httpx.Client, **body: object) -> list[str]:
    user = f"new-{uuid.uuid4().hex[:12]}"  # never seen: no state record, no frequency caps
    r = server.post("/v1/ads", json={"user_id": user, "slot": "feed", "k": 10, "preview": True, **body})
    assert r.status_code == 200, r.text
    assert r.json()["served_by"] == "adapter"
    return [a["ad_id"] for a in r.json()["ads"]]


def test_a_new_user_with_interests_is_ranked_towards_them(
    server: httpx.Client, catalog: list[AdCreative]
) -> None:
    category = {a.ad_id: a.category for a in catalog}
    without = ads(server)
    with_travel = ads(server, interests=["travel"])
    assert with_travel != without
    assert {category[a] for a in with_travel} == {"travel"}
    assert {category[a] for a in without} != {"travel"}
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
