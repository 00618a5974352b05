"""The canary end to end on real Ray Serve, Redis and the broker: a candidate adapter that explains
the clicks better is promoted to 50 %, then to everyone (it becomes the stable arm); a worse one
is rolled back.

A second app (own route prefix, topic and Redis prefixes, fast canary settings) is deployed next
to the session's. The simulated users click every `tech` ad they are shown. The stable arm starts
from a snapshot that ranks `tech` ads last, the candidate gets a delta that ranks them first, so
each arm's online AUC (its served pCTR joined to the Click events it consumes) is ~0 or ~1.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import httpx
import numpy as np
import pytest
import redis
import torch
from aiokafka import AIOKafkaProducer
from helpers_serving import adapter_infos, make_delta
from prometheus_client.parser import text_string_to_metric_families

from schemas import codec, topics
from schemas.delta import AdapterState, empty_state, full_parts, select_parts
from schemas.events import AdapterDelta, AdCreative, Click, Message
from schemas.ids import impression_event_id
from schemas.settings import AbSettings, Settings
from serving.arms import ab_arm_for
from serving.canary import auc, user_bucket
from trainers.models.features import stable_bucket
from trainers.models.lora import target_shapes
from trainers.models.ranker import load_checkpoint
from trainers.snapshots import snapshot_key

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.kafka]

APP = "test-ads-canary"
PREFIX = "/canary"
SHARE = 0.25  # the canary stage's share; 0.5 at the "half" stage
ADAPTER = "feed"  # per-slot adapter scheme: the adapter of every /v1/ads for slot `feed`
K = 20
PER_ARM = 8  # requests per arm and phase: 160 impressions each, over canary_min_samples
CLICKED = "tech"  # the category every simulated user clicks
BIAS = 4.0  # logit added to (candidate) or taken from (stable) the clicked category's ads
CATEGORY: dict[str, str] = {}  # ad id → category, from the `catalog` fixture
_fresh = itertools.count()


@pytest.fixture(scope="module")
def canary(
    server: httpx.Client, serve_settings: Settings, catalog: list[AdCreative]
) -> Iterator[tuple[httpx.Client, Settings]]:
    """A second ad server app in the session's Serve instance (`server` starts it), deciding every
    second."""
    from ray import serve

    from deploy.stack import create_topics
    from serving.app import build_app

    if serve_settings.adapter_scheme != "slot" or "wide.category" not in serve_settings.lora.targets:
        pytest.skip("this test drives a per-slot adapter with a wide.category LoRA")
    CATEGORY.update({ad.ad_id: ad.category for ad in catalog})
    run = uuid.uuid4().hex[:6]
    s = Settings(
        **{
            **serve_settings.model_dump(),
            "topic_prefix": f"{serve_settings.topic_prefix}canary{run}.",
            "redis_prefix": f"{serve_settings.redis_prefix}canary{run}:",
            "canary": {
                **serve_settings.canary.model_dump(),
                "share": SHARE,
                "min_samples": 100,
                "eval_s": 1.0,
                "latency_slack": 100.0,
            },
            "recall": {**serve_settings.recall.model_dump(), "k": K},
            "rerank": {**serve_settings.rerank.model_dump(), "max_per_advertiser": K},
            "serving": {**serve_settings.serving.model_dump(), "deadline_ms": 5000},
            # the test reads each arm's ranking: every position greedy (exploration has its tests)
            "explore": {**serve_settings.explore.model_dump(), "epsilon": 0.0},
        }
    )
    create_topics(s)
    r = redis.Redis.from_url(s.redis.url)
    client = httpx.Client(base_url=f"http://{s.serving.http_host}:{s.serving.http_port}{PREFIX}", timeout=30)
    try:
        r.set(snapshot_key(s.redis_prefix, ADAPTER), codec.encode(snapshot(s)))
        serve.run(build_app(s, None), name=APP, route_prefix=PREFIX, blocking=False)
        wait_for(lambda: _healthy(client), 120, "the canary app did not get ready")
        yield client, s
    finally:
        client.close()
        serve.delete(APP)
        keys = list(r.scan_iter(match=f"{s.redis_prefix}*", count=1000))
        if keys:
            r.delete(*keys)
        r.close()


def _healthy(client: httpx.Client) -> bool:
    try:
        resp = client.get("/healthz")
        return resp.status_code == 200 and resp.json().get("status") == "ok"
    except httpx.HTTPError:
        return False


# -- adapters: one rank direction biases the clicked category on the `wide.category` table ----
def _state(s: Settings, seq: int, bias: float) -> AdapterState:
    model, version = load_checkpoint(s.model_dir / "ranker")
    st = empty_state(ADAPTER, version, target_shapes(model, s.lora.targets), s.lora.rank)
    tensors = {k: v.clone() for k, v in st.tensors.items()}
    # the lookup of category id i gains (alpha / r) · B @ A[:, i]
    tensors["wide.category.lora_A"][0, stable_bucket(CLICKED, model.config.category_buckets, "category")] = 1
    tensors["wide.category.lora_B"][0, 0] = bias * s.lora.rank / s.lora.alpha
    return AdapterState(ADAPTER, version, s.lora.rank, seq, tensors)


def snapshot(s: Settings) -> AdapterDelta:
    """Seq 0, what the replica loads at start and serves as stable: the clicked category last."""
    st = _state(s, 0, -BIAS)
    return make_delta(st, full_parts(st.tensors, s.lora.rank), 0, snapshot=True)


def delta(s: Settings, seq: int, bias: float) -> AdapterDelta:
    """The trainer's next delta: the bias direction set to `bias`."""
    return make_delta(
        _state(s, seq - 1, -bias),
        select_parts(_state(s, seq, bias).tensors, {"wide.category": torch.tensor([0])}),
        seq,
        event_id=f"canary-delta-{seq}",
    )


