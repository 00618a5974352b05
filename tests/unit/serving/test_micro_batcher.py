"""The replica's micro-batcher (`serving.batching.MicroBatcher`): what arrives together runs
together, up to the size; at most `concurrent` batches at once; failures and cancellations
reach only their own callers."""

from __future__ import annotations

import asyncio

import pytest

from serving.batching import MicroBatcher


def test_requests_that_arrive_together_run_as_one_batch_up_to_the_size() -> None:
    seen: list[list[int]] = []

    async def run(items: list[int]) -> list[int]:
        seen.append(items)
        await asyncio.sleep(0.01)
        return [i * 10 for i in items]

    async def main() -> list[int]:
        b: MicroBatcher[int, int] = MicroBatcher(run, max_batch=4, concurrent=1)
        return list(await asyncio.gather(*(b.submit(i) for i in range(10))))

    assert asyncio.run(main()) == [i * 10 for i in range(10)]
    # all ten queued in the same turn of the loop: batches of four, in arrival order
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_a_lone_request_runs_at_once_and_a_wait_gathers_more() -> None:
    sizes: list[int] = []

    async def run(items: list[int]) -> list[int]:
        sizes.append(len(items))
        return items

    async def main(wait_s: float) -> None:
        b: MicroBatcher[int, int] = MicroBatcher(run, max_batch=8, wait_s=wait_s)
        first = asyncio.ensure_future(b.submit(0))
        await asyncio.sleep(0)  # the drainer started with one item
        rest = [asyncio.ensure_future(b.submit(i)) for i in range(1, 4)]
        await asyncio.gather(first, *rest)

    asyncio.run(main(0.0))
    assert sizes[0] == 1  # no wait: the first goes alone
    sizes.clear()
    asyncio.run(main(0.05))
    assert sizes == [4]  # waited: the others joined it


def test_at_most_concurrent_batches_run_at_once() -> None:
    running, peak = [0], [0]

    async def run(items: list[int]) -> list[int]:
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        await asyncio.sleep(0.02)
        running[0] -= 1
        return items

    async def main() -> None:
        b: MicroBatcher[int, int] = MicroBatcher(run, max_batch=1, concurrent=2)
        results = []
        for i in range(6):  # one at a time, each while the others still run
            results.append(asyncio.ensure_future(b.submit(i)))
            await asyncio.sleep(0.001)
        assert await asyncio.gather(*results) == list(range(6))
        assert b.batches == 6

    asyncio.run(main())
    assert peak[0] == 2


def test_a_failing_batch_fails_its_own_callers_only_and_the_batcher_goes_on() -> None:
    async def run(items: list[int]) -> list[int]:
        if 3 in items:
            raise ValueError("bad batch")
        return items

    async def main() -> None:
        b: MicroBatcher[int, int] = MicroBatcher(run, max_batch=2)
        with pytest.raises(ValueError, match="bad batch"):
            await b.submit(3)
        assert await b.submit(4) == 4
        got = await asyncio.gather(b.submit(1), b.submit(3), b.submit(5), return_exceptions=True)
        assert got[2] == 5 and any(isinstance(g, ValueError) for g in got[:2])

    asyncio.run(main())


def test_a_batch_giving_the_wrong_number_of_results_is_an_error_not_a_hang() -> None:
    async def run(items: list[int]) -> list[int]:
        return items[:-1]

    async def main() -> None:
        b: MicroBatcher[int, int] = MicroBatcher(run, max_batch=4)
        with pytest.raises(RuntimeError, match="gave 0 results"):
            await asyncio.wait_for(b.submit(1), 2)

    asyncio.run(main())


def test_a_caller_cancelled_while_queued_is_left_out_of_its_batch() -> None:
    seen: list[list[int]] = []
    gate = asyncio.Event()

    async def run(items: list[int]) -> list[int]:
        seen.append(items)
        await gate.wait()
        return items

    async def main() -> None:
        b: MicroBatcher[int, int] = MicroBatcher(run, max_batch=8, concurrent=1)
        first = asyncio.ensure_future(b.submit(0))
        await asyncio.sleep(0.01)  # batch [0] runs, held by the gate
        gone = asyncio.ensure_future(b.submit(1))
        kept = asyncio.ensure_future(b.submit(2))
        await asyncio.sleep(0.01)
        gone.cancel()
        gate.set()
        assert await first == 0 and await kept == 2

    asyncio.run(main())
    assert seen == [[0], [2]]


def test_bad_arguments_are_refused() -> None:
    async def run(items: list[int]) -> list[int]:
        return items

    for kwargs in ({"max_batch": 0}, {"max_batch": 1, "concurrent": 0}, {"max_batch": 1, "wait_s": -1.0}):
        with pytest.raises(ValueError, match="MicroBatcher needs"):
            MicroBatcher(run, **kwargs)
