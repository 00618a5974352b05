"""tests/support/clock.py: how long a pCTR-comparing test waits to run inside one UTC hour."""

from datetime import UTC, datetime, timedelta, timezone

import pytest

from tests.support.clock import one_hour_wait


def test_a_window_that_fits_in_the_hour_starts_at_once() -> None:
    assert one_hour_wait(datetime(2026, 12, 6, 22, 10, tzinfo=UTC), 300) == 0.0
    assert one_hour_wait(datetime(2026, 12, 6, 22, 54, 59, tzinfo=UTC), 300) == 0.0


def test_a_window_that_would_cross_the_hour_waits_until_just_past_it() -> None:
    # the CI run that failed: the reference pCTR read at 22:5x, the new replica's at 23:0x
    now = datetime(2026, 12, 6, 22, 58, 30, tzinfo=UTC)
    wait = one_hour_wait(now, 300)
    assert wait == pytest.approx(91.0)
    start = now + timedelta(seconds=wait)
    assert start.hour == (start + timedelta(seconds=300)).hour == 23


def test_the_hour_is_utcs_whatever_the_clocks_zone() -> None:
    # 00:58:30 at +01:30 is 23:28:30 UTC: half an hour left
    now = datetime(2026, 12, 7, 0, 58, 30, tzinfo=timezone(timedelta(hours=1, minutes=30)))
    assert one_hour_wait(now, 300) == 0.0


def test_a_window_of_an_hour_cannot_fit() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        one_hour_wait(datetime(2026, 12, 6, 22, 0, 5, tzinfo=UTC), 3600)
