"""One Ray Serve instance of the ad server for the whole session, on the real broker and Redis."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import torch
from helpers_serving import ADMIN_TOKEN, STATE_DIR, make_delta

from schemas.events import AdCreative
from schemas.settings import Settings

N_ADS = 300


def _free_base_port() -> int:
    for _ in range(50):
        base = random.randint(20_000, 28_000)
        ok = True
        for port in (base, base + 1, base + 2):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    ok = False
        if ok:
            return base
    raise RuntimeError("no free port range for the test Serve instance")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def catalog_ads() -> list[AdCreative]:
    ts = datetime(2026, 1, 1, tzinfo=UTC)
    cats = ["shoes", "tech", "food", "travel", "games"]
    return [
        AdCreative(
            event_id=f"cat-{i}",
            ts=ts,
            ad_id=f"ad{i:04d}",
            campaign_id=f"c{i % 40}",
            advertiser_id=f"v{i % 30}",
            category=cats[i % 5],
            title=f"{cats[i % 5]} offer {i}",
            bid=0.5 + (i % 7) * 0.25,
            daily_budget=1e6,
            active=True,
        )
        for i in range(N_ADS)
    ]


@pytest.fixture(scope="session")
def catalog() -> list[AdCreative]:
    """The ads the test server loads at start."""
    return catalog_ads()


@pytest.fixture(scope="session")
def serve_settings(stack: Settings, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    from deploy.stack import create_topics
    from trainers.models.ranker import Ranker, RankerConfig, save_checkpoint

    tmp: Path = tmp_path_factory.mktemp("serving")
    torch.manual_seed(0)
    save_checkpoint(Ranker(RankerConfig(state_dim=stack.state_dim)), tmp / "models" / "ranker")
    catalog = tmp / "catalog.jsonl"
    catalog.write_text("".join(ad.model_dump_json() + "\n" for ad in catalog_ads()))
    s = Settings(
        **{
            **stack.model_dump(),
            "serving": {
                **stack.serving.model_dump(),
                "admin_token": ADMIN_TOKEN,
                "catalog_file": catalog,
                "http_port": _free_base_port(),
                "admission_limit": 200,
                "frequency_cap": 2,
                "deadline_ms": 1000,
            },
            "state_dir": STATE_DIR,
            "model_dir": tmp / "models",
            "canary": {**stack.canary.model_dump(), "share": 1.0},
            # these tests compare rankings across requests: every position greedy here (exploration
            # is tested on the pipeline, tests/unit/serving/test_serving_arms.py)
            "explore": {**stack.explore.model_dump(), "epsilon": 0.0},
            "qos": {
                **stack.qos.model_dump(),
                "slots": 2,
                "queue_limit": {"guaranteed": 500, "burstable": 16, "besteffort": 0},
                "queue_timeout_ms": {c: 30_000.0 for c in ("guaranteed", "burstable", "besteffort")},
            },
            "recall": {**stack.recall.model_dump(), "k": 40},
            # the web snippet test's publisher page, on a port of its own (test_web_snippet.py)
            "collector": {
                **stack.collector.model_dump(),
                "cors_origins": [f"http://127.0.0.1:{_free_port()}"],
            },
        }
    )
    create_topics(s)
    _write_snapshot(s, tmp / "models" / "ranker", "splash", seq=4, seed=4)
    return s


def snapshot_delta(
    model_dir: Path, adapter_id: str, seq: int, seed: int, rank: int, targets: tuple[str, ...]
):  # type: ignore[no-untyped-def]
    """A full snapshot of a small random adapter for the test ranker (what the trainer stores)."""
    from schemas.delta import AdapterState, empty_state, full_parts
    from trainers.models.lora import target_shapes
    from trainers.models.ranker import load_checkpoint

    model, version = load_checkpoint(model_dir)
    shapes = target_shapes(model, targets)
    st = empty_state(adapter_id, version, shapes, rank)
    g = torch.Generator().manual_seed(seed)
    tensors = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in st.tensors.items()}
    st = AdapterState(adapter_id, version, rank, seq, tensors)
    return make_delta(st, full_parts(tensors, rank), seq, snapshot=True)


def _write_snapshot(s: Settings, model_dir: Path, adapter_id: str, seq: int, seed: int) -> None:
    import redis

    from schemas import codec
    from trainers.snapshots import snapshot_key

    snap = snapshot_delta(model_dir, adapter_id, seq, seed, s.lora.rank, s.lora.targets)
    r = redis.Redis.from_url(s.redis.url)
    r.set(snapshot_key(s.redis_prefix, adapter_id), codec.encode(snap))
    r.close()


@pytest.fixture(scope="session")
def write_snapshot(serve_settings: Settings):  # type: ignore[no-untyped-def]
    """Store an adapter snapshot in Redis the way the trainer does."""
    return lambda adapter_id, seq, seed: _write_snapshot(
        serve_settings, serve_settings.model_dir / "ranker", adapter_id, seq, seed
    )


@pytest.fixture(scope="session")
def server(serve_settings: Settings) -> Iterator[httpx.Client]:
    import ray
    from ray import serve

    from deploy.cli_serving import start

    ep = start(serve_settings, name="test-ads")
    client = httpx.Client(base_url=ep.best, timeout=30)
    deadline = time.monotonic() + 60
    while client.get("/healthz").json().get("status") != "ok":
        assert time.monotonic() < deadline, "serving did not get ready"
        time.sleep(0.5)
    try:
        yield client
    finally:
        client.close()
        serve.shutdown()
        ray.shutdown()
