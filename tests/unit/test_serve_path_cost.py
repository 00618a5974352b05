"""`benchmarks/serve.py --path-cost` measures the request path as a replica runs it: one torch
thread and one BLAS thread (Ray starts a replica with OMP_NUM_THREADS=1). With the BLAS pool at
its default (a thread per core), the recall matmul's idle threads spin and the process CPU per
request read ~2 x what a replica spends (2.95 against 1.53 ms at batch 8, Intel Xeon 2 cores)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import threadpoolctl
import torch

from benchmarks import serve


class _Measured(Exception):
    pass


def _blas_threads() -> dict[str, int]:
    """Each loaded BLAS library's thread count, by its file."""
    pools = threadpoolctl.threadpool_info()
    return {p["filepath"]: p["num_threads"] for p in pools if p["user_api"] == "blas"}


def test_the_path_cost_runs_with_one_torch_and_one_blas_thread_and_restores_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not _blas_threads():
        pytest.skip("numpy without a BLAS thread pool")
    before_blas, before_torch = _blas_threads(), torch.get_num_threads()
    seen: dict[str, Any] = {}

    def setup(args: argparse.Namespace, tmp: Any) -> None:
        seen["blas"], seen["torch"] = _blas_threads(), torch.get_num_threads()
        raise _Measured

    monkeypatch.setattr(serve, "_path_setup", setup)
    with pytest.raises(_Measured):
        serve.path_cost(argparse.Namespace(users=10, path_requests=8, ads=100))
    # every BLAS pool at one thread, those loaded during the run (its imports) included
    assert set(seen["blas"].values()) == {1} and seen["torch"] == 1
    after = _blas_threads()
    assert {f: after[f] for f in before_blas} == before_blas and torch.get_num_threads() == before_torch


def test_each_request_counts_its_share_of_a_stage_the_batch_ran_once() -> None:
    """A stage runs once per batch and every request of the batch records its whole wall time
    (`serving.request.timed`): per request, the path's stage figures are that time over the
    batch, so the stages of a batch of 8 add up to the batch's time, not 8 times it."""
    import asyncio
    from types import SimpleNamespace

    class Path:
        async def serve(self, batch: list[Any]) -> None:
            for ctx in batch:  # as `timed` records: the batch's stage time on every request
                ctx.stage_ms = {"rank": 8.0, "rerank": 4.0 * len(batch)}

    def requests(size: int) -> list[Any]:
        return [SimpleNamespace(stage_ms={}) for _ in range(size)]

    got = asyncio.run(serve._path_batches(Path(), requests, 16))
    for size in serve.PATH_BATCHES:
        stages = got[str(size)]["stage_wall_ms_per_request"]
        assert stages["rank"] == pytest.approx(8.0 / size) and stages["rerank"] == pytest.approx(4.0)


def test_the_trace_ab_alternates_the_ranker_in_one_process_and_restores_it() -> None:
    """`--path-trace-ab`: every round times each batch size with the ranker eager (trace_rows 0)
    and traced (the setting), in an order that flips every round; the ratio is traced ÷ eager
    with one pair per round, and the ranker is left as it was set."""
    import asyncio
    import time
    from types import SimpleNamespace

    rank = SimpleNamespace(trace_rows=1024)
    order: list[int] = []

    class Path:
        async def serve(self, batch: list[Any]) -> None:
            order.append(rank.trace_rows)
            spin = 0.0004 if rank.trace_rows == 0 else 0.0002  # the traced ranker: half the CPU
            t = time.process_time()
            while time.process_time() - t < spin:
                pass

    got = asyncio.run(serve._path_trace_ab(Path(), lambda n: [None] * n, rank, 4, 8))
    assert rank.trace_rows == 1024
    for size in serve.PATH_BATCHES:
        ratio = got[str(size)]["traced_over_eager"]
        assert ratio["rounds"] == 4 and 0.3 < ratio["median"] < 0.8
        assert got[str(size)]["traced_cpu_ms_per_request"] < got[str(size)]["eager_cpu_ms_per_request"]
    timed = order[20 * 2 * len(serve.PATH_BATCHES) :]  # after the warm-ups
    per_round = 2 * sum(-(-8 // size) for size in serve.PATH_BATCHES)  # both modes, every size
    assert len(timed) == 4 * per_round
    firsts = [timed[i] for i in range(0, len(timed), per_round)]  # each round's first call
    assert firsts == [0, 1024, 0, 1024]  # round 0 starts eager, round 1 traced, …
