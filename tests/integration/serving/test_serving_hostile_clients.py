"""The running ad server against strangers and forged updates (issue 14: H1, L1, M1, M3, M8, L7,
OpenAPI notes), on the session's Ray Serve instance."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from helpers_serving import ADMIN, adapter_infos, make_delta

from schemas import codec, topics
from schemas.delta import AdapterState, empty_state, full_parts
from schemas.settings import Settings
from trainers.models.lora import target_shapes
from trainers.models.ranker import load_checkpoint

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.kafka]


def wait_for(cond, timeout: float = 30, why=lambda: "") -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, why()
        time.sleep(0.2)


async def produce(s: Settings, deltas: list) -> None:  # type: ignore[type-arg]
    p = AIOKafkaProducer(bootstrap_servers=s.kafka.bootstrap)
    await p.start()
    try:
        for d in deltas:
            await p.send_and_wait(
                topics.topic_name(topics.ADAPTER_DELTAS, s.topic_prefix),
                codec.encode(d),
                key=d.adapter_id.encode(),
            )
    finally:
        await p.stop()


def _snapshot(s: Settings, adapter_id: str, seq: int, scale: float, *, signed: bool = True):  # type: ignore[no-untyped-def]
    import torch

    from schemas.delta import make_delta as unsigned_make_delta

    model, version = load_checkpoint(s.model_dir / "ranker")
    st = empty_state(adapter_id, version, target_shapes(model, s.lora.targets), s.lora.rank)
    g = torch.Generator().manual_seed(seq)
    tensors = {k: torch.randn(v.shape, generator=g) * scale for k, v in st.tensors.items()}
    st = AdapterState(adapter_id, version, s.lora.rank, seq, tensors)
    build = make_delta if signed else unsigned_make_delta
    return build(st, full_parts(tensors, s.lora.rank), seq, snapshot=True, event_id=f"rel-{adapter_id}-{seq}")


def _deltas(server: httpx.Client, outcome: str) -> float:
    for line in server.get("/metrics").text.splitlines():
        if line.startswith(f'adstream_serving_deltas_total{{outcome="{outcome}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_slot_advertiser_ids_are_addressable_and_forged_deltas_refused(
    server: httpx.Client, serve_settings: Settings
) -> None:
    """M8: `feed/adv:x` reaches the rollback route (409 then 200, not 404). M1: an unsigned
    snapshot for it is refused (`unsigned`), the signed ones apply."""
    s = serve_settings
    aid = "feed/adv:rel-x"
    unsigned_before = _deltas(server, "unsigned")
    asyncio.run(produce(s, [_snapshot(s, aid, 0, 0.05, signed=False)]))
    wait_for(
        lambda: _deltas(server, "unsigned") > unsigned_before, why=lambda: server.get("/metrics").text[-800:]
    )
    assert all(a["adapter_id"] != aid for a in adapter_infos(server))
    asyncio.run(produce(s, [_snapshot(s, aid, 0, 0.05)]))
    wait_for(lambda: any(a["adapter_id"] == aid for a in adapter_infos(server)))
    url = f"/v1/adapters/{aid}/rollback"
    r = server.post(url, headers=ADMIN)
    assert r.status_code == 409 and "no previous version" in r.json()["detail"]
    asyncio.run(produce(s, [_snapshot(s, aid, 1, 0.05)]))
    wait_for(lambda: next(a for a in adapter_infos(server) if a["adapter_id"] == aid)["seq"] == 1)
    r = server.post(url, headers=ADMIN)
    assert (
        r.status_code == 200 and r.json()["adapter_id"] == aid and r.json()["seq"] == 0 and r.json()["pinned"]
    )
    r = server.post(f"/v1/adapters/{aid}/unpin", headers=ADMIN)
    assert r.status_code == 200 and not r.json()["pinned"]


def test_admin_routes_and_exposure(server: httpx.Client) -> None:
    """H1/L1: the admin routes take only the configured token (literally: `\\xa0` is not empty);
    adapter ids, seqs and devices are not public."""
    assert server.get("/v1/adapters").status_code == 401
    nbsp = "Bearer \xa0".encode("latin-1")  # what `.strip()` used to turn into the empty token
    assert server.get("/v1/adapters", headers={"Authorization": nbsp}).status_code == 401
    assert (
        server.get("/v1/adapters", headers={"Authorization": "Bearer wrong-token-0123456789"}).status_code
        == 403
    )
    assert server.get("/v1/adapters", headers=ADMIN).status_code == 200
    assert server.post("/v1/adapters/splash/rollback", headers={"X-Admin-Token": b"\xa0"}).status_code == 401
    health = server.get("/healthz").json()
    assert set(health) == {"status", "model_version"}


def test_request_edges(server: httpx.Client) -> None:
    """M3: a chunked body over the limit gets 413 before it is all sent; L7: only JSON bodies;
    OpenAPI: `k: 61.0` is the integer 61."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(str(server.base_url))
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/ads HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"x" * 16384
        for _ in range(6):  # 96 KiB of a body that never ends: no terminating chunk is sent
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        head = sock.recv(65536)  # answered while the body is still open: it was never read whole
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    for ct in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": ct} if ct else {}
        r = server.post("/v1/ads", content=b'{"user_id": "u", "slot": "feed"}', headers=headers)
        assert r.status_code == 415 and "application/json" in r.json()["detail"]
    r = server.post("/v1/ads", json={"user_id": "u-k61", "slot": "feed", "k": 61.0})
    assert r.status_code == 200
    r = server.post("/v1/ads", json={"user_id": "u\u202e", "slot": "feed"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["user_id"]


def test_openapi_documents_admin_errors_and_metrics(server: httpx.Client) -> None:
    spec = server.get("/openapi.json").json()
    for path in ("/v1/adapters/{adapter_id}/rollback", "/v1/adapters/{adapter_id}/unpin", "/v1/adapters"):
        op = next(iter(spec["paths"][path].values()))
        assert {"401", "403", "404"} <= set(op["responses"]), path
    metrics = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert len(metrics) == 1 and next(iter(metrics)).startswith("text/plain")
    assert {"413", "415", "422", "503"} <= set(spec["paths"]["/v1/ads"]["post"]["responses"])
