"""Deadlines: the time a request has left, and which rung of the ladder still fits in it.

Ladder (docs/DESIGN.md): adapter → base model → recall score → cached popular ads. Each stage asks
`plan(...)` with what is left; the estimates are running costs of each stage on this replica.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Final, Literal, TypeAlias

Rung: TypeAlias = Literal["adapter", "base_model", "recall_score", "popular"]
LADDER: Final[tuple[Rung, ...]] = ("adapter", "base_model", "recall_score", "popular")


@dataclass
class Deadline:
    """A request's budget, started when it arrived; `remaining_ms()` is what each stage checks."""

    budget_ms: float
    start: float = field(default_factory=time.perf_counter)

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.start) * 1000.0

    def remaining_ms(self) -> float:
        return self.budget_ms - self.elapsed_ms()


@dataclass
class StageCosts:
    """Running estimates (EWMA of recent timings, ms) of each stage, seeded with safe guesses."""

    recall_ms: float = 2.0
    rank_base_ms: float = 3.0
    rank_adapter_ms: float = 4.0
    rerank_ms: float = 1.0
    alpha: float = 0.1

    def observe(self, stage: str, ms: float) -> None:
        """Fold one measured stage time into its estimate.

        An observation counts at most 3× the current estimate: one request that was descheduled for
        100 ms says little about the next one, and must not push every later request down the ladder.
        """
        name = f"{stage}_ms"
        old = getattr(self, name)
        ms = min(ms, 3.0 * max(old, 1.0))
        setattr(self, name, (1 - self.alpha) * old + self.alpha * ms)

    def relax(self, stage: str, factor: float = 0.9) -> None:
        """Shrink the estimate of a stage that was skipped, so it gets tried again.

        Without this, one slow outlier could push an estimate over the budget and, since a skipped
        stage is never timed again, keep every later request on a lower rung.
        """
        name = f"{stage}_ms"
        setattr(self, name, getattr(self, name) * factor)


def plan_rank(remaining_ms: float, costs: StageCosts, safety: float = 1.5) -> Rung:
    """The best rung whose remaining stages fit in `remaining_ms` (with a safety factor).

    >>> c = StageCosts(recall_ms=1, rank_base_ms=3, rank_adapter_ms=5, rerank_ms=1)
    >>> [plan_rank(r, c) for r in (20.0, 7.0, 2.0, 0.5)]
    ['adapter', 'base_model', 'recall_score', 'popular']
    """
    if remaining_ms >= safety * (costs.rank_adapter_ms + costs.rerank_ms):
        return "adapter"
    if remaining_ms >= safety * (costs.rank_base_ms + costs.rerank_ms):
        return "base_model"
    if remaining_ms >= safety * costs.rerank_ms:
        return "recall_score"
    return "popular"


def plan_start(remaining_ms: float, costs: StageCosts, safety: float = 1.5) -> Rung:
    """Before recall: if even recall + rerank do not fit, serve the cached popular ads."""
    if remaining_ms >= safety * (costs.recall_ms + costs.rerank_ms):
        return "adapter"
    return "popular"


def lower(a: Rung, b: Rung) -> Rung:
    """The lower (more degraded) of two rungs."""
    return a if LADDER.index(a) >= LADDER.index(b) else b


def io_budget_ms(remaining_ms: float, costs: StageCosts, share: float = 0.5, safety: float = 1.5) -> float:
    """The time a request's I/O (the user read: state and frequency caps) may take: at most
    `share` of what is left, and never so much that recall, the base model and rerank (with the
    safety factor) no longer fit after it. 0: no time for it, the request goes without.

    >>> c = StageCosts(recall_ms=2, rank_base_ms=3, rerank_ms=1)
    >>> [io_budget_ms(r, c) for r in (50.0, 12.0, 5.0)]
    [25.0, 3.0, 0.0]
    """
    reserve = safety * (costs.recall_ms + costs.rank_base_ms + costs.rerank_ms)
    return max(0.0, min(share * remaining_ms, remaining_ms - reserve))
