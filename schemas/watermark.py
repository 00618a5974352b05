"""Event-time watermarks that one record cannot drag (the label join's and the trainer's clock).

A running maximum of event times follows a single record: one event dated a day ahead moves
stream time a day, closing every open attribution window at once, turning later real clicks into
"late" ones, and releasing every example a trainer holds. `Watermark` moves only as far as a
majority of the recent records agree: it is the median of the last `window` timestamps (never
moving back). Up to `window // 2` records dated anywhere in the future change nothing; in an
in-order stream it lags the newest record by about half a window of records.

Shared by `streams` (the label join) and `trainers` (the reorder buffer), hence in `schemas`.
"""

from __future__ import annotations

import bisect
from collections import deque

DEFAULT_WINDOW = 32


class Watermark:
    """A monotone event-time clock: the median of the last `window` timestamps observed.

    >>> wm = Watermark(window=4)
    >>> [wm.observe(t) for t in (1.0, 2.0, 3.0, 1e12, 4.0)]
    [-inf, -inf, 1.0, 2.0, 3.0]
    """

    __slots__ = ("_need", "_recent", "_sorted", "value", "window")

    def __init__(self, window: int = DEFAULT_WINDOW, floor: float = float("-inf")) -> None:
        if window < 1:
            raise ValueError(f"Watermark window must be >= 1 record (got {window!r})")
        self.window = window
        # stream time reaches t only when more than half of a full window is dated t or later
        self._need = window // 2 + 1
        self._recent: deque[float] = deque()
        self._sorted: list[float] = []
        self.value = floor

    def observe(self, ts: float) -> float:
        """Take one record's event time; returns the watermark after it."""
        if ts != ts:  # NaN never enters the order
            return self.value
        recent, srt = self._recent, self._sorted
        recent.append(ts)
        bisect.insort(srt, ts)
        if len(recent) > self.window:
            del srt[bisect.bisect_left(srt, recent.popleft())]
        if len(srt) >= self._need:
            candidate = srt[len(srt) - self._need]
            if candidate > self.value:
                self.value = candidate
        return self.value

    def raise_to(self, ts: float) -> None:
        """Never report less than `ts` from now on (a clock restored after a restart)."""
        if ts > self.value:
            self.value = ts
