"""Training data from contract events, for `adstream train` / `adstream trainer --replay` and the
benchmarks: a JSON-lines file or ClickHouse's raw event tables, turned into `TrainingExample`s by
the streams room's label join (given examples pass as they are). It lives in `deploy` because it
joins two rooms: trainers may not import streams.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from schemas.errors import AdstreamError
from schemas.events import AdapterDelta, AdCreative, DeadLetter, Message, TrainingExample
from schemas.settings import Settings

log = logging.getLogger(__name__)


def read_events(path: Path) -> tuple[list[Message], int]:
    """Contract messages of a JSON-lines file (mixed kinds) and how many lines were invalid."""
    from schemas.codec import decode_any

    events: list[Message] = []
    bad = 0
    with path.open("rb") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                events.append(decode_any(line))
            except AdstreamError as exc:
                bad += 1
                if bad <= 5:
                    log.warning("%s:%d skipped: %s", path, n, exc)
    return events, bad


def examples_from_events(
    events: Iterable[Message], settings: Settings
) -> tuple[list[TrainingExample], dict[str, AdCreative]]:
    """TrainingExamples (given ones, plus those the streams join derives from raw events) and the catalog."""
    from streams.in_memory import training_examples

    given: list[TrainingExample] = []
    raw: list[Message] = []
    catalog: dict[str, AdCreative] = {}
    for e in events:
        if isinstance(e, TrainingExample):
            given.append(e)
        elif isinstance(e, DeadLetter | AdapterDelta):
            continue
        else:
            if isinstance(e, AdCreative):
                catalog[e.ad_id] = e
            raw.append(e)
    raw.sort(key=lambda m: m.ts)  # stable: the file's order within equal times
    derived = list(training_examples(raw, settings)) if raw else []
    return given + derived, catalog


def events_from_clickhouse(settings: Settings, limit: int | None) -> list[Message]:
    """Raw events back from ClickHouse (the streams sink's tables), in time order."""
    from trainers.clickhouse_source import read_events as ch_read

    return ch_read(settings, limit=limit)
