"""Timestamp-synchronised merge of one co-partition's input topics (pure, no I/O).

Partition p of impressions, clicks, dwell, conversions and touches holds the same users. Each
input is consumed in offset order; among the inputs' heads the one with the smallest event time goes next
(Kafka Streams' rule). An input with nothing buffered holds the merge back unless it is caught up
(the caller says so, from the broker's high watermark), so the order — and therefore every user
state and label — is the same on every run and after a restart, whatever the fetch interleaving.
Invalid records carry no usable time and are released as soon as they reach their queue's head.

An input that never answers (a partition without fetch responses, a stuck leader) must not hold
the others back for ever while they pile up in memory: after `max_idle_s` of waiting, or with
`max_buffered` records held, it is passed over as if caught up (Kafka Streams'
`max.task.idle.ms`), counted in `forced`; its records are merged as they come (late for the join).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from schemas import topics
from schemas.events import Message

TOPIC_RANK = {base: rank for rank, base in enumerate(topics.USER_INPUTS)}


@lru_cache(maxsize=256)
def topic_rank(topic: str) -> int:
    """Tie-break rank of a (possibly prefixed) input topic: an impression before its click."""
    for base, rank in TOPIC_RANK.items():
        if topic.endswith(base):
            return rank
    return len(TOPIC_RANK)


@dataclass(slots=True)
class Item:
    """One record of an input: its offset, its event (None when invalid) and the caller's handle."""

    topic: str  # contract (base) topic name
    offset: int
    event: Message | None
    ts: float
    handle: Any = None
    dead: Any = None  # the dead letter of an invalid record
    raw: bytes | None = None  # the record's bytes as received


@dataclass
class PartitionMerge:
    """Input queues of one co-partition and the rule that picks the next record."""

    queues: dict[str, deque[Item]] = field(default_factory=dict)
    last_seen: dict[str, int] = field(default_factory=dict)
    max_idle_s: float = math.inf  # how long an empty, not caught-up input may hold the others back
    max_buffered: float = math.inf  # … or how many records it may make the merge hold
    blocked_since: dict[str, float] = field(default_factory=dict)  # input → when it began to block
    passed: set[str] = field(default_factory=set)  # inputs currently passed over
    forced: int = 0  # times an input was passed over

    def push(self, item: Item) -> None:
        self.queues.setdefault(item.topic, deque()).append(item)
        self.last_seen[item.topic] = item.offset
        if self.blocked_since:
            self.blocked_since.pop(item.topic, None)
            self.passed.discard(item.topic)

    def _waited_out(self, topic: str, now: float) -> bool:
        """Whether an empty input that is not caught up has held the others back long enough."""
        held = self.buffered()
        if not held:
            self.blocked_since.pop(topic, None)
            self.passed.discard(topic)
            return False
        since = self.blocked_since.setdefault(topic, now)
        if held < self.max_buffered and now - since < self.max_idle_s:
            return False
        if topic not in self.passed:
            self.passed.add(topic)
            self.forced += 1
        return True

    def buffered(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def release(
        self, caught_up: Callable[[str, int | None], bool], inputs: tuple[str, ...], now: float = 0.0
    ) -> Iterator[Item]:
        """Yield records in merge order while the choice is certain.

        `caught_up(topic, last_seen_offset)` says whether an empty input has nothing more to read
        right now; `inputs` are the topics of this co-partition. Its answer is kept for the rest
        of the call (nothing is received while it runs). `now` (monotonic seconds) times how
        long an input has been holding the merge back (see the module docstring).
        """
        known: dict[str, bool] = {}
        while True:
            best: Item | None = None
            best_key: tuple[float, int, int] | None = None
            second_key: tuple[float, int, int] | None = None  # the smallest other head's
            blocked = False
            for topic in inputs:
                q = self.queues.get(topic)
                if not q:
                    done = known.get(topic)
                    if done is None:
                        done = caught_up(topic, self.last_seen.get(topic))
                        if done:
                            if self.blocked_since:
                                self.blocked_since.pop(topic, None)
                                self.passed.discard(topic)
                        else:
                            done = self._waited_out(topic, now)
                        known[topic] = done
                    if not done:
                        blocked = True
                    continue
                head = q[0]
                if head.event is None:  # invalid: no time to wait for
                    q.popleft()
                    yield head
                    best = None
                    break
                key = (head.ts, topic_rank(topic), head.offset)
                if best_key is None or key < best_key:
                    best, best_key, second_key = head, key, best_key
                elif second_key is None or key < second_key:
                    second_key = key
            else:
                if best is None or blocked:
                    return
                q = self.queues[best.topic]
                q.popleft()
                yield best
                # a run of the same input: while its next head is valid and before every other
                # head, a new look would choose it again (the other heads and the answers about
                # empty inputs are as this one found them); else (or once it is empty) look again
                yield from _run(q, topic_rank(best.topic), second_key)


def _run(q: deque[Item], rank: int, before: tuple[float, int, int] | None) -> Iterator[Item]:
    """The heads of one input (of tie-break `rank`) while valid and ordered before `before`."""
    while q:
        head = q[0]
        if head.event is None or (before is not None and (head.ts, rank, head.offset) > before):
            return
        q.popleft()
        yield head
