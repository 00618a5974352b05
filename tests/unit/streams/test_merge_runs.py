"""`PartitionMerge.release` releases a run of one input after one look at the others (while its
next head would be chosen again): the same records in the same order, the same stops and the
same state as choosing every record by a look at every input, whatever the inputs hold, which
inputs are caught up and where the caller stops taking."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator

import pytest

from streams.merge import Item, PartitionMerge, topic_rank

INPUTS = ("ad.impressions", "ad.clicks", "ad.dwell", "ad.conversions")


def one_at_a_time(
    m: PartitionMerge, caught_up: Callable[[str, int | None], bool], inputs: tuple[str, ...], now: float
) -> Iterator[Item]:
    """The rule itself: each record chosen by a look at every input's head (an invalid head is
    released at once; nothing while an empty input may still receive)."""
    known: dict[str, bool] = {}

    def finished(topic: str) -> bool:  # an empty input: caught up, or waited out
        if topic not in known:
            done = caught_up(topic, m.last_seen.get(topic))
            if done and m.blocked_since:
                m.blocked_since.pop(topic, None)
                m.passed.discard(topic)
            known[topic] = done or m._waited_out(topic, now)
        return known[topic]

    while True:
        heads: list[tuple[tuple[float, int, int], str]] = []
        waiting = False
        for topic in inputs:
            queue = m.queues.get(topic)
            if not queue:
                waiting = not finished(topic) or waiting
            elif queue[0].event is None:
                yield queue.popleft()
                break
            else:
                heads.append(((queue[0].ts, topic_rank(topic), queue[0].offset), topic))
        else:
            if waiting or not heads:
                return
            yield m.queues[min(heads)[1]].popleft()


def _merge(rnd: random.Random) -> PartitionMerge:
    m = PartitionMerge(max_buffered=rnd.choice([5, 40, float("inf")]))
    for topic in INPUTS[: rnd.randint(1, 4)]:
        ts = rnd.uniform(0, 5)
        for offset in range(rnd.randint(0, 30)):
            ts += rnd.choice([0.0, 0.0, 0.1, 0.5, -0.3, 1.0])  # ties, and out of order within an input
            valid = rnd.random() > 0.08
            m.push(Item(topic, offset, object() if valid else None, round(ts, 1)))  # type: ignore[arg-type]
    return m


def _held(m: PartitionMerge) -> dict[str, list[tuple[int, bool]]]:
    return {t: [(i.offset, i.event is not None) for i in q] for t, q in m.queues.items()}


@pytest.mark.parametrize("seed", range(300))
def test_runs_release_what_one_record_at_a_time_releases(seed: int) -> None:
    rnd = random.Random(seed)
    new = _merge(rnd)
    old = copy.deepcopy(new)
    done = {t: rnd.random() < 0.7 for t in INPUTS}
    asked: dict[str, list[str]] = {"new": [], "old": []}

    def caught_up(who: str) -> Callable[[str, int | None], bool]:
        def answer(topic: str, last: int | None) -> bool:
            asked[who].append(topic)
            return done[topic]

        return answer

    for call in range(4):  # several calls, each taken up to a point the caller chooses
        room = rnd.choice([1, 3, 10, 1000])
        got, want = [], []
        for item in new.release(caught_up("new"), INPUTS, now=float(call)):
            got.append((item.topic, item.offset))
            if len(got) >= room:
                break
        for item in one_at_a_time(old, caught_up("old"), INPUTS, now=float(call)):
            want.append((item.topic, item.offset))
            if len(want) >= room:
                break
        assert got == want
        assert _held(new) == _held(old)
        assert (new.blocked_since, new.passed, new.forced) == (old.blocked_since, old.passed, old.forced)
        assert asked["new"] == asked["old"]
        done = {t: rnd.random() < 0.8 for t in INPUTS}
