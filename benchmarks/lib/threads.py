"""Threads as an ad server replica has them, for a benchmark that runs its code in process."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import threadpoolctl
import torch

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@contextmanager
def as_replica() -> Iterator[None]:
    """One torch thread (the replica sets it) and one BLAS thread (Ray starts a replica with
    OMP_NUM_THREADS=1) inside, the process' own counts restored after. Without it numpy's BLAS
    pool keeps a thread per core, whose idle spinning after each matmul is process CPU a replica
    does not spend. A BLAS library loaded inside (an import) reads the variables set here."""
    torch_threads = torch.get_num_threads()
    env = {v: os.environ.get(v) for v in THREAD_VARS}
    torch.set_num_threads(1)
    os.environ.update(dict.fromkeys(THREAD_VARS, "1"))
    try:
        with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
            yield
    finally:
        torch.set_num_threads(torch_threads)
        for var, value in env.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
