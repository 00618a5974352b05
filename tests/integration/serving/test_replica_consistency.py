"""Adapters and pins stay consistent across the ad server's replicas (issue 13): on real Ray Serve,
Redis and the broker, two replicas of the ad server each follow the trainer's signed deltas, and an
admin rollback on one of them pins the same version, with the same weights, on both.

A second app with 2 replicas (the deployment `adstream serve --replicas 2` makes: `build_app` with
the streams user codec; own name, route prefix, topic and Redis prefixes) is deployed next to the
session's. Each replica is addressed on its own direct-ingress port (found by asking every port of
the range which app it serves, `/-/routes`), never through a load balancer, so every assertion is
about one known replica.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import pytest
import redis
import torch
from aiokafka import AIOKafkaProducer
from helpers_serving import ADMIN, adapter_infos, make_delta

from schemas import codec, topics
from schemas.delta import AdapterState, empty_state, full_parts, select_parts
from schemas.events import AdapterDelta
from schemas.settings import Settings
from trainers.models.lora import target_shapes
from trainers.models.ranker import load_checkpoint
from trainers.snapshots import snapshot_key

# every test compares the pCTRs of requests minutes apart, and the ranker reads the UTC hour
pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.kafka, pytest.mark.one_hour]

APP = "test-ads-replicas"
PREFIX = "/replicas"
# a per-slot adapter for each test, so no test depends on what another left
FOLLOWED = "feed"
RACED = "search"
RESTARTED = "splash"


# -- the trainer's side: a seq of adapter states, each delta changing two rank directions -------
def lineage(s: Settings, adapter_id: str, n: int) -> list[AdapterState]:
    """States seq 0 … n-1 of one adapter; state k+1 differs from state k in two rank directions."""
    model, version = load_checkpoint(s.model_dir / "ranker")
    st = empty_state(adapter_id, version, target_shapes(model, s.lora.targets), s.lora.rank)
    g = torch.Generator().manual_seed(sum(map(ord, adapter_id)))
    tensors = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in st.tensors.items()}
    out = [AdapterState(adapter_id, version, s.lora.rank, 0, tensors)]
    for seq in range(1, n):
        new = {k: v.clone() for k, v in out[-1].tensors.items()}
        for k in new:
            if k.endswith("lora_A"):
                new[k][:2] = torch.randn(2, new[k].shape[1], generator=g) * 0.1
            else:
                new[k][:, :2] = torch.randn(new[k].shape[0], 2, generator=g) * 0.1
        out.append(AdapterState(adapter_id, version, s.lora.rank, seq, new))
    return out


def snapshot(st: AdapterState) -> AdapterDelta:
    """A full, signed snapshot of a state (what the trainer stores in Redis and publishes)."""
    return make_delta(st, full_parts(st.tensors, st.rank), st.seq, snapshot=True)


def delta(states: list[AdapterState], seq: int) -> AdapterDelta:
    """The signed delta from state seq-1 to state seq (the two directions that moved)."""
    prev = states[seq - 1]
    parts = select_parts(states[seq].tensors, {m: torch.tensor([0, 1]) for m in prev.modules})
    return make_delta(prev, parts, seq)


async def _produce(s: Settings, msgs: list[AdapterDelta]) -> None:
    p = AIOKafkaProducer(bootstrap_servers=s.kafka.bootstrap)
    await p.start()
    try:
        for m in msgs:  # key = adapter id, as the trainer produces: one partition, seq order
            await p.send_and_wait(
                topics.topic_name(topics.ADAPTER_DELTAS, s.topic_prefix), codec.encode(m), key=codec.key_of(m)
            )
    finally:
        await p.stop()


def produce(s: Settings, msgs: list[AdapterDelta]) -> None:
    asyncio.run(_produce(s, msgs))


def store_snapshot(s: Settings, st: AdapterState) -> None:
    """The trainer's periodic snapshot in Redis (what a replica re-syncs from, e.g. after unpin)."""
    r = redis.Redis.from_url(s.redis.url)
    try:
        r.set(snapshot_key(s.redis_prefix, st.adapter_id), codec.encode(snapshot(st)))
    finally:
        r.close()


def pin_of(s: Settings, adapter_id: str) -> bytes | None:
    r = redis.Redis.from_url(s.redis.url)
    try:
        return r.hget(f"{s.redis_prefix}adapter-pins", adapter_id)  # type: ignore[return-value]
    finally:
        r.close()


