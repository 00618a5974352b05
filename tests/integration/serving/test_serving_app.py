"""The ad server on real Ray Serve, Redis and the broker: API, impressions, live catalog, hot swap,
poisoned deltas, rollback, overload."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime

import httpx
import pytest
import redis
import torch
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from helpers_serving import ADMIN, ADMIN_TOKEN, adapter_infos, make_delta, sign

from schemas import codec, topics
from schemas.delta import AdapterState, empty_state, encode_delta, full_parts, select_parts
from schemas.events import AdapterDelta, AdCreative, Impression
from schemas.ids import adapter_id_for
from schemas.settings import Settings
from trainers.models.lora import target_shapes
from trainers.models.ranker import load_checkpoint
from trainers.snapshots import snapshot_key

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.kafka]


def ads(client: httpx.Client, user: str, slot: str = "feed", k: int = 10, **extra: object) -> dict:
    r = client.post("/v1/ads", json={"user_id": user, "slot": slot, "k": k, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _at_positions(body: dict) -> dict[tuple[str, int], float]:
    """A response's pCTR by ad and position: what it was served at (the ranker's pCTR at the
    ad's position), comparable between responses only for the same ad at the same position."""
    return {(a["ad_id"], pos): a["pctr"] for pos, a in enumerate(body["ads"])}


def read_impressions(
    settings: Settings, user: str, enough: Callable[[list[Impression]], bool], timeout_s: float = 20
) -> list[Impression]:
    """The impressions of `user` on the impressions topic, read from the start until `enough`."""

    async def read() -> list[Impression]:
        c = AIOKafkaConsumer(
            topics.topic_name(topics.IMPRESSIONS, settings.topic_prefix),
            bootstrap_servers=settings.kafka.bootstrap,
            auto_offset_reset="earliest",
            group_id=None,
        )
        await c.start()
        found: list[Impression] = []
        try:
            end = time.monotonic() + timeout_s
            while time.monotonic() < end and not enough(found):
                batch = await c.getmany(timeout_ms=500)
                for recs in batch.values():
                    for rec in recs:
                        imp = codec.decode(Impression, rec.value)
                        if isinstance(imp, Impression) and imp.user_id == user:
                            found.append(imp)
        finally:
            await c.stop()
        return found

    return asyncio.run(read())


async def produce(settings: Settings, msgs: list[AdapterDelta | AdCreative]) -> None:
    p = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap)
    await p.start()
    try:
        for m in msgs:
            await p.send_and_wait(
                topics.topic_name(codec.topic_of(m), settings.topic_prefix),
                codec.encode(m),
                key=codec.key_of(m),
            )
    finally:
        await p.stop()


def wait_for(pred, timeout: float = 30.0, every: float = 0.2, why=None):  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        assert time.monotonic() < end, f"condition not met in time; {why() if why else ''}"
        time.sleep(every)


def test_request_returns_k_ads_from_the_catalog(server: httpx.Client, catalog: list[AdCreative]) -> None:
    body = ads(server, "u-basic", k=7)
    assert len(body["ads"]) == 7 and {a["ad_id"] for a in body["ads"]} <= {ad.ad_id for ad in catalog}
    assert body["model_version"].startswith("ranker-") and set(body["stage_ms"]) == {
        "recall",
        "rank",
        "rerank",
    }
    assert body["served_by"] == "adapter" and body["degraded"] is False
    assert all(0 <= a["pctr"] <= 1 and a["price"] >= 0 for a in body["ads"])
    tight = ads(server, "u-basic2", deadline_ms=1)
    assert tight["degraded"] is True and tight["served_by"] == "popular" and len(tight["ads"]) == 10


