"""The pure per-partition core shared by the worker and the offline replay.

`Processor.on_event` applies one valid event to the user's state and the label join and returns
the TrainingExamples it emits; it does no I/O. The caller provides user states it has loaded
(`states`), reads back which users changed (`dirty_users`), and advances stream time.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.codec import example_json
from schemas.events import MAX_FEATURE, AdCreative, Click, Dwell, Impression, Message, TrainingExample, View
from schemas.settings import Settings, StateSettings
from schemas.user_record import UserState, decay_factor
from schemas.watermark import DEFAULT_WINDOW
from streams.fold import Folded, fold_batch
from streams.join import AdapterScheme, Deferred, LabelJoin, LabelMode, fake_negatives_json
from streams.state import USER_EVENTS, AdInfo, apply_event

UNKNOWN_CATEGORY = "unknown"


@dataclass
class AdVectors:
    """Ads by id, with their content vectors (the worker keeps it in memory from `ad.catalog`)."""

    dim: int
    ads: dict[str, AdInfo] = field(default_factory=dict)

    def update(self, ad: AdCreative) -> None:
        # inactive ads keep their vector: past impressions of them still carry meaning
        self.ads[ad.ad_id] = AdInfo.from_creative(ad, self.dim)

    def get(self, ad_id: str) -> AdInfo | None:
        return self.ads.get(ad_id)


@dataclass
class Processor:
    """User state + label join of one co-partition (or of everything, offline)."""

    params: StateSettings
    window_s: float
    scheme: AdapterScheme
    catalog: AdVectors
    states: MutableMapping[str, UserState] = field(default_factory=dict)
    dirty_users: set[str] = field(default_factory=set)
    counts: Counter[str] = field(default_factory=Counter)
    join: LabelJoin = field(init=False)
    watermark_window: int = DEFAULT_WINDOW
    label_mode: LabelMode = "hold"

    def __post_init__(self) -> None:
        self.join = LabelJoin(
            self.window_s, self.scheme, watermark_window=self.watermark_window, label_mode=self.label_mode
        )

    @classmethod
    def from_settings(
        cls, settings: Settings, catalog: AdVectors | None = None, label_mode: LabelMode | None = None
    ) -> Processor:
        """The worker's core for `settings` (`label_mode`: settings.online.label_mode unless given)."""
        return cls(
            params=settings.state,
            window_s=settings.streams.attribution_window_s,
            scheme=settings.adapter_scheme,
            catalog=catalog or AdVectors(settings.state_dim),
            watermark_window=settings.streams.watermark_window,
            label_mode=label_mode or settings.online.label_mode,
        )

    @property
    def dim(self) -> int:
        """Dimension of the state vectors: the catalog's (settings.state_dim)."""
        return self.catalog.dim

    def state_of(self, user_id: str) -> UserState:
        s = self.states.get(user_id)
        return s if s is not None else UserState.empty(user_id, self.dim)

    def on_event(
        self, event: Message, raw: bytes | None = None, ts: float | None = None
    ) -> list[TrainingExample]:
        """Apply one valid event; return the examples it emits (duplicates change nothing).

        `raw` is the event's JSON as received (kept for the pending impression, not re-encoded);
        `ts` is `event.ts.timestamp()` when the caller has it already.
        """
        if not isinstance(event, USER_EVENTS):
            return self._other(event, ts)
        uid = event.user_id
        before = self.states.get(uid)
        if before is None:
            before = UserState.empty(uid, self.dim)
        ad_id = event.ad_id
        ad = self.catalog.get(ad_id) if ad_id is not None else None
        if ad is None and ad_id is not None:
            self.counts["unknown_ad"] += 1
        if ts is None:
            ts = event.ts.timestamp()
        after = apply_event(before, event, ad, self.params, ts)
        if after is before:
            self.counts["duplicate"] += 1
            return []
        self.states[uid] = after
        self.dirty_users.add(uid)
        self.counts["applied"] += 1
        join = self.join
        if isinstance(event, Impression):
            category = ad.category if ad is not None else UNKNOWN_CATEGORY
            # the features as served: `vector_at` and `intent_score` of the state before it
            f = decay_factor(before, ts, self.params)
            vec = before.vector if f == 1.0 else before.vector * np.float32(f)  # float32 stays
            score = before.intents.get(category, 0.0)
            score = score * f if score else 0.0
            if not -MAX_FEATURE <= score <= MAX_FEATURE or not within_bound(vec):
                score, vec = _bounded(score, vec)
            out = join.on_impression(event, category, vec, score, raw, ts)
        elif isinstance(event, Click):
            out = join.on_click(event, ts)
        elif isinstance(event, Dwell):
            out = join.on_dwell(event, ts)
        else:
            out = []
        closed = join.advance(ts)
        if closed:
            out += closed
        return out

    def _other(self, event: Message, ts: float | None) -> list[TrainingExample]:
        """`on_event` of what is no user event: a catalog entry, or a render beacon (no user
        state: the join's alone)."""
        if isinstance(event, AdCreative):
            self.catalog.update(event)
        elif isinstance(event, View):
            ts = event.ts.timestamp() if ts is None else ts
            return self.join.on_view(event, ts) + self.join.advance(ts)
        return []

    def on_batch(self, items: Sequence[tuple[Message, bytes | None, float]]) -> list[TrainingExample]:
        """`on_event` of each (event, raw, ts) in order, the same states, examples and counts,
        with the user states folded per user and their vectors stepped as arrays
        (`streams.fold`); then the label join, in order, on the features the fold gave."""
        users: list[tuple[Message, AdInfo | None, float, str | None]] = []
        kept: list[tuple[Message, bytes | None, float, str]] = []  # user events and views, in order
        for event, raw, ts in items:
            if isinstance(event, AdCreative):  # in order: later events of the batch see it
                self.catalog.update(event)
            elif isinstance(event, View):  # no user state: the join's alone (below, in order)
                kept.append((event, raw, ts, ""))
            elif isinstance(event, USER_EVENTS):
                ad_id = event.ad_id
                ad = self.catalog.get(ad_id) if ad_id is not None else None
                if ad is None and ad_id is not None:
                    self.counts["unknown_ad"] += 1
                category = (
                    (ad.category if ad is not None else UNKNOWN_CATEGORY)
                    if isinstance(event, Impression)
                    else None
                )
                users.append((event, ad, ts, category))
                kept.append((event, raw, ts, category or ""))
        folded = fold_batch(self.states, users, self.params, self.dim)
        self.states.update(folded.states)
        self.dirty_users.update(folded.states)
        return self._join_all(kept, folded)

    def on_batch_json(self, items: Sequence[tuple[Message, bytes | None, float]]) -> list[tuple[str, bytes]]:
        """`on_batch`, its examples as the worker produces them: per example, in order, its
        adapter id (the topic's key) and `example_json` of it — the same states, counts and bytes
        (tests hold it). The fake negatives, one per shown impression in those label modes, are
        built as a batch (`streams.join.fake_negatives_json`), never as TrainingExamples."""
        join = self.join
        join.deferring = True
        try:
            made: list[Any] = self.on_batch(items)
        finally:
            join.deferring = False
        built = iter(fake_negatives_json([e for e in made if type(e) is Deferred], self.scheme))
        return [next(built) if type(e) is Deferred else (e.adapter_id, example_json(e)) for e in made]

    def _join_all(
        self, kept: list[tuple[Message, bytes | None, float, str]], folded: Folded
    ) -> list[TrainingExample]:
        """The label join of a batch's user events and views, in order, on the fold's features."""
        out: list[TrainingExample] = []
        features, scores = folded.features, folded.scores
        bounded = ~(np.abs(features).max(axis=1, initial=0.0) <= MAX_FEATURE) if len(features) else features
        join = self.join
        folded_at = iter(zip(folded.applied, folded.feature_row, strict=True))
        for event, raw, ts, category in kept:
            if isinstance(event, View):
                out += join.on_view(event, ts)  # a showing's fake negative (those modes)
                if closed := join.advance(ts):
                    out += closed
                continue
            applied, row = next(folded_at)
            if not applied:
                self.counts["duplicate"] += 1
                continue
            self.counts["applied"] += 1
            if row >= 0:
                vec, score = features[row], scores[row]
                if not -MAX_FEATURE <= score <= MAX_FEATURE or bounded[row]:
                    score, vec = _bounded(score, vec)
                out += join.on_impression(event, category, vec, score, raw, ts)  # type: ignore[arg-type]
            elif isinstance(event, Click):
                out += join.on_click(event, ts)
            elif isinstance(event, Dwell):
                out += join.on_dwell(event, ts)
            closed = join.advance(ts)
            if closed:
                out += closed
        return out


