"""Delayed-feedback reordering: learn examples in impression order, not in label-join order.

The label join emits a clicked impression's example at the click but an unclicked one only when
its attribution window closes. Learned in arrival order, an online model sees a run of positives
before their negatives: its intercept drifts up, and its progressive metrics are inflated
because the label leaks into the arrival position. `DelayBuffer` holds each example until the
event-time watermark has passed `impression_ts + delay_s` (`delay_s` = the attribution window),
then releases examples in impression order — the order a stationary evaluation expects.

The watermark is a `schemas.watermark.Watermark` over the examples' `ts` (the join's clock as
it emitted them), not their maximum: one example dated far ahead would release everything held
at once, learned before the labels of its window are known.

Only with `settings.online.label_mode = "hold"`: the fake-negative modes learn every example at once.
"""

from __future__ import annotations

import heapq
from datetime import UTC, datetime, timedelta

from schemas.events import TrainingExample
from schemas.watermark import DEFAULT_WINDOW, Watermark

Position = tuple[int, int]  # (partition, offset) on the input topic


class DelayBuffer:
    """Holds examples until `watermark >= impression_ts + delay_s`; releases in impression order."""

    def __init__(self, delay_s: float, watermark_window: int = DEFAULT_WINDOW) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.delay = timedelta(seconds=delay_s)
        self.watermark: datetime | None = None
        self._clock = Watermark(watermark_window)
        self._heap: list[tuple[datetime, str, int, TrainingExample, Position]] = []
        self._n = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, example: TrainingExample, partition: int, offset: int) -> None:
        """Hold one example (its emission time is one observation of the watermark)."""
        now = self._clock.observe(example.ts.timestamp())
        if now != float("-inf") and (self.watermark is None or now > self.watermark.timestamp()):
            self.watermark = datetime.fromtimestamp(now, tz=UTC)
        self._n += 1
        item = (example.impression_ts, example.impression_id, self._n, example, (partition, offset))
        heapq.heappush(self._heap, item)

    def pop_ready(self) -> list[tuple[TrainingExample, Position]]:
        """Examples whose attribution window the watermark has passed, oldest impression first."""
        out: list[tuple[TrainingExample, Position]] = []
        if self.watermark is None:
            return out
        limit = self.watermark - self.delay
        while self._heap and self._heap[0][0] <= limit:
            _, _, _, ex, pos = heapq.heappop(self._heap)
            out.append((ex, pos))
        return out

    def drain(self) -> list[tuple[TrainingExample, Position]]:
        """Everything held, in impression order (shutdown or end of input)."""
        out = [(ex, pos) for _, _, _, ex, pos in sorted(self._heap)]
        self._heap.clear()
        return out

    def low_offsets(self) -> dict[int, int]:
        """Per partition, the lowest offset still held (committing must stop before it)."""
        low: dict[int, int] = {}
        for *_, (part, off) in self._heap:
            if off < low.get(part, off + 1):
                low[part] = off
        return low
