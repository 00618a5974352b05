"""Apply the ClickHouse migrations in `attribution/migrations/*.sql`, each exactly once.

Applied versions (file stems, e.g. ``001_raw_events``) are recorded in `schema_migrations`;
running again applies only what is new. Statements inside a file are separated by `;` and are
written to be idempotent themselves (``IF NOT EXISTS``), so a run interrupted mid-file is safe to
repeat.

One statement is ours, not ClickHouse's: `REBUILD TABLE t ENGINE = … PARTITION BY … ORDER BY …`
gives an existing table a new engine clause (ClickHouse 18.16 cannot change a MergeTree's sorting
key or partitioning in place): `rebuild_table` copies it into a new table of the same columns and
swaps the two by RENAME, safe to interrupt and run again (see there).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from attribution.sql import Backend, DriverBackend
from schemas.clients import clickhouse_client, clickhouse_database, redacted_url
from schemas.errors import ConfigError, StoreError
from schemas.retry import clickhouse_errors
from schemas.settings import Settings

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).parent / "migrations"

_LEDGER = (
    "CREATE TABLE IF NOT EXISTS schema_migrations (version String, applied_at DateTime) "
    "ENGINE = MergeTree() ORDER BY version"
)


def migration_files(directory: Path = MIGRATIONS_DIR) -> list[Path]:
    """The migration files in apply order (by name)."""
    return sorted(directory.glob("*.sql"))


def statements(sql: str) -> list[str]:
    """The statements of a migration file: `--` comments dropped, split on `;`."""
    lines = [line for line in sql.splitlines() if not line.strip().startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


_REBUILD = re.compile(r"^\s*REBUILD\s+TABLE\s+(\w+)\s+ENGINE\s*=\s*(.+)$", re.IGNORECASE | re.DOTALL)
_ADD_COLUMN = re.compile(r"^\s*ALTER\s+TABLE\s+(\w+)\s+ADD\s+COLUMN\s+(\w+)\s", re.IGNORECASE)


def _execute_idempotent(backend: Backend, stmt: str) -> None:
    """Run a migration statement so that running it twice is harmless, as two processes that
    migrate at once (two workers starting together) do: `CREATE … IF NOT EXISTS` is so by itself,
    and an `ALTER TABLE t ADD COLUMN c` (ClickHouse 18.16 has no `ADD COLUMN IF NOT EXISTS`) is
    skipped when the column is there, before or after a failed attempt."""
    rebuild = _REBUILD.match(stmt)
    if rebuild is not None:
        rebuild_table(backend, rebuild.group(1), " ".join(rebuild.group(2).split()))
        return
    added = _ADD_COLUMN.match(stmt)
    if added is not None and _has_column(backend, *added.groups()):
        return
    try:
        backend.execute(stmt)
    except Exception:
        if added is not None and _has_column(backend, *added.groups()):
            return  # another migrator added it between the check and the ALTER
        raise


def _has_column(backend: Backend, table: str, column: str) -> bool:
    rows = backend.execute(
        "SELECT count() FROM system.columns WHERE database = currentDatabase() "
        "AND table = %(table)s AND name = %(column)s",
        {"table": table, "column": column},
    )
    return bool(rows and rows[0][0])


NEW_SUFFIX, OLD_SUFFIX = "__rebuilt", "__before_rebuild"


def rebuild_table(backend: Backend, table: str, engine: str) -> bool:
    """Give `table` the engine clause `engine` (e.g. a new ORDER BY); True if it was rebuilt now.

    Steps, each safe to interrupt and to run again, while writers keep inserting into `table`:
    1. nothing to do when the table already has that sorting key and partition key (a rebuild
       done before, or the table created by a later CREATE) and no `t__before_rebuild` is left;
    2. `t__rebuilt` is created afresh `AS t` (the same columns, whatever migrations added
       before this one) with the new engine clause, and `t`'s rows are copied into it one
       calendar month of `ts` at a time (a current server refuses an INSERT that touches more
       than 100 partitions; a month is at most 31 daily ones);
    3. `RENAME TABLE t TO t__before_rebuild, t__rebuilt TO t` in one statement: writers switch
       to the new table at once;
    4. the rows the old table received after its copy began (writers that inserted during the
       copy, or before the RENAME) are copied over, unless the new table has their event_id;
    5. the old table is dropped only when every event_id it holds is in the new table; otherwise
       it stays and the migration fails naming it, so no row is lost silently.
    A run interrupted after step 3 finds `t` rebuilt and `t__before_rebuild` left: it resumes
    at step 4 (with every row of the old table as the candidates).
    """
    new, old = f"{table}{NEW_SUFFIX}", f"{table}{OLD_SUFFIX}"
    done, left = _has_engine(backend, table, engine), _exists(backend, old)
    if done and not left:
        return False
    since = 0  # step 4's candidates: the old table's rows ingested at or after this (epoch s)
    if not done:
        if left:
            raise StoreError(
                f"cannot rebuild {table}: {old} is left from an earlier rebuild but {table} has not "
                f"the new layout ({engine}); inspect both and drop the one that is not needed"
            )
        since = int(backend.execute("SELECT toUInt32(now())")[0][0]) - 1
        backend.execute(f"DROP TABLE IF EXISTS {new}")
        backend.execute(f"CREATE TABLE {new} AS {table} ENGINE = {engine}")
        for lo, hi in _months(backend, table):
            backend.execute(f"INSERT INTO {new} SELECT * FROM {table} WHERE {_MONTH}", {"lo": lo, "hi": hi})
        backend.execute(f"RENAME TABLE {table} TO {old}, {new} TO {table}")
    recent = "ingested_at >= toDateTime(%(since)s)"
    backend.execute(
        f"INSERT INTO {table} SELECT * FROM {old} WHERE {recent} "
        f"AND event_id NOT IN (SELECT event_id FROM {table} WHERE {recent})",
        {"since": since},
    )
    # a month at a time, so that the set of ids in memory stays one month's (an event and its
    # re-delivered copies carry one `ts`)
    missing = sum(
        int(backend.execute(
            f"SELECT count() FROM {old} WHERE {_MONTH} "
            f"AND event_id NOT IN (SELECT event_id FROM {table} WHERE {_MONTH})",
            {"lo": lo, "hi": hi},
        )[0][0])
        for lo, hi in _months(backend, old)
    )  # fmt: skip
    if missing:
        raise StoreError(
            f"rebuilding {table}: {missing} rows of {old} are not in the new {table}; {old} is kept"
        )
    backend.execute(f"DROP TABLE {old}")
    log.info("rebuilt %s with ENGINE = %s on %s", table, engine, backend.name)
    return True


_MONTH = "ts >= toDateTime(%(lo)s) AND ts < toDateTime(%(hi)s)"


def _exists(backend: Backend, table: str) -> bool:
    rows = backend.execute(
        "SELECT count() FROM system.tables WHERE database = currentDatabase() AND name = %(t)s", {"t": table}
    )
    return bool(rows and rows[0][0])


def _has_engine(backend: Backend, table: str, engine: str) -> bool:
    """Whether `table` has the sorting and partition keys that `engine` names."""
    rows = backend.execute(
        "SELECT sorting_key, partition_key FROM system.tables "
        "WHERE database = currentDatabase() AND name = %(t)s",
        {"t": table},
    )
    if not rows:
        raise StoreError(f"cannot rebuild {table}: no such table")
    sorting, partition = (_plain(str(x)) for x in rows[0])
    order = re.search(r"ORDER\s+BY\s+(.+?)(?:\s+SETTINGS\s|$)", engine, re.IGNORECASE)
    part = re.search(r"PARTITION\s+BY\s+(.+?)\s+ORDER\s+BY", engine, re.IGNORECASE)
    want_order = _plain(order.group(1)) if order else ""
    want_part = _plain(part.group(1)) if part else ""
    return sorting == want_order and partition == want_part


def _plain(key: str) -> str:
    """A key expression without spaces and outer parentheses: `(ts, event_id)` → `ts,event_id`."""
    key = re.sub(r"\s+", "", key)
    return key[1:-1] if key.startswith("(") and key.endswith(")") and "," in key else key


def _months(backend: Backend, table: str) -> list[tuple[int, int]]:
    """[lo, hi) epoch-second bounds of each calendar month (UTC) from `table`'s first to last `ts`."""
    from datetime import UTC, datetime

    lo, hi, n = backend.execute(f"SELECT toUInt32(min(ts)), toUInt32(max(ts)), count() FROM {table}")[0]
    if not n:
        return []
    out: list[tuple[int, int]] = []
    start = datetime.fromtimestamp(int(lo), UTC).replace(day=1, hour=0, minute=0, second=0)
    while int(start.timestamp()) <= int(hi):
        nxt = start.replace(year=start.year + start.month // 12, month=start.month % 12 + 1)
        out.append((int(start.timestamp()), int(nxt.timestamp())))
        start = nxt
    return out


LOCK_TABLE = "schema_migrations_lock"


@contextmanager
def migration_lock(backend: Backend, wait_s: float = 900.0, poll_s: float = 0.25) -> Iterator[None]:
    """Hold the database's migration lock: the table `schema_migrations_lock`, which only one
    `CREATE TABLE` (without IF NOT EXISTS) can create. Processes that migrate at once (two
    workers starting together) take turns: most statements are idempotent by themselves, but a
    `REBUILD TABLE` run twice at once would race on its temporary tables. Waits at most
    `wait_s` for another holder, then raises StoreError naming the holder and the table (a
    migrator killed while holding it leaves it: drop it when no migration runs)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            backend.execute(f"CREATE TABLE {LOCK_TABLE} (owner String, taken DateTime) ENGINE = TinyLog")
            break
        except Exception as exc:
            # held, or held and released since the CREATE failed (a fast migrator): try again;
            # anything else is the server refusing the statement itself
            if not _exists(backend, LOCK_TABLE) and "already exists" not in str(exc):
                raise
            if time.monotonic() >= deadline:
                owner = backend.execute(f"SELECT owner, taken FROM {LOCK_TABLE}")
                held = f" ({owner[0][0]}, since {owner[0][1]})" if owner else ""
                raise StoreError(
                    f"another migration has held {LOCK_TABLE}{held} for over {wait_s:.0f} s; "
                    f"if none runs, DROP TABLE {LOCK_TABLE}"
                ) from None
            time.sleep(poll_s)
    try:
        backend.insert(LOCK_TABLE, ("owner", "taken"), [(f"{socket.gethostname()}:{os.getpid()}", _now())])
        yield
    finally:
        backend.execute(f"DROP TABLE IF EXISTS {LOCK_TABLE}")


def apply_migrations(backend: Backend, directory: Path = MIGRATIONS_DIR) -> list[str]:
    """Apply every migration not yet in the backend's `schema_migrations`; return their versions.

    Holds `migration_lock` while anything is left to apply (a process that finds nothing to do
    takes no lock). The same code path for the ClickHouse server and for chDB (tests run both).
    """
    backend.execute(_LEDGER)
    if not _pending(backend, directory):
        return []
    with migration_lock(backend):
        return _apply(backend, _pending(backend, directory))


def _pending(backend: Backend, directory: Path) -> list[Path]:
    done = {row[0] for row in backend.execute("SELECT version FROM schema_migrations")}
    return [path for path in migration_files(directory) if path.stem not in done]


def _apply(backend: Backend, pending: list[Path]) -> list[str]:
    applied: list[str] = []
    for path in pending:
        for stmt in statements(path.read_text()):
            _execute_idempotent(backend, stmt)
        backend.insert("schema_migrations", ("version", "applied_at"), [(path.stem, _now())])
        log.info("applied migration %s on %s", path.stem, backend.name)
        applied.append(path.stem)
    return applied


def migrate(settings: Settings, directory: Path = MIGRATIONS_DIR) -> list[str]:
    """Create the database if needed and apply every migration not applied yet; return them."""
    try:
        db = clickhouse_database(settings)
    except ConfigError as exc:
        raise StoreError(str(exc)) from exc
    admin = clickhouse_client(settings)
    try:
        admin.execute(f"CREATE DATABASE IF NOT EXISTS {db}")
    except clickhouse_errors() as exc:  # unreachable or refused; a bug raises as itself
        raise StoreError(f"ClickHouse at {redacted_url(settings.clickhouse.url)}: {exc}") from exc
    finally:
        admin.disconnect()
    client = clickhouse_client(settings, db)
    try:
        return apply_migrations(DriverBackend(client), directory)
    except StoreError as exc:
        raise StoreError(f"migration failed on {db}: {exc}") from exc
    finally:
        client.disconnect()


def _now() -> Any:
    from datetime import datetime

    return datetime.now().replace(microsecond=0)
