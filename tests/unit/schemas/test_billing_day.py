"""`schemas.billing.day_of` names the UTC day `datetime` names for every time, midnight's
neighbourhood included (the day's text is made once a day there, not per cost)."""

from __future__ import annotations

import random
from datetime import UTC, datetime

from schemas.billing import day_of


def _datetime_s(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y%m%d")


def test_the_day_is_datetime_s_at_random_times_and_around_every_midnight() -> None:
    rnd = random.Random(7)
    times = [rnd.uniform(-86_400.0 * 400, 4.3e9) for _ in range(20_000)]
    for day in [*range(-3, 3), *rnd.sample(range(49_000), 300)]:
        for eps in (0.0, 1e-7, 4e-7, 5e-7, 6e-7, 1e-6, 1.5e-6, 0.5, -1e-7, -5e-7, -1e-6, -1.5e-6, -0.5):
            times.append(day * 86_400.0 + eps)
    assert [day_of(t) for t in times] == [_datetime_s(t) for t in times]
