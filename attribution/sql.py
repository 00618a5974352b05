"""One way to run attribution SQL on either engine: the ClickHouse server (clickhouse-driver) or chDB.

Every query in attribution/ is written in the SQL that ClickHouse 18.16 (the Debian server) and
current releases both accept, with `%(name)s` placeholders. Values are always bound through
clickhouse-driver's escaping (client-side on 18.16, which has no server-side parameters): on
the server by the driver itself, on chDB by the same escaper, so no user value is ever pasted
into SQL by hand. Identifiers (table names) are never user input.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from schemas.errors import StoreError
from schemas.retry import clickhouse_errors


def _insert_errors() -> tuple[type[BaseException], ...]:
    """What an insert can fail with other than a bug: the driver's and the network's errors, and
    the values the driver cannot encode (bad data: TypeError, ValueError, OverflowError …)."""
    import struct

    return (*clickhouse_errors(), TypeError, ValueError, OverflowError, struct.error)


# Per impression, whether it was clicked / shown by a view beacon since `%(since)s` (one row per
# impression id, 1 in the flag column): the right sides of the ANY LEFT JOINs with which the ROI
# table (`attribution.roi.BILLED_SQL`) and the A/B rollup (`attribution.ab_rollups`) bill and count
# shown impressions (`schemas.billing`); joined `USING imp`.
CLICKED_BY_IMPRESSION_SQL = """
    SELECT impression_id AS imp, toUInt8(1) AS clicked FROM clicks FINAL
    WHERE ts >= toDateTime(%(since)s) GROUP BY impression_id"""
VIEWED_BY_IMPRESSION_SQL = """
    SELECT impression_id AS imp, toUInt8(1) AS viewed FROM views FINAL
    WHERE ts >= toDateTime(%(since)s) GROUP BY impression_id"""


def with_click_and_view(columns: str, impressions: str) -> str:
    """A FROM source: the rows of `impressions` (a SELECT with `imp`, one row per impression)
    with `columns` of theirs, each joined to whether it was clicked (`clicked`), then to whether a
    view beacon showed it (`viewed`); one JOIN per SELECT, as 18.16 wants. The ROI table's spend,
    the A/B rollup and the variant panel read their impressions through it.

    >>> "AS ic" in with_click_and_view("imp", "SELECT event_id AS imp FROM impressions FINAL")
    True
    """
    return f"""(
    SELECT {columns}, clicked
    FROM ({impressions}
    ) AS i
    ANY LEFT JOIN ({CLICKED_BY_IMPRESSION_SQL}
    ) AS c USING imp
) AS ic
ANY LEFT JOIN ({VIEWED_BY_IMPRESSION_SQL}
) AS v USING imp"""


# Whether an impression counts as shown when served (`schemas.billing.shown_at_serve`): its slot
# renders on the server, or it says nothing of rendering (from before render beacons); as a 0/1
# column `shown_at_serve` beside the joins' flags. One definition for the ROI, the A/B rollup and
# the dashboard page's queries.
SHOWN_AT_SERVE_SQL = "toUInt8(ifNull(render, '') != 'client')"


# What an impression was billed (`schemas.billing`), from its `bid_type` and `price` and the flags
# of the joins above (`clicked`, `viewed`) with `shown_at_serve` (rendered on the server, or from
# before render beacons): CPM price / 1000 once shown (a click shows it too), CPC its price once
# clicked, an impression without a bid type (from before bid types) its price when served. The ROI
# table's spend (`attribution.roi.BILLED_SQL`), the rollups' and the A/B rollup's revenue
# (`attribution.ab_rollups`) use it; tests hold it equal to the streams worker's billing.
BILLED_COST_SQL = (
    "if(isNull(bid_type), price, if(bid_type = 'cpc', clicked * price,\n"
    "           if(shown_at_serve OR viewed OR clicked, price / 1000., 0.)))"
)


class Backend(Protocol):
    """Runs a query with bound parameters and returns its rows as tuples."""

    name: str

    def execute(self, query: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]: ...

    def insert(self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None: ...

    def execute_columns(self, query: str, params: dict[str, Any] | None = None) -> list[np.ndarray]:
        """The result as one array per column (numeric columns as NumPy arrays)."""
        ...


class DriverBackend:
    """The ClickHouse server over the native protocol (a clickhouse-driver `Client`)."""

    name = "clickhouse"

    def __init__(self, client: Any) -> None:
        self.client = client

    def execute(self, query: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        try:
            return [tuple(r) for r in self.client.execute(query, params or {})]
        except clickhouse_errors() as exc:  # the driver's and the network's; a bug raises as itself
            raise StoreError(f"ClickHouse query failed: {_first_line(exc)}") from exc

    def execute_columns(self, query: str, params: dict[str, Any] | None = None) -> list[np.ndarray]:
        """Columns decoded by the driver's NumPy reader (no Python object per value).

        The per-query `use_numpy` setting makes the driver read NumPy columns; its result class
        (chosen when the client was made) is swapped for this call so that the blocks are joined
        as arrays rather than copied into tuples.
        """
        from clickhouse_driver.numpy.result import NumpyQueryResult

        plain = self.client.query_result_cls
        self.client.query_result_cls = NumpyQueryResult
        try:
            cols = self.client.execute(query, params or {}, columnar=True, settings={"use_numpy": True})
        except clickhouse_errors() as exc:
            raise StoreError(f"ClickHouse query failed: {_first_line(exc)}") from exc
        finally:
            self.client.query_result_cls = plain
        return [np.asarray(c) for c in cols]

    def insert(self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        try:
            self.client.execute(f"INSERT INTO {table} ({', '.join(columns)}) VALUES", list(rows))
        except _insert_errors() as exc:
            raise StoreError(f"insert into {table} failed: {_first_line(exc)}") from exc

    def insert_columnar(self, table: str, columns: Sequence[str], data: Sequence[Sequence[Any]]) -> None:
        """Insert column lists (the fast path: no per-row tuples)."""
        try:
            self.client.execute(
                f"INSERT INTO {table} ({', '.join(columns)}) VALUES", list(data), columnar=True
            )
        except _insert_errors() as exc:
            raise StoreError(f"insert into {table} failed: {_first_line(exc)}") from exc


class _UTCContext:
    """What clickhouse-driver's escaper asks of a connection context (only the server time zone)."""

    class server_info:
        @staticmethod
        def get_timezone() -> str:
            return "UTC"

    client_settings: ClassVar[dict[str, Any]] = {}