# -- the broker ---------------------------------------------------------------------------
async def _produce(s: Settings, msgs: list[Message]) -> None:
    p = AIOKafkaProducer(bootstrap_servers=s.kafka.bootstrap)
    await p.start()
    try:
        for m in msgs:
            topic = topics.topic_name(codec.topic_of(m), s.topic_prefix)
            await p.send(topic, codec.encode(m), key=codec.key_of(m))
        await p.flush()
    finally:
        await p.stop()


def produce(s: Settings, msgs: list[Message]) -> None:
    asyncio.run(_produce(s, msgs))


def clicks(user_id: str, body: dict) -> list[Message]:
    """What the user clicks of a response (every ad of the clicked category), as Click events."""
    now = datetime.now(UTC)
    return [
        Click(
            event_id=f"click-{imp}",
            ts=now,
            user_id=user_id,
            impression_id=imp,
            ad_id=ad["ad_id"],
            campaign_id=ad["campaign_id"],
            click_token=ad["click_token"],  # echoed, as a client does (M10.b)
        )
        for pos, ad in enumerate(body["ads"])
        if CATEGORY[ad["ad_id"]] == CLICKED
        for imp in [impression_event_id(body["request_id"], pos)]
    ]


# -- the app ------------------------------------------------------------------------------
def poll(pred: Callable[[], object], timeout: float) -> bool:
    """Whether `pred()` holds within `timeout` seconds (checked every 0.2 s)."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() >= end:
            return False
        time.sleep(0.2)
    return True


def wait_for(pred: Callable[[], object], timeout: float, why: str | Callable[[], str] = "") -> None:
    assert poll(pred, timeout), f"condition not met in {timeout:.0f}s: {why() if callable(why) else why}"


def metrics(client: httpx.Client) -> dict[str, float]:
    """The replica's canary gauges and counters: share, promote, rollback, clicks_joined."""
    out = {"promote": 0.0, "rollback": 0.0}
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for sample in fam.samples:
            if sample.name == "adstream_serving_canary_share":
                out["share"] = sample.value
            elif sample.name == "adstream_serving_canary_actions_total":
                out[sample.labels["action"]] = sample.value
            elif sample.name == "adstream_serving_clicks_joined_total":
                out["clicks_joined"] = sample.value
            elif sample.name == "adstream_serving_clicks_refused_total":
                out["clicks_refused"] = sample.value
    return out


def user(lo: float, hi: float) -> str:
    """A new user id (no frequency caps yet) whose stable hash bucket lies in [lo, hi), in the
    learning A/B arm (the control and correction arms are served without adapters)."""
    while not (
        lo <= user_bucket(u := f"canary-user-{next(_fresh)}") < hi
        and ab_arm_for(u, AbSettings()) == "learning"
    ):
        pass
    return u


def ads(client: httpx.Client, user_id: str) -> dict:
    r = client.post("/v1/ads", json={"user_id": user_id, "slot": "feed", "k": K})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["served_by"] == "adapter", body
    return body


def clicked_auc(body: dict) -> float:
    """How well one response's pCTR ranks what the users click: ~1 candidate-like, ~0 stable-like."""
    pctr = np.array([a["pctr"] for a in body["ads"]])
    labels = np.array([CATEGORY[a["ad_id"]] == CLICKED for a in body["ads"]])
    value = auc(pctr, labels)
    assert value is not None, f"a response without clicked and unclicked ads: {body['ads']}"
    return value