_MAX_SQUARE = MAX_FEATURE * MAX_FEATURE
# a state far beyond the bound (a bot's) overflows the float32 dot to inf, which only sends it to
# the component-wise check: not worth a warning per such user
warnings.filterwarnings("ignore", "overflow encountered in dot", RuntimeWarning, __name__)


def within_bound(vec: np.ndarray) -> bool:
    """`np.abs(vec).max() <= MAX_FEATURE` for a float32 vector (False with a NaN), mostly in one
    dot product: a component over the bound (≥ 1e6 + 1/16 in float32) has a square over 1e12
    after float32 rounding, and a sum of squares is never below its largest, so `vec·vec <= 1e12`
    proves every component within; only a vector that fails it is checked component-wise."""
    return bool(np.dot(vec, vec) <= _MAX_SQUARE or np.abs(vec).max() <= MAX_FEATURE)


def _bounded(score: float, vec: np.ndarray) -> tuple[float, np.ndarray]:
    """Features clipped to the contract's bound (`MAX_FEATURE`; NaN → 0): a state beyond it (a
    bot's millions of clicks) still gives a valid TrainingExample instead of stopping the join."""
    score = 0.0 if score != score else min(MAX_FEATURE, max(-MAX_FEATURE, score))
    vec = np.clip(np.nan_to_num(vec, nan=0.0), -MAX_FEATURE, MAX_FEATURE).astype(np.float32)
    return score, vec