# -- the replicas -------------------------------------------------------------------------
def poll(pred: Callable[[], object], timeout: float) -> bool:
    """Whether `pred()` holds within `timeout` seconds (checked every 0.2 s)."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() >= end:
            return False
        time.sleep(0.2)
    return True


def wait_for(pred: Callable[[], object], timeout: float, why: Callable[[], str]) -> None:
    assert poll(pred, timeout), f"condition not met in {timeout:.0f}s: {why()}"


def replica_urls(s: Settings) -> list[str]:
    """The direct-ingress URLs of this app's replicas (each port says which app it serves)."""
    lo = int(os.environ.get("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", s.serving.http_port + 1))
    hi = int(os.environ.get("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", s.serving.http_port + 64))
    urls = []
    for port in range(lo, hi + 1):
        url = f"http://{s.serving.http_host}:{port}"
        try:
            routes = httpx.get(f"{url}/-/routes", timeout=0.5).json()
        except (httpx.HTTPError, ValueError):
            continue
        if isinstance(routes, dict) and routes.get(PREFIX) == APP:
            urls.append(url)
    return urls


def _healthy(client: httpx.Client) -> bool:
    try:
        resp = client.get("/healthz")
        return resp.status_code == 200 and resp.json().get("status") == "ok"
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def replicas(server: httpx.Client, serve_settings: Settings) -> Iterator[tuple[list[httpx.Client], Settings]]:
    """Two replicas of a second ad server app in the session's Serve instance (`server` starts it),
    each adapter starting from a trainer snapshot at seq 0."""
    from ray import serve

    from deploy.stack import create_topics
    from serving.app import build_app
    from serving.io import UserRecordCodec

    if serve_settings.adapter_scheme != "slot":
        pytest.skip("this test drives the per-slot adapters")
    run = uuid.uuid4().hex[:6]
    s = Settings(
        **{
            **serve_settings.model_dump(),
            "topic_prefix": f"{serve_settings.topic_prefix}replicas{run}.",
            "redis_prefix": f"{serve_settings.redis_prefix}replicas{run}:",
            "serving": {**serve_settings.serving.model_dump(), "replicas": 2},
            "canary": {**serve_settings.canary.model_dump(), "share": 1.0},
        }
    )
    create_topics(s)
    for adapter_id in (FOLLOWED, RACED, RESTARTED):
        store_snapshot(s, lineage(s, adapter_id, 1)[0])
    clients: list[httpx.Client] = []
    try:
        serve.run(build_app(s, UserRecordCodec(s.state)), name=APP, route_prefix=PREFIX, blocking=False)
        wait_for(lambda: len(replica_urls(s)) == 2, 180, lambda: f"{APP} on direct ports: {replica_urls(s)}")
        clients = [httpx.Client(base_url=f"{url}{PREFIX}", timeout=30) for url in replica_urls(s)]
        wait_for(lambda: all(_healthy(c) for c in clients), 60, lambda: "replicas not ready")
        yield clients, s
    finally:
        for c in clients:
            c.close()
        serve.delete(APP)
        r = redis.Redis.from_url(s.redis.url)
        keys = list(r.scan_iter(match=f"{s.redis_prefix}*", count=1000))
        if keys:
            r.delete(*keys)
        r.close()


def info(client: httpx.Client, adapter_id: str) -> dict:
    """What one replica reports of an adapter (`/v1/adapters`); {} when it holds none."""
    return next((a for a in adapter_infos(client) if a["adapter_id"] == adapter_id), {})


def views(clients: list[httpx.Client], adapter_id: str) -> str:
    """Every replica's view of an adapter and its delta counters (for failure messages)."""
    return "; ".join(f"{c.base_url}: {info(c, adapter_id)} {deltas(c)}" for c in clients)


def deltas(client: httpx.Client) -> dict[str, float]:
    """One replica's `adstream_serving_deltas_total` by outcome."""
    out: dict[str, float] = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith('adstream_serving_deltas_total{outcome="'):
            outcome = line.split('"')[1]
            out[outcome] = float(line.split()[-1])
    return out


