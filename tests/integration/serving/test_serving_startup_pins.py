"""A replica that starts while an adapter is pinned (admin rollback) is pinned before it reports
ready: it never serves the rolled-back version, not even until its first housekeeping pass."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
import redis
import torch

from schemas import codec
from schemas.delta import AdapterState, empty_state, full_parts, make_delta, resolve_signing_key
from schemas.settings import Settings
from serving.adapters import CANDIDATE, STABLE
from serving.io import RedisIO
from trainers.models.lora import target_shapes
from trainers.models.ranker import load_checkpoint
from trainers.snapshots import snapshot_key

pytestmark = [pytest.mark.redis, pytest.mark.kafka, pytest.mark.timeout(180)]
AID = "feed"


def _state(s: Settings, seq: int, seed: int) -> AdapterState:
    model, version = load_checkpoint(s.model_dir / "ranker")
    st = empty_state(AID, version, target_shapes(model, s.lora.targets), s.lora.rank)
    g = torch.Generator().manual_seed(seed)
    return AdapterState(
        AID,
        version,
        s.lora.rank,
        seq,
        {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in st.tensors.items()},
    )


def _snapshot(st: AdapterState, key: bytes | None) -> Any:
    return make_delta(st, full_parts(st.tensors, st.rank), st.seq, snapshot=True, key=key)


@pytest.fixture
def isolated(serve_settings: Settings) -> Settings:
    """The test server's settings with own Redis keys and topics (no other test's adapters)."""
    from deploy.stack import create_topics

    tag = uuid.uuid4().hex[:6]
    s = serve_settings.model_copy(
        update={"redis_prefix": f"{serve_settings.redis_prefix}pin{tag}:", "topic_prefix": f"pin{tag}."}
    )
    create_topics(s)
    return s


def test_a_new_replica_is_pinned_before_it_reports_ready(isolated: Settings) -> None:
    from serving.app import AdServer, settings_payload

    s = isolated
    key = resolve_signing_key(s)
    latest, pinned = _state(s, 4, seed=1), _state(s, 2, seed=2)
    r = redis.Redis.from_url(s.redis.url)
    try:  # the trainer's latest snapshot (seq 4), and the admin's pin at seq 2 with its weights
        r.set(snapshot_key(s.redis_prefix, AID), codec.encode(_snapshot(latest, key)))
    finally:
        r.close()

    async def start() -> dict[str, Any]:
        io = RedisIO(s, None)
        await io.set_pin(AID, 2, _snapshot(pinned, key))
        await io.client.aclose()
        # the replica as Serve builds it (Serve awaits the user class' async constructor)
        cls = AdServer.__mro__[1]
        srv = object.__new__(cls)
        await cls.__init__(srv, settings_payload(s))
        try:
            # right after start-up: no housekeeping pass has run yet (its first comes after 1 s)
            assert srv.ready
            meta = srv.rank.bank.meta[AID]
            return {
                "pinned": dict(srv.applier.pinned),
                "seq": meta.seq,
                "stable": srv.rank.bank.weights(AID, STABLE),
                "candidate": srv.rank.bank.weights(AID, CANDIDATE),
            }
        finally:
            await srv.__del__()

    got = asyncio.run(start())
    assert got["pinned"] == {AID: 2} and got["seq"] == 2
    for m, (a, _) in got["stable"].items():  # both arms serve the pinned weights, not seq 4's
        for arm in ("stable", "candidate"):
            a_arm, b_arm = got[arm][m]
            assert torch.allclose(a_arm, pinned.tensors[f"{m}.lora_A"]) and torch.allclose(
                b_arm, pinned.tensors[f"{m}.lora_B"]
            )
        assert not torch.allclose(a, latest.tensors[f"{m}.lora_A"])
