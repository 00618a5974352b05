"""The streams worker's state and label join over an event list, without Kafka or Redis.

`training_examples(events, settings)` is what `adstream trainer --replay FILE` and the drift
benchmark use: final labels (`label_mode="hold"`) unless asked otherwise, the labelled data an
offline model trains on; `replay` computes exactly what the worker does (its `settings.online.label_mode`)
and also returns the final user states (tests compare them with Redis). `corrected_scores` puts
the per-user correction (`state.feedback_lr`) on a model's progressive scores of a stream, as a
replica serving that model would (the drift and peer benchmarks).
Events should be time-ordered (as the worker's per-partition merge delivers them); catalog
entries (`AdCreative`) in the list update the catalog when they are reached.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from schemas.events import Click, Impression, Message, TrainingExample
from schemas.settings import Settings, StateSettings
from schemas.user_record import UserState, bias_at
from streams.join import LabelMode
from streams.processor import AdVectors, Processor
from streams.state import AdInfo, apply_event


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


def corrected_scores(
    stream: Sequence[TrainingExample], scores: np.ndarray, params: StateSettings
) -> np.ndarray:
    """`scores` (a model's progressive pCTR of `stream`, in impression order) with the streams
    worker's per-user correction (`state.feedback_lr`) on top, as a replica would serve them,
    through the worker's own code: each user's `UserState` takes every
    impression (its `pctr` the corrected score it was served with) and click through
    `streams.state.apply_event`, and each impression is scored with the bias `bias_at` reads at
    its time, before its own outcome is folded in. Labels complete at once (a click right after
    its impression), as for the `online` model it sits on."""
    p = np.clip(scores, 1e-7, 1 - 1e-7)
    logit = np.log(p / (1 - p))
    states: dict[str, UserState] = {}
    ads: dict[str, AdInfo] = {}
    zero = np.zeros(1, dtype=np.float32)
    out = np.empty(len(stream))
    for i, e in enumerate(stream):
        st = states.get(e.user_id) or UserState.empty(e.user_id, 1)
        ad = ads.get(e.ad_id) or ads.setdefault(
            e.ad_id, AdInfo(e.ad_id, e.category, e.advertiser_id, e.campaign_id, zero)
        )
        ts = e.impression_ts.timestamp()
        b = bias_at(st, ts, params).get(e.category, 0.0)
        out[i] = served = 1.0 / (1.0 + math.exp(-(logit[i] + b)))
        imp = Impression.model_construct(
            event_id=e.impression_id, ts=e.impression_ts, user_id=e.user_id, request_id=e.impression_id,
            ad_id=e.ad_id, campaign_id=e.campaign_id, advertiser_id=e.advertiser_id, slot=e.slot,
            position=e.position, price=0.0, pctr=served,
        )  # fmt: skip
        st = apply_event(st, imp, ad, params, ts)
        if e.click:
            click = Click.model_construct(
                event_id=f"{e.impression_id}:click", ts=e.impression_ts, user_id=e.user_id,
                impression_id=e.impression_id, ad_id=e.ad_id, campaign_id=e.campaign_id,
            )  # fmt: skip
            st = apply_event(st, click, ad, params, ts)
        states[e.user_id] = st
    return out