def bind(query: str, params: dict[str, Any] | None) -> str:
    """`query` with its `%(name)s` placeholders replaced by clickhouse-driver's escaped values."""
    from clickhouse_driver.util.escape import escape_params

    if not params:
        return query.replace("%%", "%")
    return str(query % escape_params(params, _UTCContext()))


class ChdbBackend:
    """Embedded current ClickHouse (chDB) in this process, one database inside a session."""

    name = "chdb"

    def __init__(self, database: str = "adstream", path: str | None = None) -> None:
        from chdb import session

        # chDB ships no type hints
        self.session = session.Session(path) if path else session.Session()  # type: ignore[no-untyped-call]
        self.database = database
        self.session.query(f"CREATE DATABASE IF NOT EXISTS {database}")  # type: ignore[no-untyped-call]
        self.session.query(f"USE {database}")  # type: ignore[no-untyped-call]

    def _typed_rows(
        self, query: str, params: dict[str, Any] | None
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Column types and rows (values as clickhouse-driver would return them) of a query."""
        sql = bind(query, params)
        try:
            result = self.session.query(sql, "JSONCompact")  # type: ignore[no-untyped-call]
        except RuntimeError as exc:  # chDB's ChdbError (a RuntimeError): the server refused the query
            raise StoreError(f"chDB query failed: {_first_line(exc)}") from exc
        text = result.data() if hasattr(result, "data") else str(result)
        if not text.strip():
            return [], []
        payload = json.loads(text)
        types = [m["type"] for m in payload["meta"]]
        rows = [tuple(_typed(v, t) for v, t in zip(row, types, strict=True)) for row in payload["data"]]
        return types, rows

    def execute(self, query: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        return self._typed_rows(query, params)[1]

    def execute_columns(self, query: str, params: dict[str, Any] | None = None) -> list[np.ndarray]:
        """The rows of `execute`, transposed (chDB's JSON has no columnar NumPy form here)."""
        types, rows = self._typed_rows(query, params)
        return [np.asarray([r[i] for r in rows], dtype=_NUMPY.get(t, object)) for i, t in enumerate(types)]

    def insert(self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        if not rows:
            return
        values = ", ".join("(" + ", ".join(["%s"] * len(columns)) + ")" for _ in rows)
        from clickhouse_driver.util.escape import escape_param

        ctx = _UTCContext()
        flat = tuple(escape_param(v, ctx) for row in rows for v in row)
        self.execute(
            f"INSERT INTO {table} ({', '.join(columns)}) VALUES " + (values % flat).replace("%", "%%")
        )

    def insert_columnar(self, table: str, columns: Sequence[str], data: Sequence[Sequence[Any]]) -> None:
        """Bulk insert through a temporary TSV file (chDB reads it with the `file` table function)."""
        import csv
        import os
        import tempfile

        if not data or not len(data[0]):
            return
        types = dict(self.execute(
            "SELECT name, type FROM system.columns WHERE database = %(db)s AND table = %(t)s",
            {"db": self.database, "t": table},
        ))  # fmt: skip
        # DateTime columns travel as epoch seconds (TSV would parse a bare number as a date)
        structure = ", ".join(f"{c} {'UInt32' if types[c] == 'DateTime' else types[c]}" for c in columns)
        fd, path = tempfile.mkstemp(suffix=".tsv")
        try:
            with os.fdopen(fd, "w", newline="") as fh:
                writer = csv.writer(
                    fh, delimiter="\t", quoting=csv.QUOTE_NONE, escapechar="\\", lineterminator="\n"
                )
                writer.writerows(zip(*data, strict=True))
            self.execute(
                f"INSERT INTO {table} ({', '.join(columns)}) "
                "SELECT * FROM file(%(path)s, 'TabSeparated', %(structure)s)",
                {"path": path, "structure": structure},
            )
        finally:
            os.unlink(path)

    def close(self) -> None:
        self.session.close()  # type: ignore[no-untyped-call]


_NUMPY: dict[str, Any] = {
    "UInt8": np.uint8, "UInt16": np.uint16, "UInt32": np.uint32, "UInt64": np.uint64,
    "Int8": np.int8, "Int16": np.int16, "Int32": np.int32, "Int64": np.int64,
    "Float32": np.float32, "Float64": np.float64,
}  # fmt: skip


def _typed(value: Any, type_name: str) -> Any:
    """JSON values back to what clickhouse-driver would return (64-bit ints arrive quoted)."""
    inner = (
        type_name.removeprefix("Nullable(").removesuffix(")")
        if type_name.startswith("Nullable(")
        else type_name
    )
    if value is None:
        # JSON has no NaN: chDB writes a non-finite Float (e.g. the CPA of a channel without
        # conversions) as null; the server's driver returns it as the float it is
        return float("nan") if inner == type_name and inner.startswith("Float") else None
    if inner.startswith(("UInt", "Int")) and isinstance(value, str):
        return int(value)
    if inner.startswith("Float") and isinstance(value, str):
        return float(value)
    if inner.startswith("Array(") and isinstance(value, list):
        return [_typed(v, inner[6:-1]) for v in value]
    return value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip()[:1].isdigit()]
    message = " ".join(lines[:2]).split(" Stack trace:")[0]
    return (message or text)[:400]
