"""Daily spend per outside channel, imported from a CSV file (`adstream spend import FILE.csv`).

The file has a header `date,advertiser_id,source,medium,campaign,spend` (columns in any order;
`campaign` may be empty): one row per day (ISO `YYYY-MM-DD`, UTC) and outside channel, named as
`Touch` events name it (source / medium / campaign, UTM style). The whole file is checked before
anything is written: every bad row is named by its line number, and a file with any bad row
writes nothing. A day imported again replaces the earlier figure (`outside_spend` is a
ReplacingMergeTree on the import's version, read with FINAL).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import date
from typing import Any

from pydantic import TypeAdapter, ValidationError

from attribution.csv_rows import CsvRows
from attribution.paths import AttributionInputError
from attribution.sql import Backend
from schemas.events import Ident, Money

COLUMNS = ("date", "advertiser_id", "source", "medium", "campaign", "spend")
TABLE_COLUMNS = ("day", "advertiser_id", "source", "medium", "campaign", "spend", "version")
_IDENT: TypeAdapter[str] = TypeAdapter(Ident)
_MONEY: TypeAdapter[float] = TypeAdapter(Money)


class SpendFileError(AttributionInputError):
    """A spend file with bad rows: each named by its line number; nothing was written."""


@dataclass(frozen=True)
class SpendRow:
    """One day's spend on one outside channel of one advertiser."""

    day: date
    advertiser_id: str
    source: str
    medium: str
    campaign: str  # '' when the channel has no campaign
    spend: float

    @property
    def key(self) -> tuple[str, date, str, str, str]:
        return (self.advertiser_id, self.day, self.source, self.medium, self.campaign)


def _row(cells: dict[str, str]) -> SpendRow:
    """One row's cells → SpendRow; ValueError naming the column and value otherwise."""
    text = cells["date"].strip()
    try:
        day = date.fromisoformat(text)
    except ValueError:
        raise ValueError(f"date {text!r} is not YYYY-MM-DD") from None
    ids: dict[str, str] = {}
    for col in ("advertiser_id", "source", "medium"):
        ids[col] = _check(_IDENT, col, cells[col].strip())
    campaign = cells["campaign"].strip()
    if campaign:
        _check(_IDENT, "campaign", campaign)
    raw = cells["spend"].strip()
    try:
        amount = float(raw)
    except ValueError:
        raise ValueError(f"spend {raw!r} is not a number") from None
    return SpendRow(day, ids["advertiser_id"], ids["source"], ids["medium"], campaign,
                    _check(_MONEY, "spend", amount))  # fmt: skip


def _check(adapter: TypeAdapter[Any], col: str, value: Any) -> Any:
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        raise ValueError(f"{col} {value!r}: {exc.errors()[0]['msg']}") from None


def parse_spend_csv(text: str, name: str = "spend file") -> list[SpendRow]:
    """Every row of a spend CSV, or SpendFileError listing the bad rows by line number."""
    reader = CsvRows(text, name, COLUMNS, COLUMNS, SpendFileError)
    rows: list[SpendRow] = []
    seen: dict[tuple[str, date, str, str, str], int] = {}
    for line, record in reader:
        try:
            row = _row(record)
        except ValueError as exc:
            reader.bad(line, str(exc))
            continue
        if row.key in seen:
            reader.bad(line, f"the same day and channel as line {seen[row.key]}")
            continue
        seen[row.key] = line
        rows.append(row)
    reader.check("nothing imported")
    if not rows:
        raise SpendFileError(f"{name}: no spend rows")
    return rows


def import_spend(backend: Backend, rows: list[SpendRow], version: int | None = None) -> int:
    """Write parsed rows into `outside_spend` in one insert; returns the rows written."""
    v = version if version is not None else time.time_ns() // 1_000_000
    backend.insert(
        "outside_spend",
        TABLE_COLUMNS,
        [(r.day, r.advertiser_id, r.source, r.medium, r.campaign, r.spend, v) for r in rows],
    )
    return len(rows)
