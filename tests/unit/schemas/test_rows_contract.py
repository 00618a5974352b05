"""The raw tables' rows are one contract (`schemas.rows`): the migrations create exactly the
columns the sink writes, and every event field is stored or deliberately left out. Checked on
current ClickHouse (chDB, in process); the engines tests run the same migrations on 18.16."""

from __future__ import annotations

import uuid

from attribution.migrate import apply_migrations
from attribution.sql import ChdbBackend
from schemas.rows import NOT_STORED, RAW_ROWS, SOURCE_COLUMNS
from streams.sink import COLUMNS

DERIVED = {"ts_ms"}  # written by the sink from `ts`, not a model field


def test_the_sink_writes_the_contract() -> None:
    assert COLUMNS == RAW_ROWS


def test_every_event_field_is_stored_or_left_out_on_purpose() -> None:
    for model, (table, columns) in RAW_ROWS.items():
        fields = set(model.model_fields)
        assert set(columns) - DERIVED <= fields, f"{table}: columns that are no field of {model.__name__}"
        missing = fields - set(columns) - NOT_STORED[model]
        assert not missing, f"{model.__name__} fields neither in {table} nor in NOT_STORED: {missing}"


def test_the_migrations_create_the_contract_tables() -> None:
    db = ChdbBackend(f"rows_{uuid.uuid4().hex[:6]}")
    apply_migrations(db)
    for _, (table, columns) in RAW_ROWS.items():
        described = [row[0] for row in db.execute(f"DESCRIBE TABLE {table}")]
        assert described[:3] == ["event_id", "ts", "ts_ms"] == list(columns[:3])
        assert set(columns) | set(SOURCE_COLUMNS) <= set(described), (
            f"{table}: the sink writes columns the migrations never create: "
            f"{set(columns) | set(SOURCE_COLUMNS) - set(described)}"
        )


def test_a_column_migration_applied_twice_is_harmless() -> None:
    """Two processes that migrate at once (two workers starting together) may both apply an
    `ALTER TABLE … ADD COLUMN` migration; the second must not fail on the existing column (it
    did: 'Cannot add column ab_arm: column with this name already exists')."""
    db = ChdbBackend(f"rows_{uuid.uuid4().hex[:6]}")
    apply_migrations(db)
    db.execute("TRUNCATE TABLE schema_migrations")  # as if the other migrator had not recorded it yet
    assert "004_impression_arms" in apply_migrations(db)
    assert [r[0] for r in db.execute("DESCRIBE TABLE impressions")].count("ab_arm") == 1
