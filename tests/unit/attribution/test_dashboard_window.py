"""The dashboard's time window: parsing, defaults, bucket choice, and clear errors."""

from __future__ import annotations

import math
import re

import pytest

from attribution.dashboard import queries as q
from attribution.dashboard.app import finite
from schemas.errors import ConfigError

DAY = 86400
T0 = 1767225600  # 2026-01-01T00:00:00Z


@pytest.mark.parametrize(
    ("text", "epoch"),
    [
        ("1767225600", T0),
        ("2026-01-01", T0),
        ("2026-01-01T00:00:00", T0),  # no offset: UTC
        ("2026-01-01T00:00:00Z", T0),
        ("2026-01-01T01:00:00+01:00", T0),
        (" 2026-01-01 00:00:30 ", T0 + 30),
    ],
)
def test_parse_time_takes_epoch_and_iso(text: str, epoch: int) -> None:
    assert q.parse_time(text, "since") == epoch


@pytest.mark.parametrize("text", ["yesterday", "inf", "nan", "-inf", "", "2026-13-01"])
def test_parse_time_names_the_field_and_value(text: str) -> None:
    with pytest.raises(
        ConfigError, match=re.escape(f"until={text!r} is neither epoch seconds nor an ISO 8601")
    ):
        q.parse_time(text, "until")


def test_defaults_come_from_the_data() -> None:
    w = q.resolve((T0, T0 + 3600))
    assert (w.since, w.until) == (T0, T0 + 3601)
    assert w.bucket == 60 and len(w.buckets) <= q.MAX_BUCKETS  # 3,601 s: 30 s would give 121
    long = q.resolve((T0, T0 + 30 * DAY))  # a month of data: the last week by default
    assert long.until - long.since == q.DEFAULT_SPAN_S


def test_an_empty_database_gets_the_last_day() -> None:
    w = q.resolve(None)
    assert w.until - w.since == DAY + 1  # up to just after now


def test_explicit_until_before_all_data_still_gives_a_window() -> None:
    w = q.resolve((T0, T0 + 3600), until=str(T0 - 100))
    assert (w.since, w.until) == (T0 - 100 - DAY, T0 - 100)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"since": "2026-01-02", "until": "2026-01-01"},
            "until=2026-01-01T00:00:00+00:00 must be after since=",
        ),
        ({"bucket": 0}, "bucket=0 must be between 1 s and 366 days"),
        ({"top": 0}, "top=0 must be between 1 and 100"),
        ({"top": 101}, "top=101 must be between 1 and 100"),
        ({"since": "-5"}, "since=-5 is before 1970"),
        ({"until": "9999999999"}, "beyond DateTime's range"),
        ({"run_id": "r" * 129}, "longer than 128 characters"),
    ],
)
def test_bad_windows_are_clear_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        q.resolve((T0, T0 + 3600), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("span", "bucket"), [(1, 1), (120, 1), (121, 5), (3600, 30), (DAY, 900), (7 * DAY, 3 * 3600)]
)
def test_auto_bucket_is_the_smallest_nice_one(span: int, bucket: int) -> None:
    assert q.auto_bucket(span) == bucket
    assert math.ceil(span / bucket) <= q.MAX_BUCKETS


def test_auto_bucket_beyond_the_nice_list_stays_within_the_cap() -> None:
    span = 1000 * DAY
    assert math.ceil(span / q.auto_bucket(span)) <= q.MAX_BUCKETS


def test_coarse_bucket_never_finer_than_the_window_bucket() -> None:
    w = q.Window(T0, T0 + DAY, 60)
    assert w.coarse_bucket == 3600 and math.ceil(DAY / w.coarse_bucket) <= q.COARSE_BUCKETS
    assert q.Window(T0, T0 + DAY, 7200).coarse_bucket == 7200


def test_buckets_cover_the_window() -> None:
    w = q.Window(T0 + 10, T0 + 100, 30)
    assert w.buckets == [T0, T0 + 30, T0 + 60, T0 + 90]


def test_params_are_all_the_placeholders_used() -> None:
    names = {n for sql in q.QUERIES.values() for n in re.findall(r"%\((\w+)\)s", sql)}
    assert names == set(q.Window(T0, T0 + 60, 1).params)
    assert all(isinstance(v, int | str) for v in q.Window(T0, T0 + 60, 1).params.values())


def test_no_statement_splices_values_or_uses_what_18_16_lacks() -> None:
    for name, sql in q.QUERIES.items():
        stripped = sql.replace("%(", "")
        assert "%" not in stripped, f"{name}: a bare % (format placeholder or modulo)"
        assert "{" not in sql and "}" not in sql, f"{name}: an unformatted brace"
        for missing in (r"toStartOfInterval", r"\bOVER\b", r"\bWITH\b", r"DateTime64", r"\bMap\("):
            assert not re.search(missing, sql), f"{name} uses {missing}, which 18.16 lacks"


def test_finite_replaces_nan_and_inf_for_json() -> None:
    got = finite({"a": [1.0, math.nan, {"b": math.inf}], "c": (-math.inf, "x", 2)})
    assert got == {"a": [1.0, None, {"b": None}], "c": [None, "x", 2]}
