"""The ranker reads the UTC hour of the request (its `hour` id column): two pCTRs of the same ad,
position and weights differ when the hour turned between the two requests. A test that compares
pCTRs across requests (a rollback serves the old weights again, a new replica serves the pinned
ones) runs inside one UTC hour: `one_hour_wait` says how long to wait before it starts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta


def one_hour_wait(now: datetime, window_s: float, margin_s: float = 1.0) -> float:
    """Seconds to wait from `now` so that the next `window_s` seconds lie in one UTC hour:
    0 when they already do, else until `margin_s` past the next hour. A window of an hour or
    more cannot fit: ValueError."""
    if not 0 <= window_s < 3600 - margin_s:
        raise ValueError(f"a window of {window_s} s does not fit in one hour with {margin_s} s to spare")
    now = now.astimezone(UTC)
    next_hour = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    left = (next_hour - now).total_seconds()
    return 0.0 if left > window_s else left + margin_s
