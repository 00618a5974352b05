"""Apply the ClickHouse migrations in `attribution/migrations/*.sql`, each exactly once.

Applied versions (file stems, e.g. ``001_raw_events``) are recorded in `schema_migrations`;
running again applies only what is new. Statements inside a file are separated by `;` and are
written to be idempotent themselves (``IF NOT EXISTS``), so a run interrupted mid-file is safe to
repeat.
"""

from __future__ import annotations

import logging
import re
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


_ADD_COLUMN = re.compile(r"^\s*ALTER\s+TABLE\s+(\w+)\s+ADD\s+COLUMN\s+(\w+)\s", re.IGNORECASE)


def _execute_idempotent(backend: Backend, stmt: str) -> None:
    """Run a migration statement so that running it twice is harmless, as two processes that
    migrate at once (two workers starting together) do: `CREATE … IF NOT EXISTS` is so by itself,
    and an `ALTER TABLE t ADD COLUMN c` (ClickHouse 18.16 has no `ADD COLUMN IF NOT EXISTS`) is
    skipped when the column is there, before or after a failed attempt."""
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


def apply_migrations(backend: Backend, directory: Path = MIGRATIONS_DIR) -> list[str]:
    """Apply every migration not yet in the backend's `schema_migrations`; return their versions.

    The same code path for the ClickHouse server and for chDB (tests run both).
    """
    backend.execute(_LEDGER)
    done = {row[0] for row in backend.execute("SELECT version FROM schema_migrations")}
    applied: list[str] = []
    for path in migration_files(directory):
        if path.stem in done:
            continue
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