def served(client: httpx.Client, slot: str) -> tuple[str | None, dict[tuple[str, int], float]]:
    """The adapter version and the pCTR by (ad, position) one replica serves a cold user in
    `slot` (a preview: nothing logged, spent or capped, so every call and replica ranks the same
    candidates; the pCTR is the ranker's at the ad's position: compared at the same one)."""
    r = client.post("/v1/ads", json={"user_id": "consistency-probe", "slot": slot, "k": 20, "preview": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["served_by"] == "adapter", body
    return body["adapter_version"], {(a["ad_id"], pos): a["pctr"] for pos, a in enumerate(body["ads"])}


def same_weights(a: dict[tuple[str, int], float], b: dict[tuple[str, int], float]) -> bool:
    """Whether two responses' pCTRs agree on the (ad, position) pairs both hold, and there are
    some (none: the two rank differently, so their weights differ)."""
    common = set(a) & set(b)
    return bool(common) and all(abs(a[k] - b[k]) <= 1e-6 for k in common)


def rollback(client: httpx.Client, adapter_id: str) -> httpx.Response:
    return client.post(f"/v1/adapters/{adapter_id}/rollback", headers=ADMIN)


@pytest.mark.timeout(300)  # the session's Serve instance and this app's 2 replicas may start here
def test_a_delta_reaches_both_replicas_and_a_rollback_pins_both(
    replicas: tuple[list[httpx.Client], Settings],
) -> None:
    (a, b), s = replicas
    aid, both = FOLLOWED, replicas[0]
    states = lineage(s, aid, 4)
    assert a.base_url != b.base_url
    for c in both:
        assert info(c, aid)["version"] == "seq-0", views(both, aid)  # the snapshot, at start

    # 1. each signed delta reaches both replicas; they serve the same weights
    produce(s, [delta(states, 1)])
    wait_for(lambda: all(info(c, aid).get("version") == "seq-1" for c in both), 30, lambda: views(both, aid))
    (va, at_1), (vb, b_1) = served(a, aid), served(b, aid)
    assert va == vb == "seq-1" and same_weights(at_1, b_1)
    produce(s, [delta(states, 2)])
    wait_for(lambda: all(info(c, aid).get("version") == "seq-2" for c in both), 30, lambda: views(both, aid))
    assert not same_weights(served(a, aid)[1], at_1)  # seq 2 ranks differently: the probe sees weights

    # 2. one rollback, on replica a: b follows the pin (Redis) to the same version and weights
    r = rollback(a, aid)
    assert r.status_code == 200, r.text
    assert r.json()["version"] == "seq-1" and r.json()["pinned"]
    assert pin_of(s, aid) == b"1"
    wait_for(lambda: info(b, aid).get("pinned") is True, 30, lambda: views(both, aid))
    for c in both:
        assert info(c, aid)["version"] == "seq-1", views(both, aid)
        version, pctr = served(c, aid)
        assert version == "seq-1" and same_weights(pctr, at_1), c.base_url

    # 3. the trainer's next delta after the rollback reaches both replicas and moves neither
    before = [deltas(c).get("pinned", 0.0) for c in both]
    produce(s, [delta(states, 3)])
    wait_for(
        lambda: all(deltas(c).get("pinned", 0.0) == n + 1 for c, n in zip(both, before, strict=True)),
        30,
        lambda: views(both, aid),
    )
    for c in both:
        assert info(c, aid)["version"] == "seq-1" and info(c, aid)["pinned"], views(both, aid)
        assert same_weights(served(c, aid)[1], at_1), c.base_url
    assert pin_of(s, aid) == b"1"

    # 4. unpinned on the other replica: both re-sync from the trainer's latest snapshot
    store_snapshot(s, states[3])
    r = b.post(f"/v1/adapters/{aid}/unpin", headers=ADMIN)
    assert r.status_code == 200 and not r.json()["pinned"] and r.json()["version"] == "seq-3", r.text
    wait_for(
        lambda: all(info(c, aid).get("version") == "seq-3" and not info(c, aid)["pinned"] for c in both),
        30,
        lambda: views(both, aid),
    )
    assert pin_of(s, aid) is None
    assert same_weights(served(a, aid)[1], served(b, aid)[1])


@pytest.mark.timeout(300)
def test_a_rollback_racing_deltas_pins_one_version_on_both_replicas(
    replicas: tuple[list[httpx.Client], Settings],
) -> None:
    """Deltas keep arriving while replica a rolls back: whichever seq a pins (the previous of what
    it held then), b ends pinned at that seq with a's weights, whether b was behind, level or ahead
    of a (its own previous version, its current one, or the weights stored with the pin)."""
    (a, b), s = replicas
    aid, both = RACED, replicas[0]
    n = 12
    states = lineage(s, aid, n + 1)
    produce(s, [delta(states, 1)])
    wait_for(lambda: all(info(c, aid).get("version") == "seq-1" for c in both), 30, lambda: views(both, aid))

    # the trainer publishes seq 2 … n-1 one by one while the admin rolls back on a
    def publish() -> None:
        for seq in range(2, n):
            produce(s, [delta(states, seq)])

    producer = threading.Thread(target=publish, daemon=True)
    producer.start()
    wait_for(lambda: info(a, aid).get("seq", 0) >= 2, 30, lambda: views(both, aid))
    answers = []
    while True:
        r = rollback(a, aid)
        answers.append(r.status_code)
        if r.status_code == 200:
            break
        assert r.status_code == 409, r.text  # its previous version moved meanwhile: try again
        assert len(answers) < 50, answers
    pinned = r.json()
    assert pinned["pinned"]
    producer.join(60)
    assert not producer.is_alive()
    seq = pinned["seq"]
    assert pin_of(s, aid) == str(seq).encode()

    # b follows the pin; then a last delta: once each replica has counted it as held back by the
    # pin, it has seen every delta before it (one partition, in order)
    wait_for(lambda: info(b, aid).get("pinned") is True, 30, lambda: views(both, aid))
    before = [deltas(c).get("pinned", 0.0) for c in both]
    produce(s, [delta(states, n)])
    wait_for(
        lambda: all(deltas(c).get("pinned", 0.0) > k for c, k in zip(both, before, strict=True)),
        30,
        lambda: views(both, aid),
    )
    for c in both:
        got = info(c, aid)
        assert got["version"] == f"seq-{seq}" and got["pinned"], views(both, aid)
    (va, pa), (vb, pb) = served(a, aid), served(b, aid)
    assert va == vb == f"seq-{seq}" and same_weights(pa, pb), views(both, aid)
    for c in both:
        assert c.post(f"/v1/adapters/{aid}/unpin", headers=ADMIN).status_code == 200


def _replica_actors() -> list[str]:
    """The Ray actor names of this app's replicas."""
    import ray

    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and a["name"].startswith(f"SERVE_REPLICA::{APP}#")
    ]


def _down(client: httpx.Client) -> bool:
    """Whether a replica's port refuses connections (its process is gone; a slow one still accepts)."""
    try:
        client.get("/healthz")
    except httpx.ConnectError:
        return True
    return False


@pytest.mark.timeout(300)
def test_a_replica_started_after_a_rollback_comes_up_pinned_with_the_pinned_weights(
    replicas: tuple[list[httpx.Client], Settings],
) -> None:
    """A replica that starts after a rollback elsewhere (Serve replacing a dead one, a scale-up)
    holds no history of the adapter: it loads the trainer's latest snapshot, which the admin rolled
    away from, and must install the weights stored with the pin, as the other replica serves them."""
    import ray

    (a, b), s = replicas
    aid, both = RESTARTED, replicas[0]
    states = lineage(s, aid, 4)
    produce(s, [delta(states, 1), delta(states, 2)])
    wait_for(lambda: all(info(c, aid).get("version") == "seq-2" for c in both), 30, lambda: views(both, aid))
    r = rollback(a, aid)
    assert r.status_code == 200 and r.json()["version"] == "seq-1", r.text
    wait_for(lambda: info(b, aid).get("pinned") is True, 30, lambda: views(both, aid))
    pinned_pctr = served(a, aid)[1]
    # the trainer goes on: its next delta (held back by the pin) and its snapshot of that state
    produce(s, [delta(states, 3)])
    store_snapshot(s, states[3])

    names = _replica_actors()
    assert len(names) == 2, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    wait_for(lambda: any(_down(c) for c in both), 30, lambda: "no replica went down")
    survivor = next(c for c in both if not _down(c))
    old = str(survivor.base_url).removesuffix("/").removesuffix(PREFIX)
    fresh: list[str] = []

    def replaced() -> bool:  # Serve starts a replica in place of the dead one
        fresh[:] = [u for u in replica_urls(s) if u != old]
        return bool(fresh)

    wait_for(replaced, 120, lambda: f"no replacement replica; ports: {replica_urls(s)}")
    with httpx.Client(base_url=f"{fresh[0]}{PREFIX}", timeout=30) as new:
        # pins are synced at start-up, before the replica is ready: its first answer is pinned
        first = info(new, aid)
        assert first.get("pinned") is True and first["version"] == "seq-1", first
        version, pctr = served(new, aid)
        assert version == "seq-1" and same_weights(pctr, pinned_pctr)
    assert info(survivor, aid)["pinned"] and info(survivor, aid)["version"] == "seq-1"
