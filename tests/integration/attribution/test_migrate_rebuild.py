"""Migration 008 (`REBUILD TABLE`, attribution.migrate.rebuild_table) on ClickHouse 18.16 and chDB:
the raw tables of a database migrated before it get the time-ordered key (month partitions kept)
with every row kept, a re-delivered event still collapses, a second run changes nothing, and a
run interrupted before or after its RENAME resumes without losing or doubling a row; migrators
that start together take turns (`attribution.migrate.migration_lock`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from attribution.migrate import (
    LOCK_TABLE,
    MIGRATIONS_DIR,
    apply_migrations,
    migration_lock,
    rebuild_table,
)
from attribution.sql import Backend, DriverBackend
from schemas.clients import clickhouse_client
from schemas.errors import StoreError
from tests.support.databases import fresh_database, migrations_upto

pytestmark = [pytest.mark.clickhouse, pytest.mark.timeout(300)]

REBUILD = "008_raw_time_order"
ENGINE = "ReplacingMergeTree() PARTITION BY toYYYYMM(ts) ORDER BY (ts, event_id)"
RAW = ("impressions", "clicks", "dwell", "conversions", "touches", "ads")
# three months (and one without a row), so the copy runs a month at a time; the last row
# re-delivers the first click
CLICKS = [
    ("c1", 1_788_000_000, "u1", "i1"),  # 2026-08-29 10:40 UTC
    ("c2", 1_790_700_000, "u2", "i2"),  # 2026-09-29 16:40
    ("c3", 1_790_800_000, "u1", "i3"),  # 2026-09-30 20:26
    ("c4", 1_793_500_000, "u3", "i4"),  # 2026-11-01 02:26
    ("c1", 1_788_000_000, "u1", "i1"),
]


def _click_rows(rows: list[tuple[str, int, str, str]]) -> list[tuple[Any, ...]]:
    from datetime import UTC, datetime

    return [
        (e, datetime.fromtimestamp(t, UTC).replace(tzinfo=None), t * 1000, u, i, "ad", "cmp", 0, n)
        for n, (e, t, u, i) in enumerate(rows)
    ]


COLS = ("event_id", "ts", "ts_ms", "user_id", "impression_id", "ad_id", "campaign_id", "kafka_partition",
        "kafka_offset")  # fmt: skip


def _upto(tmp: Path, last: str) -> Path:
    """The migrations up to `last`, as a release that ended there had them (later ones, such as
    columns added after the rebuild, are not the rebuild's to check)."""
    return migrations_upto(tmp, last)


def _before(tmp: Path) -> Path:
    """The migrations before the rebuild (a database migrated by an older release)."""
    return migrations_upto(tmp, REBUILD, inclusive=False)


@pytest.fixture(params=["clickhouse", "chdb"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """A fresh database on the engine, migrated up to 007, with clicks over three months."""
    with fresh_database(request.param, request, "rb") as db:
        assert REBUILD not in apply_migrations(db, _before(tmp_path))
        db.insert("clicks", COLS, _click_rows(CLICKS))
        yield db


def _keys(db: Backend, table: str) -> tuple[str, str]:
    sorting, partition = db.execute(
        "SELECT sorting_key, partition_key FROM system.tables WHERE database = currentDatabase() "
        "AND name = %(t)s",
        {"t": table},
    )[0]
    return str(sorting).replace(" ", ""), str(partition).replace(" ", "")


def _clicks(db: Backend) -> list[tuple[Any, ...]]:
    return sorted(
        (str(r[0]), int(r[1]), str(r[2]))
        for r in db.execute("SELECT event_id, toUInt32(ts), impression_id FROM clicks FINAL")
    )


def _tables(db: Backend) -> set[str]:
    return {
        str(r[0]) for r in db.execute("SELECT name FROM system.tables WHERE database = currentDatabase()")
    }


EXPECTED = sorted({(e, t, i) for e, t, _, i in CLICKS})


def test_the_raw_tables_are_rebuilt_time_ordered_with_every_row(backend: Backend, tmp_path: Path) -> None:
    columns = {t: backend.execute(f"DESCRIBE TABLE {t}") for t in RAW}
    assert _keys(backend, "clicks")[0] == "event_id"
    assert apply_migrations(backend, _upto(tmp_path, REBUILD)) == [REBUILD]
    for table in RAW:
        assert _keys(backend, table) == ("ts,event_id", "toYYYYMM(ts)"), table
        assert backend.execute(f"DESCRIBE TABLE {table}") == columns[table], table  # same columns, defaults
    assert _clicks(backend) == EXPECTED
    assert not {t for t in _tables(backend) if "__" in t}  # no copy or old table left
    # a re-delivered event still collapses into one row; one partition per month
    backend.insert("clicks", COLS, _click_rows(CLICKS[3:4]))
    assert _clicks(backend) == EXPECTED
    months = backend.execute(
        "SELECT uniqExact(partition) FROM system.parts WHERE database = currentDatabase() "
        "AND table = 'clicks' AND active"
    )[0][0]
    assert months == 3
    # running it again (another migrator, or a ledger that missed it) changes nothing
    backend.execute("TRUNCATE TABLE schema_migrations")
    assert REBUILD in apply_migrations(backend, MIGRATIONS_DIR)
    assert rebuild_table(backend, "clicks", ENGINE) is False
    assert _clicks(backend) == EXPECTED


def test_a_rebuild_interrupted_after_its_rename_resumes(backend: Backend) -> None:
    """Left: the new table (missing the rows written during the copy) and the old one."""
    backend.execute(f"CREATE TABLE clicks__rebuilt AS clicks ENGINE = {ENGINE}")
    backend.execute("INSERT INTO clicks__rebuilt SELECT * FROM clicks WHERE event_id != 'c3'")
    backend.execute("RENAME TABLE clicks TO clicks__before_rebuild, clicks__rebuilt TO clicks")
    assert _clicks(backend) != EXPECTED
    assert rebuild_table(backend, "clicks", ENGINE) is True
    assert _clicks(backend) == EXPECTED
    assert backend.execute("SELECT count() FROM clicks WHERE event_id = 'c2'")[0][0] == 1  # not copied twice
    assert "clicks__before_rebuild" not in _tables(backend)


def test_a_rebuild_interrupted_before_its_rename_starts_again(backend: Backend) -> None:
    """Left: a half-filled copy (with a row the source does not have): it is made afresh."""
    backend.execute(f"CREATE TABLE clicks__rebuilt AS clicks ENGINE = {ENGINE}")
    backend.insert("clicks__rebuilt", COLS, _click_rows([("junk", 1_790_000_000, "u9", "i9")]))
    assert rebuild_table(backend, "clicks", ENGINE) is True
    assert _clicks(backend) == EXPECTED
    assert _keys(backend, "clicks") == ("ts,event_id", "toYYYYMM(ts)")


def test_an_old_table_beside_an_unrebuilt_one_is_refused(backend: Backend) -> None:
    """Two tables that both might hold the rows: neither is dropped, the error names both."""
    backend.execute("CREATE TABLE clicks__before_rebuild AS clicks")
    with pytest.raises(StoreError, match=r"clicks__before_rebuild.*clicks"):
        rebuild_table(backend, "clicks", ENGINE)
    assert _clicks(backend) == EXPECTED


def test_a_held_migration_lock_makes_the_next_migrator_wait_then_names_it(backend: Backend) -> None:
    """While one migrator holds the lock, another waits; past its wait it fails naming the lock
    table and its holder (never a second rebuild racing the first); released, it is taken again."""
    with migration_lock(backend):
        assert LOCK_TABLE in _tables(backend)
        t0 = time.monotonic()
        with pytest.raises(StoreError, match=rf"{LOCK_TABLE} \(.+:\d+, since .+\) for over 1 s.*DROP TABLE"):
            with migration_lock(backend, wait_s=0.6, poll_s=0.1):
                pass
        assert time.monotonic() - t0 >= 0.6
    assert LOCK_TABLE not in _tables(backend)
    with migration_lock(backend, wait_s=0.1):
        pass
    assert LOCK_TABLE not in _tables(backend)


class _ReleasedInBetween:
    """A backend whose first `CREATE TABLE` of the lock meets another migrator's lock, which that
    migrator drops at once: between this CREATE failing and the check that the lock exists."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.raced = False

    def execute(self, query: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        if not self.raced and query.startswith(f"CREATE TABLE {LOCK_TABLE}"):
            self.raced = True
            self.inner.execute(query)  # the other migrator takes the lock
            try:
                return self.inner.execute(query, params)  # ours: 'already exists'
            finally:
                self.inner.execute(f"DROP TABLE {LOCK_TABLE}")  # and it is released in between
        return self.inner.execute(query, params)

    def insert(self, table: str, columns: Any, rows: Any) -> None:
        self.inner.insert(table, columns, rows)


def test_a_lock_released_between_the_create_and_the_check_is_taken(backend: Backend) -> None:
    """Two workers starting together (fresh-clone CI, 2026-12-04): the second's CREATE of the lock
    failed with 'already exists', the first released the lock before the second looked for it,
    and the second took the error for the server refusing the statement: 'migration failed …
    schema_migrations_lock already exists', and the worker exited. The lock is taken on the
    next try."""
    racing = _ReleasedInBetween(backend)
    with migration_lock(racing, wait_s=5.0, poll_s=0.05):  # type: ignore[arg-type]
        assert racing.raced and LOCK_TABLE in _tables(backend)
    assert LOCK_TABLE not in _tables(backend)


@pytest.mark.parametrize("backend", ["clickhouse"], indirect=True)  # chDB: one migrator per process
def test_two_migrators_at_once_rebuild_once(
    backend: Backend, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Two workers starting together both migrate a database from before 008 (the race that
    killed the second worker with "clicks__before_rebuild already exists"): both succeed, every
    row is kept once, nothing is left behind."""
    assert isinstance(backend, DriverBackend)
    db = backend.execute("SELECT currentDatabase()")[0][0]
    request.getfixturevalue("stack")  # on this thread: fixtures are not for worker threads
    folder = _upto(tmp_path, REBUILD)
    errors: list[BaseException] = []
    results: list[list[str]] = []
    start = threading.Barrier(2)

    def run() -> None:
        client = clickhouse_client(request.getfixturevalue("stack"), db)
        try:
            start.wait()
            results.append(apply_migrations(DriverBackend(client), folder))
        except BaseException as exc:  # the test reports it
            errors.append(exc)
        finally:
            client.disconnect()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert sorted(results, key=len) == [[], [REBUILD]]  # one applied it, the other found it done
    assert _clicks(backend) == EXPECTED
    assert not {t for t in _tables(backend) if "__" in t or t == LOCK_TABLE}
