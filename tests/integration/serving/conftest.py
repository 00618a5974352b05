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
    from trainers.ranker import Ranker, RankerConfig, save_checkpoint

    tmp: Path = tmp_path_factory.mktemp("serving")
    torch.manual_seed(0)
    save_checkpoint(Ranker(RankerConfig(state_dim=stack.state_dim)), tmp / "models" / "ranker")
    catalog = tmp / "catalog.jsonl"
    catalog.write_text("".join(ad.model_dump_json() + "\n" for ad in catalog_ads()))
    s = Settings(
        **{
            **stack.model_dump(),
            "admin_token": "test-admin",
            "model_dir": tmp / "models",
            "serve_catalog_file": catalog,
            "http_port": _free_base_port(),
            "canary_share": 1.0,  # every user on the live (candidate) adapters
            "serve_admission_limit": 6,
            "frequency_cap": 2,
            "deadline_ms": 1000,  # slow CI machines: the ladder tests set deadline_ms per request
        }
    )
    create_topics(s)
    return s


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