class Phase:
    """One round of traffic: both arms' users served, then their clicks sent until the replica acts."""

    def __init__(self, client: httpx.Client, s: Settings) -> None:
        self.client, self.s = client, s
        self.served: list[tuple[str, dict]] = []

    def ads(self, user_id: str) -> dict:
        body = ads(self.client, user_id)
        self.served.append((user_id, body))
        return body

    def traffic(self, candidate: tuple[float, float], stable: tuple[float, float]) -> None:
        for _ in range(PER_ARM):
            self.ads(user(*candidate))
            self.ads(user(*stable))

    def feedback_until(self, done: Callable[[dict[str, float]], bool], timeout: float = 60.0) -> None:
        """Send the clicks (again: a click is idempotent, and the replica's consumer starts at the
        topic's end, so a first batch may predate it) until `done(metrics)`."""
        msgs = [m for uid, body in self.served for m in clicks(uid, body)]
        assert msgs
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            produce(self.s, msgs)
            if poll(lambda: done(metrics(self.client)), 5.0):
                return
        pytest.fail(f"no canary decision in {timeout:.0f}s; replica metrics: {metrics(self.client)}")


def version(client: httpx.Client) -> str | None:
    return next((a["version"] for a in adapter_infos(client) if a["adapter_id"] == ADAPTER), None)


@pytest.mark.timeout(300)  # the session's Serve instance may start inside this test: minutes on 2 cores
def test_canary_promotes_a_better_candidate_and_rolls_back_a_worse_one(
    canary: tuple[httpx.Client, Settings],
) -> None:
    client, s = canary
    low, mid, high = (0.0, SHARE), (SHARE, 0.5), (0.5, 1.0)  # candidate / from 50 % / always stable
    assert version(client) == "seq-0"  # the snapshot, promoted to stable at start
    wait_for(lambda: metrics(client).get("share") == SHARE, 30, lambda: str(metrics(client)))
    assert metrics(client)["promote"] == 0 and metrics(client)["rollback"] == 0

    # 1. the trainer's delta (clicked category first) reaches the candidate arm only
    produce(s, [delta(s, 1, BIAS)])
    wait_for(lambda: version(client) == "seq-1", 30, lambda: f"adapters {adapter_infos(client)}")
    one = Phase(client, s)
    assert clicked_auc(one.ads(user(*low))) > 0.9
    assert clicked_auc(one.ads(user(*mid))) < 0.1  # above the candidate share: stable
    assert clicked_auc(one.ads(user(*high))) < 0.1
    one.traffic(low, high)
    one.feedback_until(lambda m: m["promote"] == 1 and m.get("share") == 0.5)
    assert metrics(client)["rollback"] == 0 and metrics(client)["clicks_joined"] > 0

    # 2. still better at 50 %: promoted to everyone — the candidate becomes the stable arm, and the
    # next candidate starts again at the canary share
    two = Phase(client, s)
    assert clicked_auc(two.ads(user(*mid))) > 0.9  # half of the users now: these too
    assert clicked_auc(two.ads(user(*high))) < 0.1
    two.traffic(low, high)
    two.feedback_until(lambda m: m["promote"] == 2 and m.get("share") == SHARE)
    three = Phase(client, s)
    assert clicked_auc(three.ads(user(*high))) > 0.9

    # 3. a worse delta (clicked category last again) on the candidate: rolled back, share 0
    produce(s, [delta(s, 2, -BIAS)])
    wait_for(lambda: version(client) == "seq-2", 30, lambda: f"adapters {adapter_infos(client)}")
    assert clicked_auc(three.ads(user(*low))) < 0.1
    assert clicked_auc(three.ads(user(*high))) > 0.9
    three.traffic(low, high)
    three.feedback_until(lambda m: m["rollback"] == 1 and m.get("share") == 0.0)
    assert metrics(client)["promote"] == 2
    assert clicked_auc(ads(client, user(*low))) > 0.9  # every user on the stable arm again


@pytest.mark.timeout(300)
def test_fabricated_clicks_never_reach_the_canary(canary: tuple[httpx.Client, Settings]) -> None:
    """M10.b: clicks without the served ad's token, or with another user's, are refused and
    counted; the served user's echo is joined."""
    client, s = canary
    uid = user(0.0, 1.0)
    body = ads(client, uid)
    genuine = clicks(uid, body)
    assert genuine
    forged = [
        *(c.model_copy(update={"event_id": f"forged-{c.event_id}", "click_token": None}) for c in genuine),
        *(
            c.model_copy(update={"event_id": f"other-{c.event_id}", "user_id": "someone-else"})
            for c in genuine
        ),
    ]
    before = metrics(client)
    end = time.monotonic() + 60
    # the replica's click consumer starts at the topic's end: send until it has seen them
    while metrics(client).get("clicks_refused", 0) - before.get("clicks_refused", 0) < len(forged):
        assert time.monotonic() < end, f"fabricated clicks not refused: {metrics(client)}"
        produce(s, forged)
        poll(lambda: False, 1.0)
    assert metrics(client).get("clicks_joined", 0) == before.get("clicks_joined", 0)
    produce(s, genuine)
    wait_for(
        lambda: metrics(client).get("clicks_joined", 0) > before.get("clicks_joined", 0),
        30,
        lambda: f"the echoed clicks were not joined: {metrics(client)}",
    )
