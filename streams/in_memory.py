"""The streams worker's state and label join over an event list, without Kafka or Redis.

`training_examples(events, settings)` is what `adstream trainer --replay FILE` and the drift
benchmark use: final labels (`label_mode="hold"`) unless asked otherwise, the labelled data an
offline model trains on; `replay` computes exactly what the worker does (its `settings.online.label_mode`)
and also returns the final user states (tests compare them with Redis).
Events should be time-ordered (as the worker's per-partition merge delivers them); catalog
entries (`AdCreative`) in the list update the catalog when they are reached.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from schemas.events import Message, TrainingExample
from schemas.settings import Settings
from streams.join import LabelMode
from streams.processor import AdVectors, Processor
from streams.state import UserState


def training_examples(
    events: Iterable[Message],
    settings: Settings,
    close_open_windows: bool = True,
    label_mode: LabelMode = "hold",
) -> Iterator[TrainingExample]:
    """TrainingExamples in emission order, computed exactly as the worker does in `label_mode`
    (hold: one per impression, with its final labels; fake-negative modes: the stream the online
    trainer would learn, see `streams.join`).

    With `close_open_windows`, impressions whose window is still open when the input ends are
    emitted as negatives at the end (a finished log gets no more clicks).
    """
    proc = Processor.from_settings(settings, label_mode=label_mode)
    for event in events:
        yield from proc.on_event(event)
    if close_open_windows:
        yield from proc.join.close_all()


@dataclass
class ReplayResult:
    """Everything a replay computed: final user states, examples, and the join/state counters."""

    states: dict[str, UserState]
    examples: list[TrainingExample]
    counts: Counter[str] = field(default_factory=Counter)


def replay(
    events: Iterable[Message],
    settings: Settings,
    close_open_windows: bool = False,
    catalog: AdVectors | None = None,
) -> ReplayResult:
    """Run the worker's pure core over `events`; return final states, examples and counters."""
    proc = Processor.from_settings(settings, catalog)
    examples: list[TrainingExample] = []
    for event in events:
        examples += proc.on_event(event)
    if close_open_windows:
        examples += proc.join.close_all()
    counts = proc.counts + proc.join.counts
    return ReplayResult(dict(proc.states), examples, counts)
