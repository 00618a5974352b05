"""The CSV files users hand to attribution (`adstream spend import`, `attribution mmm
--lift-file`): the header checked against the file's columns, then each data row with its line
number; every bad row is named by its line and a file with any bad row is refused whole."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator

from attribution.paths import AttributionInputError

MAX_ERRORS = 20  # bad rows listed in the error (all are counted)


class CsvRows:
    """The data rows of `text` (header first, columns in any order; `required` must all be there,
    every column must be one of `columns`). Iterating yields (line, cells) for each non-blank row;
    a row with the wrong number of cells is recorded as bad, as is each one passed to `bad`;
    `check` then raises `error` listing them."""

    def __init__(
        self,
        text: str,
        name: str,
        columns: tuple[str, ...],
        required: tuple[str, ...],
        error: type[AttributionInputError],
    ) -> None:
        self.name, self.error = name, error
        self.reader = csv.DictReader(io.StringIO(text))
        header = [h.strip() for h in self.reader.fieldnames or []]
        missing = [c for c in required if c not in header]
        if missing:
            raise error(f"{name}: line 1: header lacks {', '.join(missing)} (needs {','.join(columns)})")
        unknown = [h for h in header if h not in columns]
        if unknown:
            raise error(f"{name}: line 1: unknown columns {', '.join(map(repr, unknown))}")
        self.reader.fieldnames = header
        self.width = len(header)
        self.errors: list[str] = []

    def __iter__(self) -> Iterator[tuple[int, dict[str, str]]]:
        for record in self.reader:
            line = self.reader.line_num
            if None in record or any(v is None for v in record.values()):
                self.bad(line, f"expected {self.width} cells")
                continue
            if not any(v.strip() for v in record.values()):
                continue  # a blank line
            yield line, record

    def bad(self, line: int, why: str) -> None:
        self.errors.append(f"line {line}: {why}")

    def check(self, nothing: str) -> None:
        """Raise `error` naming the bad rows (`nothing`: what was not done, e.g. 'nothing imported')."""
        if self.errors:
            shown = "; ".join(self.errors[:MAX_ERRORS])
            n = len(self.errors)
            more = f" (and {n - MAX_ERRORS} more)" if n > MAX_ERRORS else ""
            raise self.error(f"{self.name}: {n} bad rows, {nothing}: {shown}{more}")
