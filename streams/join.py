"""The label join: impression + click + dwell within the attribution window → TrainingExamples.

Pure and deterministic (no I/O, no clock): time is the stream's event time, advanced by the
caller. One `LabelJoin` per co-partition (the same user always lands in the same one).

Two label modes (`settings.online.label_mode`). **hold** emits one example per impression with its
final labels (`label_kind="final"`), as described below. The **fake-negative** modes
(`fn_weighted`, `fn_calibrated`; Ktena et al., "Addressing Delayed Feedback for Continuous
Training with Neural Networks in CTR prediction", RecSys 2019) never wait: an impression is
emitted at once as a negative (`"fake_negative"`), its click inside the window as a positive
duplicate (`"click"`, its own event id) and a dwell as a label update (`"dwell"`); the trainer's
loss corrects for the duplicated positives (`trainers.online`). Windows still bound attribution:
a click after its window is late in both modes.

* An impression opens a pending entry with the features the ranker saw at that moment.
* The first click inside the window emits a positive example at once (with the dwell if it was
  already known) and marks the entry done; later clicks/dwells for it are counted, not re-emitted.
* When stream time passes ``impression ts + window`` an entry that was never clicked is emitted
  as a negative (its `dwell_ms` = the longest dwell seen) — if it was shown (below). A served ad
  never shown (a client-rendered slot whose render beacon never came: the user never saw it) is
  no example at all, counted `unshown`: "not clicked" means nothing of an ad never seen.
* A click or dwell that arrives before its impression (out of order) is kept as an orphan for one
  window and applied when the impression arrives; one whose impression window already closed is
  late: counted and dropped. Orphans expire through their own deadline heap, so a stream full of
  clicks whose impression never comes costs O(log n) per event, not a rescan of all of them.

Served, shown, billed (`schemas.billing`): a pending impression is *shown* once its first render
beacon (`View`) inside the window joins it, or at once when its slot renders on the server. The
first view is kept for the event store (`views`, drained by the worker: one row per shown
impression), a repeated or late one is counted only, and a view whose impression never comes
(never served, or its window closed before it came) expires as an orphan, counted
`view_unserved`. The costs of the first showing (CPM) and of the first click (CPC) are kept in
`billed` for the worker, which adds them to the day's spend in the transaction of their offsets.

Training learns what billing bills: an impression is an example only once it is shown by the
same rule (`schemas.billing`: when served where `counts_as_shown`, else at its first view inside
the window). A click shows its impression
(`schemas.billing`: a click implies the ad was seen; its beacon was lost or is late): a CPM
impression clicked before any view is billed its showing at the click, and learned as clicked.
In the fake-negative modes the fake negative is emitted at the showing (the impression itself
when shown when served), not at the impression: an ad never shown is never learned.

Stream time is a `schemas.watermark.Watermark` over the event times seen (the median of the last
`watermark_window`), never a running max: one record dated a day ahead closes no window.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Literal

import msgspec
import numpy as np
from pydantic_core import TzInfo

from schemas.billing import cost_when_clicked, cost_when_shown, counts_as_shown
from schemas.events import Click, Dwell, Impression, TrainingExample, View
from schemas.ids import adapter_id_for
from schemas.watermark import DEFAULT_WINDOW, Watermark

AdapterScheme = Literal["slot", "advertiser", "slot+advertiser"]
LabelMode = Literal["hold", "fn_weighted", "fn_calibrated"]
LabelKind = Literal["final", "fake_negative", "click", "dwell"]


def example_id(impression_id: str, label: str = "") -> str:
    """The deterministic event id of an impression's TrainingExample (replays reproduce it);
    `label` names a later label of the same impression (fake-negative modes: "click", "dwell:…"),
    so a consumer deduplicating by event id keeps each of them once."""
    key = impression_id if not label else f"{impression_id}\0{label}"
    return "te-" + hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


def _dt(ts: float, given: datetime | None = None) -> datetime:
    """`ts` as a UTC datetime: `given` itself when it is that (the event's own, decoded from
    "…Z" text), else a new one (`datetime.fromtimestamp` was a twentieth of the worker's time:
    one per training example)."""
    if given is not None and given.tzinfo in _UTC_ZONES:
        return given  # ts == given.timestamp() (the caller's contract): the same instant and text
    return datetime.fromtimestamp(ts, tz=UTC)


# the UTC zones of decoded and of made times (a set lookup: a TzInfo's `utcoffset()` call cost
# as much as making the datetime); any other zone, UTC or not, gets a fresh UTC datetime
_UTC_ZONES: Final = frozenset({UTC, TzInfo(0)})


_EXAMPLE_FIELDS: Final = tuple(TrainingExample.model_fields)
_FIELDS_SET: Final = set(_EXAMPLE_FIELDS)
_object_setattr = object.__setattr__


def unchecked_example(values: dict[str, Any]) -> TrainingExample:
    """A TrainingExample of `values` (every field, in declaration order), without validating them.

    Every field the join fills comes from a validated impression, click or dwell, the catalog, or
    the worker's own bounded features (`Processor` clips them), so validation (8–9 µs an example,
    a fifth of the worker's time) could only re-confirm them; tests hold that
    `TrainingExample.model_validate` of every example the join emits gives an equal one. Built as
    `model_construct` builds, without its per-field alias and default handling.
    """
    ex = TrainingExample.__new__(TrainingExample)
    _object_setattr(ex, "__dict__", values)
    _object_setattr(ex, "__pydantic_fields_set__", _FIELDS_SET.copy())
    _object_setattr(ex, "__pydantic_extra__", None)
    _object_setattr(ex, "__pydantic_private__", None)
    return ex


@dataclass(slots=True)
class Deferred:
    """A fake negative made while its join was `deferring`: what `LabelJoin._example(p, ts, False,
    "fake_negative", at=at)` reads of its pending impression, taken when it was made (`dwell_ms`
    is the only one a later event of the batch may change)."""

    p: Pending
    ts: float
    at: datetime | None
    dwell_ms: int


# TrainingExample's fields in declaration order as a msgspec Struct: encoded by the same encoder
# as `schemas.codec.example_json` encodes an example's `__dict__`, the same bytes
_ExampleWire: Final = msgspec.defstruct("_ExampleWire", [(name, Any) for name in _EXAMPLE_FIELDS])
_LINES: Final = msgspec.json.Encoder()
# the order `fake_negatives_json` passes them in: a contract that changes them fails here, at import
_WIRE_ORDER: Final = (
    "event_id", "ts", "kind", "adapter_id", "impression_id", "impression_ts", "user_id", "ad_id",
    "campaign_id", "advertiser_id", "category", "slot", "position", "hour", "user_vector",
    "intent_score", "recall_score", "query_match", "served_pctr", "model_version", "adapter_version",
    "click", "dwell_ms", "label_kind", "variant_id", "variant_propensity",
)  # fmt: skip
assert _EXAMPLE_FIELDS == _WIRE_ORDER, "TrainingExample's fields changed: update fake_negatives_json"


def fake_negatives_json(made: list[Deferred], scheme: AdapterScheme) -> list[tuple[str, bytes]]:
    """Per deferred fake negative, its adapter id and the bytes `example_json` gives its example
    (tests hold it): built as a batch, without a TrainingExample, a dict or an encoder call each
    (the lines encoded by one call)."""
    if not made:
        return []
    adapters: dict[tuple[str, str], str] = {}
    rows = []
    keys = []
    for d in made:
        p, ts, at = d.p, d.ts, d.at
        imp = p.impression
        i = imp.__dict__  # a frozen model's fields, without attribute lookups
        its = i["ts"]
        slot, advertiser = i["slot"], i["advertiser_id"]
        adapter = adapters.get((slot, advertiser))
        if adapter is None:
            adapter = adapters[slot, advertiser] = adapter_id_for(slot, advertiser, scheme)
        keys.append(adapter)
        # the impression's own time when it was shown when served (`at` is its `ts`, `ts` its float)
        imp_ts = ts if at is its else its.timestamp()
        event_id = i["event_id"]
        rows.append(
            _ExampleWire(
                example_id(event_id),
                _dt(ts, at),
                "training_example",
                adapter,
                event_id,
                its,
                i["user_id"],
                i["ad_id"],
                i["campaign_id"],
                advertiser,
                p.category,
                slot,
                i["position"],
                int(imp_ts // 3600 % 24),
                p.user_vector.tolist(),
                p.intent_score,
                None,
                i["query_match"],
                i["pctr"],
                i["model_version"],
                i["adapter_version"],
                False,
                d.dwell_ms,
                "fake_negative",
                i["variant_id"],
                i["variant_propensity"],
            )
        )
    return list(zip(keys, _LINES.encode_lines(rows).split(b"\n")[:-1], strict=True))


_PENDING = struct.Struct("<ddBIHB")  # deadline, intent, flags, dwell_ms, dim, len(category)
_CLICKED, _SHOWN = 1, 2  # the flags byte (a record from before `shown` holds 0 or 1)


@dataclass(eq=False)
class Pending:
    """An impression waiting for its labels, with the features captured when it was served.

    Stored in Redis as a small binary record: the header above, the category, the float32 user
    vector (the features are float32 values, so this is exact) and the impression's JSON.
    """

    impression: Impression
    category: str
    user_vector: np.ndarray  # float32
    intent_score: float
    deadline: float
    clicked: bool = False
    dwell_ms: int = 0
    shown: bool = False  # a view joined it, or it was shown when served (`schemas.billing`)
    raw: bytes | None = field(default=None, compare=False, repr=False)

    def same(self, other: Pending) -> bool:
        """Field-wise equality (the vector compared element-wise)."""
        return (
            self.impression == other.impression
            and (self.category, self.intent_score, self.deadline, self.clicked, self.dwell_ms, self.shown)
            == (
                other.category,
                other.intent_score,
                other.deadline,
                other.clicked,
                other.dwell_ms,
                other.shown,
            )
            and bool(np.array_equal(self.user_vector, other.user_vector))
        )

    def to_bytes(self) -> bytes:
        if self.raw is None:
            self.raw = self.impression.model_dump_json().encode()
        cat = self.category.encode()
        vec = self.user_vector.astype("<f4", copy=False)
        head = _PENDING.pack(
            self.deadline,
            self.intent_score,
            (_CLICKED if self.clicked else 0) | (_SHOWN if self.shown else 0),
            self.dwell_ms,
            len(vec),
            len(cat),
        )
        return b"".join((head, cat, vec.tobytes(), self.raw))

    @classmethod
    def from_bytes(cls, data: bytes) -> Pending:
        deadline, intent, flags, dwell, dim, n = _PENDING.unpack_from(data, 0)
        off = _PENDING.size
        cat = data[off : off + n].decode()
        off += n
        vec = np.frombuffer(data, dtype="<f4", count=dim, offset=off).astype(np.float32)
        off += 4 * dim
        raw = data[off:]
        imp = Impression.model_validate_json(raw)
        assert isinstance(imp, Impression)
        return cls(imp, cat, vec, intent, deadline, bool(flags & _CLICKED), dwell, bool(flags & _SHOWN), raw)


@dataclass
class Orphan:
    """A click/dwell/view that arrived before its impression."""

    first_ts: float
    click_ts: float | None = None
    dwell_ms: int = 0
    view: View | None = None  # the first view (applied when the impression comes)
    view_ts: float = 0.0


@dataclass
class LabelJoin:
    """Pending impressions of one co-partition and the rules that turn them into examples."""

    window_s: float
    scheme: AdapterScheme = "slot"
    pending: dict[str, Pending] = field(default_factory=dict)
    orphans: dict[str, Orphan] = field(default_factory=dict)
    # the watermark: only raised (by `advance`, or by the worker restoring it after a restart)
    stream_ts: float = float("-inf")
    watermark_window: int = DEFAULT_WINDOW
    label_mode: LabelMode = "hold"
    # orphans are bounded in time (one window) and in number: beyond this the oldest is evicted
    max_orphans: int = 100_000
    counts: Counter[str] = field(default_factory=Counter)
    # ids whose Redis copy must be written / deleted (drained by the worker each batch)
    dirty: set[str] = field(default_factory=set)
    removed: set[str] = field(default_factory=set)
    # drained by the worker each batch: the views that made an impression shown (first in its
    # window, one per impression), and the costs billed: (campaign_id, event time, cost)
    views: list[tuple[View, float]] = field(default_factory=list)
    billed: list[tuple[str, float, float]] = field(default_factory=list)
    # set by `Processor.on_batch_json` while it joins a batch: a fake negative is returned as its
    # `Deferred` (this join's other examples as they are), built as bytes with the batch's others
    deferring: bool = False
    _deadlines: list[tuple[float, str]] = field(default_factory=list)
    _orphan_deadlines: list[tuple[float, str]] = field(default_factory=list)
    _clock: Watermark = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._clock = Watermark(self.watermark_window)
        self.fake_negatives = self.label_mode != "hold"

    def load(self, entries: dict[str, Pending]) -> None:
        """Restore pending impressions (e.g. from Redis after a restart)."""
        for iid, p in entries.items():
            self.pending[iid] = p
            heapq.heappush(self._deadlines, (p.deadline, iid))

    def _put(self, iid: str, p: Pending) -> None:
        self.pending[iid] = p
        self.dirty.add(iid)
        self.removed.discard(iid)

    def _drop(self, iid: str) -> None:
        self.pending.pop(iid, None)
        self.dirty.discard(iid)
        self.removed.add(iid)

    def _example(
        self,
        p: Pending,
        ts: float,
        click: bool,
        kind: LabelKind = "final",
        label: str = "",
        at: datetime | None = None,
    ) -> TrainingExample:
        """The example of `p` emitted at `ts` (`at`: the triggering event's own `ts`, whose
        `timestamp()` is `ts`, reused as the example's time when it is UTC)."""
        imp = p.impression
        self.counts[kind if kind in ("fake_negative", "dwell") else "positive" if click else "negative"] += 1
        return unchecked_example(
            {  # TrainingExample's fields in declaration order (tests compare with the model)
                "event_id": example_id(imp.event_id, label),
                "ts": _dt(ts, at),
                "kind": "training_example",
                "adapter_id": adapter_id_for(imp.slot, imp.advertiser_id, self.scheme),
                "impression_id": imp.event_id,
                "impression_ts": imp.ts,
                "user_id": imp.user_id,
                "ad_id": imp.ad_id,
                "campaign_id": imp.campaign_id,
                "advertiser_id": imp.advertiser_id,
                "category": p.category,
                "slot": imp.slot,
                "position": imp.position,
                "hour": int(imp.ts.timestamp() // 3600 % 24),  # UTC hour
                "user_vector": p.user_vector.tolist(),
                "intent_score": p.intent_score,
                "recall_score": None,
                "query_match": imp.query_match,  # the ranker's query feature, as served
                "served_pctr": imp.pctr,
                "model_version": imp.model_version,
                "adapter_version": imp.adapter_version,
                "click": click,
                "dwell_ms": p.dwell_ms,
                "label_kind": kind,
                "variant_id": imp.variant_id,  # the creative variant shown: serving's bandit learns it
                "variant_propensity": imp.variant_propensity,
            }
        )

    def _bill(self, imp: Impression, ts: float, cost: float) -> None:
        if cost > 0:
            self.billed.append((imp.campaign_id, ts, cost))
            self.counts["billed"] += 1

    def _show(
        self, iid: str, p: Pending, ts: float, view: View | None, at: datetime | None = None
    ) -> list[TrainingExample]:
        """The impression's first showing by a beacon or when served: kept (its view); billed
        (CPM) and, in the fake-negative modes, learned as a negative at once, unless its click
        showed it already (`_clicked`: billed and learned then). `at`: the datetime whose
        `timestamp()` is `ts` when the caller has it (else the view's own, shown at its time)."""
        p.shown = True
        self.dirty.add(iid)
        self.counts["shown"] += 1
        if view is not None:
            self.views.append((view, ts))
        if p.clicked:
            return []
        return self._first_showing(p, ts, at if at is not None or view is None else view.ts)

    def _first_showing(self, p: Pending, ts: float, at: datetime | None) -> list[TrainingExample]:
        self._bill(p.impression, ts, cost_when_shown(p.impression))
        if self.fake_negatives:
            if self.deferring:  # built with the batch's others (`fake_negatives_json`)
                self.counts["fake_negative"] += 1
                return [Deferred(p, ts, at, p.dwell_ms)]  # type: ignore[list-item]
            return [self._example(p, ts, False, "fake_negative", at=at)]
        return []

    def _clicked(self, iid: str, p: Pending, ts: float, at: datetime | None = None) -> list[TrainingExample]:
        """The impression's first click in its window: billed (CPC), its positive example. A
        click shows an impression no beacon showed yet (`schemas.billing`): its showing is billed
        (CPM) and learned (fake negative) first; a later beacon is kept, billed nothing."""
        out = [] if p.shown else self._first_showing(p, ts, at)
        p.clicked = True
        self.dirty.add(iid)
        self._bill(p.impression, ts, cost_when_clicked(p.impression))
        out.append(self._positive(p, ts, at))
        return out

    def _positive(self, p: Pending, ts: float, at: datetime | None = None) -> TrainingExample:
        if self.fake_negatives:
            return self._example(p, ts, True, "click", "click", at)
        return self._example(p, ts, True, at=at)

    def on_impression(
        self,
        imp: Impression,
        category: str,
        user_vector: np.ndarray,
        intent_score: float,
        raw: bytes | None = None,
        ts: float | None = None,
    ) -> list[TrainingExample]:
        """Open the impression's window; apply an orphan click/dwell that came before it.

        `ts` is `imp.ts.timestamp()` when the caller has it already (as for on_click/on_dwell).
        """
        iid = imp.event_id
        if iid in self.pending:
            self.counts["duplicate_impression"] += 1
            return []
        if ts is None:
            ts = imp.ts.timestamp()
        p = Pending(imp, category, user_vector, intent_score, ts + self.window_s, raw=raw)
        self._put(iid, p)
        heapq.heappush(self._deadlines, (p.deadline, iid))
        out: list[TrainingExample] = []
        orphan = self.orphans.pop(iid, None)
        if orphan is not None:
            p.dwell_ms = max(p.dwell_ms, orphan.dwell_ms)
        if counts_as_shown(imp):  # rendered on the server (or from before render beacons)
            out += self._show(iid, p, ts, None, imp.ts)
        elif orphan is not None and orphan.view is not None and orphan.view_ts <= p.deadline:
            # shown when the later of the two came: the example's time is that one's own
            later = orphan.view.ts if orphan.view_ts >= ts else imp.ts
            out += self._show(iid, p, max(orphan.view_ts, ts), orphan.view, later)
        if orphan is not None and orphan.click_ts is not None and orphan.click_ts <= p.deadline:
            out += self._clicked(iid, p, max(orphan.click_ts, ts))
        return out

    def _late_or_orphan(self, iid: str, ts: float, late: str = "late") -> Orphan | None:
        if ts + self.window_s < self.stream_ts:
            self.counts[late] += 1
            return None
        self.counts["out_of_order"] += 1
        orphan = self.orphans.get(iid)
        if orphan is None:
            orphan = self.orphans[iid] = Orphan(ts)
            heapq.heappush(self._orphan_deadlines, (ts + self.window_s, iid))
            heap = self._orphan_deadlines
            while len(self.orphans) > self.max_orphans and heap:
                expiry, old = heapq.heappop(heap)
                o = self.orphans.get(old)
                if o is not None and o.first_ts + self.window_s == expiry:
                    del self.orphans[old]
                    self.counts["orphan_evicted"] += 1
                    if o.view is not None:
                        self.counts["view_unserved"] += 1
        return orphan

    def on_click(self, click: Click, ts: float | None = None) -> list[TrainingExample]:
        """A click: positive example now if its impression is pending and inside the window."""
        if ts is None:
            ts = click.ts.timestamp()
        p = self.pending.get(click.impression_id)
        if p is None:
            orphan = self._late_or_orphan(click.impression_id, ts)
            if orphan is not None and orphan.click_ts is None:
                orphan.click_ts = ts
            return []
        if p.clicked:
            self.counts["repeat_click"] += 1
            return []
        if ts > p.deadline:
            self.counts["late"] += 1
            return []
        return self._clicked(click.impression_id, p, ts, click.ts)

    def on_view(self, view: View, ts: float | None = None) -> list[TrainingExample]:
        """A render beacon: the first one inside the impression's window makes it shown (kept in
        `views`, billed when CPM, its fake negative in those modes); a repeated, late or unserved
        one is counted, nothing more."""
        if ts is None:
            ts = view.ts.timestamp()
        iid = view.impression_id
        p = self.pending.get(iid)
        if p is None:
            orphan = self._late_or_orphan(iid, ts, "view_late")
            if orphan is not None and orphan.view is None:
                orphan.view, orphan.view_ts = view, ts
            elif orphan is not None:
                self.counts["view_repeat"] += 1
            return []
        if p.shown:
            self.counts["view_repeat"] += 1
        elif ts > p.deadline:
            self.counts["view_late"] += 1
        else:
            return self._show(iid, p, ts, view)
        return []

    def on_dwell(self, dwell: Dwell, ts: float | None = None) -> list[TrainingExample]:
        """A dwell: remembered for the impression's example (if not emitted yet)."""
        if ts is None:
            ts = dwell.ts.timestamp()
        p = self.pending.get(dwell.impression_id)
        if p is None:
            orphan = self._late_or_orphan(dwell.impression_id, ts)
            if orphan is not None:
                orphan.dwell_ms = max(orphan.dwell_ms, dwell.dwell_ms)
            return []
        if ts > p.deadline:
            self.counts["late"] += 1
        elif self.fake_negatives and not (p.shown or p.clicked):  # its showing's example carries it
            p.dwell_ms = max(p.dwell_ms, dwell.dwell_ms)
            self.dirty.add(dwell.impression_id)
        elif self.fake_negatives:  # emitted already: a label update, when it says more
            if dwell.dwell_ms > p.dwell_ms:
                p.dwell_ms = dwell.dwell_ms
                self.dirty.add(dwell.impression_id)
                return [self._example(p, ts, p.clicked, "dwell", f"dwell:{p.dwell_ms}", dwell.ts)]
            self.counts["dwell_repeat"] += 1
        elif p.clicked:
            self.counts["dwell_after_label"] += 1
        else:
            p.dwell_ms = max(p.dwell_ms, dwell.dwell_ms)
            self.dirty.add(dwell.impression_id)
        return []

    def advance(self, ts: float) -> list[TrainingExample]:
        """Observe one event time `ts`; when the watermark moves, close the windows that ended
        before it (it never moves back, and one record alone cannot move it: see the module)."""
        now = self._clock.observe(ts)
        if now <= self.stream_ts:
            return []
        self.stream_ts = now
        if not (self._deadlines and self._deadlines[0][0] < now) and not (
            self._orphan_deadlines and self._orphan_deadlines[0][0] < now
        ):
            return []  # the common case: nothing closes
        return self._close(lambda deadline: deadline < now)

    def close_all(self) -> list[TrainingExample]:
        """End of input: every open window closes (unclicked shown impressions become negatives)."""
        out = self._close(lambda deadline: True)
        self.orphans.clear()
        self._orphan_deadlines.clear()
        return out

    def _close(self, due: Any) -> list[TrainingExample]:
        out: list[TrainingExample] = []
        while self._deadlines and due(self._deadlines[0][0]):
            deadline, iid = heapq.heappop(self._deadlines)
            p = self.pending.get(iid)
            if p is None or p.deadline != deadline:
                continue
            if not (p.shown or p.clicked):
                self.counts["unshown"] += 1  # served, never seen: no example (nor bill)
            elif not p.clicked and not self.fake_negatives:
                out.append(self._example(p, deadline, False))
            self._drop(iid)
        heap = self._orphan_deadlines
        while heap and due(heap[0][0]):
            expiry, iid = heapq.heappop(heap)
            orphan = self.orphans.get(iid)
            if orphan is None or orphan.first_ts + self.window_s != expiry:
                continue  # joined by its impression meanwhile (or re-opened later)
            del self.orphans[iid]
            self.counts["orphan_expired"] += 1
            if orphan.view is not None:  # no impression came for it: never served (or long gone)
                self.counts["view_unserved"] += 1
        return out