def test_api_errors_docs_and_metrics(server: httpx.Client) -> None:
    r = server.post("/v1/ads", json={"user_id": "u", "slot": "feed", "k": 0})
    assert r.status_code == 422 and "'k'" in r.json()["error"]
    r = server.post("/v1/ads", json={"user_id": "u", "slot": "tv"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["slot"]
    assert server.post("/v1/ads", json={"user_id": "u", "slot": "feed", "x": 1}).status_code == 422
    big = b'{"user_id":"' + b"u" * 70_000 + b'"}'
    assert (
        server.post("/v1/ads", content=big, headers={"content-type": "application/json"}).status_code == 413
    )
    assert server.get("/docs").status_code == 200
    spec = server.get("/openapi.json").json()
    assert "/v1/ads" in spec["paths"] and "/v1/adapters/{adapter_id}/rollback" in spec["paths"]
    metrics = server.get("/metrics").text
    assert 'adstream_serving_requests_total{status="422"}' in metrics
    assert "adstream_serving_stage_latency_seconds_bucket" in metrics and "ad_id" not in metrics


def test_served_ads_are_produced_as_impressions(server: httpx.Client, serve_settings: Settings) -> None:
    body = ads(server, "u-imp", k=5)
    found = read_impressions(serve_settings, "u-imp", lambda got: len(got) >= 5)
    found = sorted((i for i in found if i.request_id == body["request_id"]), key=lambda i: i.position)
    assert [i.ad_id for i in found] == [a["ad_id"] for a in body["ads"]]
    assert all(i.user_id == "u-imp" and i.model_version == body["model_version"] for i in found)
    assert [i.pctr for i in found] == pytest.approx([a["pctr"] for a in body["ads"]])
    assert found[0].event_id == f"{body['request_id']}/0"


def test_a_preview_is_answered_but_not_served(server: httpx.Client, serve_settings: Settings) -> None:
    """`preview: true` (monitors, freshness probes) ranks and answers as usual — the same ads a
    real request would get, the adapter version — but logs no impression (nor caps, spend or
    canary samples: a probe polling a user must not flood the canary's windows)."""
    previews = [ads(server, "u-preview", k=5, preview=True) for _ in range(3)]
    real = ads(server, "u-preview", k=5)
    assert all(p["ads"] and p["adapter_version"] == real["adapter_version"] for p in previews)
    assert [a["ad_id"] for a in previews[0]["ads"]] == [a["ad_id"] for a in real["ads"]]  # nothing capped

    got = read_impressions(
        serve_settings, "u-preview", lambda got: real["request_id"] in {i.request_id for i in got}
    )
    assert {i.request_id for i in got} == {real["request_id"]}  # the real request's, none of the previews'
    # each impression names its A/B arm and the probability it was chosen with (greedy here: 1)
    assert {i.ab_arm for i in got} <= {"learning", "correction", "control"}
    assert {i.propensity for i in got} == {1.0} and not any(i.explored for i in got)


def test_frequency_cap_and_live_catalog(
    server: httpx.Client, serve_settings: Settings, catalog: list[AdCreative]
) -> None:
    seen: Counter[str] = Counter()
    for _ in range(4):
        seen.update(a["ad_id"] for a in ads(server, "u-cap", k=10)["ads"])
        time.sleep(0.3)  # the impression counters are written after the response
    assert max(seen.values()) <= serve_settings.serving.frequency_cap
    new = AdCreative(
        event_id="new-1",
        ts=datetime.now(UTC),
        ad_id="ad-brand-new",
        campaign_id="c-new",
        advertiser_id="v-new",
        category="zzfresh",
        title="zzfresh unique gadget",
        bid=50.0,
        daily_budget=1e6,
        active=True,
    )
    asyncio.run(produce(serve_settings, [new]))
    got = wait_for(
        lambda: (
            "ad-brand-new"
            in {
                a["ad_id"]
                for a in ads(server, f"u-new-{uuid.uuid4().hex[:6]}", context={"category": "zzfresh"})["ads"]
            }
        )
    )
    assert got
    lines = server.get("/metrics").text.splitlines()
    gauge = next(x for x in lines if x.startswith("adstream_serving_catalog_ads "))
    assert float(gauge.split()[1]) == len(catalog) + 1


def _step(state: AdapterState, scale: float, seed: int) -> tuple[AdapterState, AdapterDelta]:
    g = torch.Generator().manual_seed(seed)
    new = {k: v.clone() for k, v in state.tensors.items()}
    for k in new:
        if k.endswith("lora_A"):
            new[k][:2] = torch.randn(2, new[k].shape[1], generator=g) * scale
        else:
            new[k][:, :2] = torch.randn(new[k].shape[0], 2, generator=g) * scale
    parts = select_parts(new, {m: torch.tensor([0, 1]) for m in state.modules})
    return AdapterState(state.adapter_id, state.base_version, state.rank, state.seq + 1, new), make_delta(
        state, parts, state.seq + 1
    )


@pytest.mark.one_hour  # compares pCTRs across requests; the ranker reads the UTC hour
def test_delta_hot_swap_poison_rollback(server: httpx.Client, serve_settings: Settings) -> None:
    s = serve_settings
    model, version = load_checkpoint(s.model_dir / "ranker")
    shapes = target_shapes(model, s.lora.targets)
    aid = adapter_id_for("search", "", s.adapter_scheme) if s.adapter_scheme == "slot" else None
    if aid is None:
        pytest.skip("this test drives the per-slot adapter scheme")
    st0 = empty_state(aid, version, shapes, s.lora.rank)
    # previews: nothing counted or spent, so every probe ranks the same candidates in the same
    # order and an ad's pCTR (the ranker's at its position) moves only with the weights
    before = {
        a["ad_id"]: a["pctr"] for a in ads(server, "cold-before", slot="search", k=20, preview=True)["ads"]
    }
    st1, d1 = _step(st0, 0.2, 1)
    asyncio.run(produce(s, [d1]))

    def info() -> dict | None:
        return next((a for a in adapter_infos(server) if a["adapter_id"] == aid), None)

    def state() -> str:
        deltas = [x for x in server.get("/metrics").text.splitlines() if "deltas_total{" in x]
        return f"adapters={adapter_infos(server)} deltas={deltas}"

    wait_for(lambda: (info() or {}).get("version") == "seq-0", why=state)
    after = ads(server, "cold-after", slot="search", k=20, preview=True)
    assert after["adapter_version"] == "seq-0"
    common = set(before) & {a["ad_id"] for a in after["ads"]}
    assert common
    changed = [abs(before[a] - p["pctr"]) > 1e-6 for p in after["ads"] for a in [p["ad_id"]] if a in common]
    assert all(changed)
    served = _at_positions(after)

    # poisoned deltas at the next seq: NaN, norm over the bound, wrong shape → all rejected
    m = st1.modules[0]
    nan_t = {k: v.clone() for k, v in st1.tensors.items()}
    nan_t[f"{m}.lora_A"][0, 0] = float("nan")
    nan = sign(
        d1.model_copy(
            update={
                "seq": 1,
                "event_id": "poison-nan",
                "payload": encode_delta(select_parts(nan_t, {m: torch.tensor([0])})),
            }
        )
    )
    huge = _step(st1, 50.0, 2)[1].model_copy(update={"event_id": "poison-huge"})
    narrow = {f"{m}.lora_A": st1.tensors[f"{m}.lora_A"][:, :-3], f"{m}.lora_B": st1.tensors[f"{m}.lora_B"]}
    shape = make_delta(
        AdapterState(aid, version, s.lora.rank, 0, narrow),
        select_parts(narrow, {m: torch.tensor([0])}),
        1,
        event_id="poison-shape",
    )
    asyncio.run(produce(s, [nan, huge, shape]))
    wait_for(lambda: (info() or {}).get("rejected_deltas", 0) >= 3, why=state)
    assert info()["version"] == "seq-0"  # type: ignore[index]
    again = _at_positions(ads(server, "cold-again", slot="search", k=20, preview=True))
    assert set(again) & set(served)
    assert all(again[a] == pytest.approx(served[a], abs=1e-6) for a in set(again) & set(served))
    metrics = server.get("/metrics").text
    assert 'adstream_serving_deltas_total{outcome="rejected"} 3.0' in metrics

    # a good next delta, then an admin rollback to the version before it
    st2, d2 = _step(st1, 0.1, 3)
    asyncio.run(produce(s, [d2]))
    wait_for(lambda: (info() or {}).get("version") == "seq-1", why=state)
    url = f"/v1/adapters/{aid}/rollback"
    assert server.post(url).status_code == 401
    assert server.post(url, headers={"Authorization": "Bearer wrong"}).status_code == 403
    r = server.post(url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code == 200 and r.json()["version"] == "seq-0"
    assert server.post("/v1/adapters/nope/rollback", headers=ADMIN).status_code == 404
    back = _at_positions(ads(server, "cold-back", slot="search", k=20, preview=True))
    assert set(back) & set(served)
    assert all(back[a] == pytest.approx(served[a], abs=1e-6) for a in set(back) & set(served))

    # the rollback is pinned (shared in Redis): the trainer's next delta — a seq gap for the replica,
    # which would otherwise re-sync the rolled-back weights from the snapshot — is held back
    st3, d3 = _step(st2, 0.1, 4)
    rc = redis.Redis.from_url(s.redis.url)
    try:
        assert rc.hget(f"{s.redis_prefix}adapter-pins", aid) == b"0"
        rc.set(
            snapshot_key(s.redis_prefix, aid),
            codec.encode(make_delta(st3, full_parts(st3.tensors, s.lora.rank), st3.seq, snapshot=True)),
        )
        asyncio.run(produce(s, [d3]))
        wait_for(
            lambda: 'adstream_serving_deltas_total{outcome="pinned"} 1.0' in server.get("/metrics").text,
            why=state,
        )
        assert info()["version"] == "seq-0" and info()["pinned"]  # type: ignore[index]
        unpin = f"/v1/adapters/{aid}/unpin"
        assert server.post(unpin, headers={"Authorization": "Bearer wrong"}).status_code == 403
        r = server.post(unpin, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert r.status_code == 200 and not r.json()["pinned"] and r.json()["version"] == f"seq-{st3.seq}"
        assert rc.hget(f"{s.redis_prefix}adapter-pins", aid) is None
    finally:
        rc.delete(snapshot_key(s.redis_prefix, aid))
        rc.close()


def test_overload_sheds_with_503_and_retry_after(server: httpx.Client) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=str(server.base_url), timeout=30) as c:
            return await asyncio.gather(
                *[
                    c.post("/v1/ads", json={"user_id": f"burst{i}", "slot": "feed", "k": 10})
                    for i in range(120)
                ]
            )

    codes = Counter()
    retry = set()
    for resp in asyncio.run(burst()):
        codes[resp.status_code] += 1
        if resp.status_code == 503:
            retry.add(resp.headers.get("retry-after"))
    assert codes[503] > 0 and codes[200] > 0 and set(codes) <= {200, 503}, codes
    assert retry == {"1"}
    assert server.get("/healthz").status_code == 200


def test_qos_sheds_the_lower_class_and_serves_the_top_one(server: httpx.Client) -> None:
    """A burst of Guaranteed and BestEffort requests at once: with the gate's slots taken, a
    BestEffort request that would have to wait is shed (its queue holds none here) with its
    class's Retry-After, and no Guaranteed request is (its queue holds them all)."""

    async def burst() -> list[tuple[str, httpx.Response]]:
        async with httpx.AsyncClient(base_url=str(server.base_url), timeout=60) as c:
            classes = ["besteffort", "besteffort", "guaranteed"] * 20
            sent = [
                c.post("/v1/ads", json={"user_id": f"qos{i}", "slot": "feed", "k": 5, "qos": cls})
                for i, cls in enumerate(classes)
            ]
            return list(zip(classes, await asyncio.gather(*sent), strict=True))

    codes: dict[str, Counter[int]] = {"guaranteed": Counter(), "besteffort": Counter()}
    retry = set()
    for cls, resp in asyncio.run(burst()):
        codes[cls][resp.status_code] += 1
        if resp.status_code == 503:
            retry.add(resp.headers.get("retry-after"))
            assert cls in resp.json()["detail"]
    assert codes["guaranteed"] == Counter({200: 20}), codes
    assert codes["besteffort"][503] > 0 and set(codes["besteffort"]) <= {200, 503}, codes
    assert retry == {"2"}  # BestEffort's Retry-After
    assert server.post("/v1/ads", json={"user_id": "q", "slot": "feed", "qos": "gold"}).status_code == 422
    metrics = server.get("/metrics").text
    assert 'adstream_serving_qos_requests_total{outcome="queue_full",qos="besteffort"}' in metrics
    assert 'adstream_serving_qos_requests_total{outcome="served",qos="guaranteed"} ' in metrics


def test_replica_starts_from_redis_snapshots_and_resyncs_on_a_gap(
    server: httpx.Client, serve_settings: Settings, write_snapshot
) -> None:  # type: ignore[no-untyped-def]
    s = serve_settings
    if s.adapter_scheme != "slot":
        pytest.skip("this test drives the per-slot adapter scheme")

    def info() -> dict:
        return next(a for a in adapter_infos(server) if a["adapter_id"] == "splash")

    assert info()["version"] == "seq-4"  # loaded from the snapshot the conftest stored before start
    assert ads(server, "cold-splash", slot="splash")["adapter_version"] == "seq-4"
    # the trainer moves on to seq 6 (snapshot in Redis) and the replica only sees delta 7: a gap
    write_snapshot("splash", 6, 6)
    from schemas.delta import AdapterState
    from trainers.models.ranker import load_checkpoint

    _, version = load_checkpoint(s.model_dir / "ranker")
    snap6 = codec.decode(
        AdapterDelta, __import__("redis").Redis.from_url(s.redis.url).get(f"{s.redis_prefix}adapter:splash")
    )
    assert isinstance(snap6, AdapterDelta) and snap6.seq == 6
    from schemas.delta import apply_delta, empty_state
    from trainers.models.lora import target_shapes

    model, _ = load_checkpoint(s.model_dir / "ranker")
    shapes = target_shapes(model, s.lora.targets)
    st6 = apply_delta(empty_state("splash", version, shapes, s.lora.rank), snap6, s.online.delta_max_norm)
    assert isinstance(st6, AdapterState)
    _, d7 = _step(st6, 0.05, 7)
    asyncio.run(produce(s, [d7]))
    # the gap made it re-sync from the snapshot (seq 6), then apply delta 7 on top of it
    wait_for(lambda: info()["version"] == "seq-7")
    metrics = server.get("/metrics").text
    assert 'adstream_serving_deltas_total{outcome="gap"} 1.0' in metrics
    assert 'adstream_serving_deltas_total{outcome="resync_applied"} 1.0' in metrics
    assert 'adstream_serving_deltas_total{outcome="after_resync_applied"} 1.0' in metrics


def test_warm_user_state_from_redis_steers_recall(
    server: httpx.Client, serve_settings: Settings, catalog: list[AdCreative]
) -> None:
    """A user record written by streams (`schemas.user_record`) drives the query."""
    import numpy as np
    import redis

    from schemas.user_record import UserState, encode_state, user_key
    from schemas.vectors import content_vector

    s = serve_settings
    now = time.time()
    vec = np.asarray(content_vector("travel", "travel offer", s.state_dim), dtype=np.float32)
    state = UserState(
        user_id="u-travel",
        dim=s.state_dim,
        vector=vec,
        intents={"travel": 3.0},
        last_ts=now,
        session_start_ts=now,
    )
    r = redis.Redis.from_url(s.redis.url)
    r.set(user_key(s.redis_prefix, "u-travel"), encode_state(state))
    r.close()
    category = {ad.ad_id: ad.category for ad in catalog}
    warm = [category.get(a["ad_id"], "") for a in ads(server, "u-travel", k=10)["ads"]]
    cold = [category.get(a["ad_id"], "") for a in ads(server, "u-nobody", k=10)["ads"]]
    assert warm.count("travel") >= 6 and warm.count("travel") > cold.count("travel")


@pytest.mark.one_hour  # compares pCTRs across requests; the ranker reads the UTC hour
def test_the_users_per_category_bias_moves_the_served_pctr_of_that_category_only(
    server: httpx.Client, serve_settings: Settings, catalog: list[AdCreative]
) -> None:
    """The per-user correction streams keeps (`UserState.bias`, record format 2) is added to the
    ranker's logit of each candidate of that category: the same user, ad, arm and position get
    σ(logit + b) after the record gains the bias, other categories what they got before (the
    served pCTR is the ranker's at the ad's position: an ad the bias moved is compared at none)."""
    import math

    import numpy as np
    import redis

    from schemas.user_record import UserState, encode_state, user_key
    from schemas.vectors import content_vector

    s = serve_settings
    now = time.time()
    vec = np.asarray(content_vector("travel", "travel offer", s.state_dim), dtype=np.float32)
    r = redis.Redis.from_url(s.redis.url)

    def served(bias: dict[str, float]) -> dict[str, float]:
        state = UserState(
            user_id="u-biased", dim=s.state_dim, vector=vec, intents={"travel": 3.0}, last_ts=now,
            session_start_ts=now, events=1, bias=bias,
        )  # fmt: skip
        r.set(user_key(s.redis_prefix, "u-biased"), encode_state(state))
        return {(a["ad_id"], pos): a["pctr"] for pos, a in enumerate(ads(server, "u-biased", k=10)["ads"])}

    try:
        before = served({})
        after = served({"travel": 2.0})
    finally:
        r.delete(user_key(s.redis_prefix, "u-biased"))
        r.close()
    category = {ad.ad_id: ad.category for ad in catalog}
    both = [a for a in before if a in after]  # the same ad at the same position
    travel = [a for a in both if category[a[0]] == "travel"]
    assert travel, (before, after)

    def logit(p: float) -> float:
        return math.log(p / (1 - p))

    for a in travel:
        assert logit(after[a]) - logit(before[a]) == pytest.approx(2.0, abs=1e-3)
    for a in (a for a in both if category[a[0]] != "travel"):
        assert after[a] == pytest.approx(before[a], abs=1e-6)
