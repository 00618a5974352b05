"""A hung dependency costs at most its share of the deadline (issue 33, item 5): with the replica's
Redis frozen (SIGSTOP: connections accepted by the kernel, never answered), requests through the
request path (`serving.request.RequestPath`, as the replica runs it) are answered without the
user's state, one rung down and saying so, within their deadline; after SIGCONT, as before.

A real redis-server of its own (its own port), frozen and thawed by signal.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

from schemas.api import AdRequest
from schemas.events import AdCreative
from schemas.settings import Settings
from serving.catalog import Catalog
from serving.deadline import Deadline
from serving.io import RedisIO, UserRecordCodec
from serving.pipeline import AdPipeline, RequestContext, content_vectorizer, utcnow
from serving.ranking import RankModel
from serving.request import RequestPath
from trainers.models.ranker import Ranker, RankerConfig

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]
PORT = 18101
DEADLINE_MS = 50.0
# what a loaded shared 2-core machine may add to a request beyond its deadline (scheduling,
# a GC pause): generous on purpose; the figure itself is `benchmarks/serve.py`'s `hung_redis`
MARGIN_MS = 150.0
CFG = RankerConfig(state_dim=16, emb_dim=4, deep_hidden=16)


@pytest.fixture()
def frozen_redis(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed")
    proc = subprocess.Popen(
        [exe, "--port", str(PORT), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", PORT)) == 0:
                    break
            time.sleep(0.05)
        else:
            pytest.fail(f"redis-server did not listen on {PORT}")
        yield proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)  # a stopped process does not act on SIGTERM
        proc.terminate()
        proc.wait(10)


def _path(tmp_path: Path) -> tuple[RequestPath, RedisIO]:
    torch.manual_seed(0)
    s = Settings(
        state_dim=16,
        recall={"k": 30},
        state_dir=tmp_path,
        redis={"url": f"redis://127.0.0.1:{PORT}/0"},
        explore={"epsilon": 0.0},
    )
    pipe = AdPipeline(
        s,
        RankModel(Ranker(CFG).eval(), "v0", s, torch.device("cpu")),
        Catalog(16, CFG, content_vectorizer(16)),
    )
    ts = datetime(2026, 1, 1, tzinfo=UTC)
    for i in range(60):
        cat = ["shoes", "tech", "food"][i % 3]
        pipe.add_ad(
            AdCreative(
                event_id=f"e{i}",
                ts=ts,
                ad_id=f"a{i}",
                campaign_id=f"c{i % 4}",
                advertiser_id=f"v{i % 6}",
                category=cat,
                title=f"{cat} item {i}",
                bid=1.0 + i % 3,
                daily_budget=1e6,
                active=True,
            )
        )
    io = RedisIO(s, UserRecordCodec(s.state))
    emitted: list[object] = []

    async def score(items):  # type: ignore[no-untyped-def]
        return pipe.rank.score([i for i, _ in items], False) if items else []

    return RequestPath(pipe, io, score, emitted.extend), io


async def _one(
    path: RequestPath, n: int, batch: int = 1, deadline_ms: float = DEADLINE_MS
) -> list[tuple[float, bool, str]]:
    """`batch` requests served together; per request (ms from its start, degraded, rung)."""
    t0 = time.perf_counter()
    ctxs = [
        RequestContext(
            AdRequest(user_id=f"u{n}-{i}", slot="feed", k=4),
            f"r{n}-{i}",
            utcnow(),
            deadline=Deadline(deadline_ms, start=t0),
        )
        for i in range(batch)
    ]
    resps = await path.serve(ctxs)
    ms = (time.perf_counter() - t0) * 1000
    assert all(len(r.ads) == 4 for r in resps)
    return [(ms, r.degraded, r.served_by) for r in resps]


def test_a_frozen_redis_costs_a_request_at_most_its_deadline(
    frozen_redis: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a replica runs (`serving.app`): one rank thread
    path, io = _path(tmp_path)

    async def run() -> tuple[list[tuple[float, bool, str]], ...]:
        # a deadline no loaded machine misses, before and after: the read answers, nothing degrades
        before = [x for n in range(5) for x in await _one(path, n, deadline_ms=5000.0)]
        os.kill(frozen_redis.pid, signal.SIGSTOP)
        try:
            # one at a time and in batches, as requests arrive together at a replica
            frozen = [x for n in range(10) for x in await _one(path, 100 + n, batch=1 + n % 3)]
        finally:
            os.kill(frozen_redis.pid, signal.SIGCONT)
        await asyncio.sleep(0.2)
        after = [x for n in range(5) for x in await _one(path, 200 + n, deadline_ms=5000.0)]
        await io.close()
        return before, frozen, after

    try:
        before, frozen, after = asyncio.run(run())
    finally:
        torch.set_num_threads(threads)
    assert all(not degraded and rung == "adapter" for _, degraded, rung in before), before
    # frozen: every answer comes, within the deadline (plus the margin), without the user's state
    # and one rung down, and says so
    assert all(ms <= DEADLINE_MS + MARGIN_MS for ms, _, _ in frozen), frozen
    assert all(degraded and rung != "adapter" for _, degraded, rung in frozen), frozen
    # thawed: the user read answers again
    assert all(not degraded and rung == "adapter" for _, degraded, rung in after), after
