"""Requests that arrive together, run as one batch: the replica's own micro-batcher.

`MicroBatcher(run, max_batch, wait_s, concurrent)` is what `@serve.batch` gave the request
path, at a fraction of its cost: a caller's item joins a queue and waits for its own result; a
drainer takes up to `max_batch` queued items (after waiting up to `wait_s` for more once the first
is there; 0: what is queued now), runs them with `run` and hands each caller its result. Up to
`concurrent` batches run at once (one waiting on Redis while another ranks). A caller cancelled
while queued (its client went away) is left out of the batch; one cancelled while its batch runs
gets nothing. A `run` that raises fails every caller of that batch with its exception.

Why not `@serve.batch`: per batch, Ray's queue records five metrics (a gauge, three histograms and
a counter, each a tagged Ray metric call), starts a `wait_for` task, takes a semaphore and sets the
batch's request and trace context. At the rates where requests do not queue (each batch one
request) that was ~3 % of the replica's sampled stacks at 50 req/s (py-spy, issue 33; the replica's
whole CPU per request moves by more than that from run to run, so the end-to-end figure does not
resolve it). The batching rule is the same: take what is queued, up to the size, never wait unless
told to; the batches are counted in `batches`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class MicroBatcher(Generic[T, R]):
    """Items submitted together run together (see the module); `submit(item)` returns the
    item's result, or raises what its batch's `run` raised."""

    def __init__(
        self,
        run: Callable[[list[T]], Awaitable[Sequence[R]]],
        max_batch: int,
        wait_s: float = 0.0,
        concurrent: int = 1,
    ) -> None:
        if max_batch < 1 or concurrent < 1 or wait_s < 0:
            raise ValueError(
                f"MicroBatcher needs max_batch >= 1, concurrent >= 1 and wait_s >= 0 "
                f"(got {max_batch}, {concurrent}, {wait_s})"
            )
        self.run = run
        self.max_batch = max_batch
        self.wait_s = wait_s
        self.concurrent = concurrent
        self._queue: deque[tuple[T, asyncio.Future[R]]] = deque()
        self._drainers = 0  # running drain tasks (each runs one batch at a time)
        self._tasks: set[asyncio.Task[None]] = set()
        self.batches = 0  # batches run (tests, metrics)

    async def submit(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._queue.append((item, future))
        if self._drainers < self.concurrent:
            self._drainers += 1
            task = loop.create_task(self._drain())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await future

    async def _drain(self) -> None:
        """Run batches while items are queued; then end (the next `submit` starts a drainer)."""
        try:
            while self._queue:
                if self.wait_s > 0 and len(self._queue) < self.max_batch:
                    await asyncio.sleep(self.wait_s)  # the first is here: give others a moment
                batch: list[tuple[T, asyncio.Future[R]]] = []
                while self._queue and len(batch) < self.max_batch:
                    item, future = self._queue.popleft()
                    if not future.cancelled():  # its caller went away while it waited
                        batch.append((item, future))
                if batch:
                    await self._run_one(batch)
        finally:
            self._drainers -= 1

    async def _run_one(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        self.batches += 1
        try:
            results = await self.run([item for item, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"a batch of {len(batch)} gave {len(results)} results")
        except Exception as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        except BaseException:  # the drainer itself cancelled (the replica stops): so are they
            for _, future in batch:
                future.cancel()
            raise
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)
