"""Per-user state: a decayed, engagement-weighted vector of ads, intent-decay scores, sessions.

Pure functions only (no Kafka, Redis or clock): `decay`, `apply_event`, `intent_scores`.

Intent decay, as docs/DESIGN.md states it, made precise:

* Between two events a score decays with the configured half-life τ (`state.half_life_s`):
  ``s·α^(Δt/τ)`` with α = ½, i.e. `decay(s, Δt, τ)`; it is applied lazily from `last_ts`, so a
  read at any time costs O(1) and equals what an (empty) event at that time would produce.
* A gap over `session_gap_s` (30 s) starts a new session and discounts every score once more by
  `alpha_session` (0.85).
* A contradicting signal — a dwell shorter than `contradict_dwell_ms` (2 s) on an impression the
  user clicked — multiplies that category's score by `alpha_contradict` (0.62).

Event weights (`settings.state.weights`): an impression is very weak positive evidence (it records
that the user saw the category: the logging policy chose it, the user did not), a click strong, a
dwell proportional to its length up to `dwell_full_ms`, a quick skip (dwell under the
contradiction threshold) negative evidence for the state vector, a conversion the strongest.

An event older than `last_ts` (late or out of order) is folded in with its contribution decayed
by its age instead of moving time backwards; it never opens a session. Duplicates (producer
retries) are recognised by a bounded ring of recent event-id hashes and change nothing.

The per-user correction (`bias`, `state.feedback_lr`): the state above moves only on positive
evidence, so a user whose tastes change keeps being shown what they no longer click. Each
(user, category) also keeps a logit bias that serving adds to the ranker's logit, learned by
online SGD on log loss from every impression's outcome: the gradient y − p splits into −p at the
impression (its `pctr` is what the replica served, the bias included) and +1 at its click, so the
worker applies `−lr·pctr` when the impression arrives and `+lr` when the click does — no waiting
for the attribution window to close. An impression without `pctr` (not served by adstream)
teaches nothing, and a click moves only a category whose impressions did. The bias fades with
the clock half-life (not the session discount: it corrects the model, it is not an intent),
stays within ±`state.feedback_max`, and only the `state.max_intents` largest are kept.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import numpy as np

from schemas.events import AdCreative, Click, Conversion, Dwell, Impression, Message
from schemas.settings import StateSettings
from schemas.user_record import (
    UserState,
    decay,
)
from schemas.vectors import content_vector

RECENT_IDS: Final = 32  # duplicate detection ring per user (retries arrive close together)
RECENT_CLICKS: Final = 8  # clicked impressions remembered for the contradiction rule
USER_EVENTS: Final = (Impression, Click, Dwell, Conversion)


@dataclass(frozen=True, slots=True)
class AdInfo:
    """What the state needs to know of an ad: its category and unit content vector (float32)."""

    ad_id: str
    category: str
    advertiser_id: str
    campaign_id: str
    vector: np.ndarray

    @classmethod
    def from_creative(cls, ad: AdCreative, dim: int) -> AdInfo:
        vec = np.asarray(content_vector(ad.category, ad.title, dim), dtype=np.float32)
        return cls(ad.ad_id, ad.category, ad.advertiser_id, ad.campaign_id, vec)


def id_hash(value: str) -> int:
    """A stable 32-bit hash of an id (duplicate and click rings; stable across processes)."""
    return _from_bytes(_blake2b(value.encode(), digest_size=4).digest(), "little")


_blake2b = hashlib.blake2b
_from_bytes = int.from_bytes


def feedback_step(event: Message, params: StateSettings) -> float:
    """The SGD step one event takes on its category's bias (0.0 when it takes none): −lr·pctr
    for an impression served with a pctr, +lr for a click.

    >>> from datetime import UTC, datetime
    >>> imp = Impression(event_id="e", ts=datetime(2026, 1, 1, tzinfo=UTC), user_id="u", request_id="r",
    ...     ad_id="a", campaign_id="c", advertiser_id="v", slot="feed", position=0, price=1.0, pctr=0.25)
    >>> feedback_step(imp, StateSettings(feedback_lr=0.5))
    -0.125
    """
    lr = params.feedback_lr
    if lr <= 0:
        return 0.0
    if isinstance(event, Impression):
        return -lr * event.pctr if event.pctr is not None else 0.0
    if isinstance(event, Click):
        return lr
    return 0.0


def _fold_bias(
    bias: Mapping[str, float], category: str, step: float, clicked: bool, params: StateSettings
) -> Mapping[str, float]:
    """`bias` (already decayed to the event) after `step` on `category`: a click moves only a
    category an impression moved (else its +lr would have no −p to balance); clamped to
    ±`feedback_max`, the `max_intents` largest kept."""
    if not step or (clicked and category not in bias):
        return bias
    out = dict(bias)
    lim = params.feedback_max
    out[category] = min(lim, max(-lim, out.get(category, 0.0) + step))
    if len(out) > params.max_intents:
        out = dict(sorted(out.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[: params.max_intents])
    return out


def evidence_forget(
    intents: Mapping[str, float], category: str, weight: float, params: StateSettings
) -> float:
    """The factor the old state is scaled by before positive evidence `weight` in `category`
    is added (`StateSettings.evidence_half_life`, `evidence_surprise`); 1.0 when that is off.

    >>> evidence_forget({}, "shoes", 2.0, StateSettings(evidence_half_life=2.0))
    0.5
    """
    if not (params.evidence_half_life > 0 and weight > 0):
        return 1.0
    units = weight
    if params.evidence_surprise:
        mass = sum(v for v in intents.values() if v > 0)
        units *= 1.0 - max(0.0, intents.get(category, 0.0)) / mass if mass > 0 else 1.0
    return math.pow(0.5, units / params.evidence_half_life)


def _evidence(
    event: Message, state: UserState | Folding, params: StateSettings
) -> tuple[float, float, float]:
    """(vector weight, intent increment, intent factor) of one event for its ad's category."""
    w = params.weights
    if isinstance(event, Impression):
        return w.impression, w.impression, 1.0
    if isinstance(event, Click):
        return w.click, w.click, 1.0
    if isinstance(event, Dwell):
        if event.dwell_ms < params.contradict_dwell_ms:
            clicked = id_hash(event.impression_id) in state.recent_clicks
            return -w.skip, 0.0, params.alpha_contradict if clicked else 1.0
        share = min(1.0, event.dwell_ms / w.dwell_full_ms) if w.dwell_full_ms > 0 else 1.0
        return w.dwell * share, w.dwell * share, 1.0
    if isinstance(event, Conversion):
        return w.conversion, w.conversion, 1.0
    return 0.0, 0.0, 1.0


@dataclass(slots=True, eq=False)
class Folding:
    """A user's state while events are folded into it: the scalars of `UserState`, mutable and
    owned by the fold (its `intents` a copy), without the vector, whose steps `fold_event`
    returns to the caller (`apply_event` applies them to one vector, `streams.fold` to a
    batch's users at once). `freeze(vector)` gives the UserState."""

    user_id: str
    dim: int
    intents: dict[str, float]
    last_ts: float
    session_start_ts: float
    sessions: int
    session_events: int
    events: int
    impressions: int
    clicks: int
    late: int
    version: int
    recent_ids: tuple[int, ...]
    recent_clicks: tuple[int, ...]
    bias: Mapping[str, float]  # replaced, never mutated: it may be the state's own

    @classmethod
    def of(cls, s: UserState) -> Folding:
        return cls(
            s.user_id, s.dim, dict(s.intents), s.last_ts, s.session_start_ts, s.sessions,
            s.session_events, s.events, s.impressions, s.clicks, s.late, s.version, s.recent_ids,
            s.recent_clicks, s.bias,
        )  # fmt: skip

    def freeze(self, vector: np.ndarray) -> UserState:
        return UserState(  # positional: the hot path of the worker (dataclasses.replace is slower)
            self.user_id, self.dim, vector, self.intents, self.last_ts, self.session_start_ts,
            self.sessions, self.session_events, self.events, self.impressions, self.clicks,
            self.late, self.version, self.recent_ids, self.recent_clicks, self.bias,
        )  # fmt: skip


def _scale(scores: dict[str, float], factor: float) -> None:
    for c, v in scores.items():  # values replaced, keys and their order kept
        scores[c] = v * factor


def _fold_intents(
    w: Folding, ad: AdInfo, evidence: tuple[float, float, float], params: StateSettings
) -> float:
    """Intents after one event's `_evidence` on `ad`, the old state forgotten first when
    `evidence_forget` says so; returns that forgetting factor (the vector's, too)."""
    vec_w, inc, mult = evidence
    cat = ad.category
    forget = evidence_forget(w.intents, cat, vec_w, params)
    if forget != 1.0:
        _scale(w.intents, forget)
    if inc or mult != 1.0:
        w.intents[cat] = w.intents.get(cat, 0.0) * mult + inc
    if len(w.intents) > params.max_intents:
        keep = sorted(w.intents.items(), key=lambda kv: (-kv[1], kv[0]))[: params.max_intents]
        w.intents = dict(keep)
    return forget


def fold_event(
    w: Folding, event: Message, ad: AdInfo | None, params: StateSettings, ts: float
) -> tuple[float, float, float] | None:
    """Fold one user event into `w`'s scalars; return the vector's steps, (decay, forget,
    weight): the vector becomes `v·f32(decay)` (when ≠ 1: the features an impression is served
    with), then `·f32(forget)` (when ≠ 1) and `+ f32(weight)·ad.vector` (when ≠ 0), in float32;
    None for a duplicate (nothing changes). The one definition of a state step (`apply_event`).

    It runs once per event of the worker: the clock's decay (`decay_factor`, `bias_factor`:
    the same `decay(1.0, Δt, τ)`) is computed once for both, with their very operations."""
    h = _from_bytes(_blake2b(event.event_id.encode(), digest_size=4).digest(), "little")  # id_hash
    if h in w.recent_ids:
        return None
    clicked = isinstance(event, Click)
    vec_w, inc, mult = _evidence(event, w, params)
    events, last_ts = w.events, w.last_ts
    late = ts < last_ts and events > 0
    step = feedback_step(event, params)
    f = 1.0
    if late:
        age = decay(1.0, last_ts - ts, params.half_life_s)
        vec_w *= age
        inc *= age
        step *= age
    else:
        gap = ts - last_ts
        if events and ts > last_ts:  # `bias_factor`, then `decay_factor` (the session discount)
            fb = f = math.pow(0.5, gap / params.half_life_s)  # `decay(1.0, …)`: 1.0 · x is x
            if w.bias and fb != 1.0:
                w.bias = {c: b * fb for c, b in w.bias.items()}
            if gap > params.session_gap_s:
                f *= params.alpha_session
        if not events or gap > params.session_gap_s:
            w.sessions += 1
            w.session_events = 0
            w.session_start_ts = ts
        if f != 1.0:
            _scale(w.intents, f)
        w.last_ts = ts
    forget = 1.0
    if ad is not None:
        forget = _fold_intents(w, ad, (vec_w, inc, mult), params)
        if step:
            w.bias = _fold_bias(w.bias, ad.category, step, clicked, params)
    else:
        vec_w = 0.0
    if clicked:
        w.recent_clicks = (*w.recent_clicks, id_hash(event.impression_id))[-RECENT_CLICKS:]  # type: ignore[attr-defined]
        w.clicks += 1
    elif isinstance(event, Impression):
        w.impressions += 1
    w.session_events += 1
    w.events = events + 1
    w.late += late
    w.version += 1
    w.recent_ids = (*w.recent_ids[1 - RECENT_IDS :], h)  # `(*ids, h)[-RECENT_IDS:]`, one tuple made
    return f, forget, vec_w


def apply_event(
    state: UserState, event: Message, ad: AdInfo | None, params: StateSettings, ts: float | None = None
) -> UserState:
    """The state after one user event (`ad` from the catalog; None when unknown there).

    Returns `state` itself (the same object) for a duplicate or a non-user event, so callers can
    tell "nothing changed" by identity. `ts` is `event.ts.timestamp()` when the caller has it.
    """
    if not isinstance(event, USER_EVENTS) or id_hash(event.event_id) in state.recent_ids:
        return state
    w = Folding.of(state)
    steps = fold_event(w, event, ad, params, event.ts.timestamp() if ts is None else ts)
    assert steps is not None  # not a duplicate: checked above
    f, forget, vec_w = steps
    vector = state.vector
    if f != 1.0:
        vector = vector * np.float32(f)  # float32 × float32 scalar stays float32
    if forget != 1.0:
        vector = vector * np.float32(forget)
    if vec_w:
        assert ad is not None
        vector = vector + np.float32(vec_w) * ad.vector
    return w.freeze(vector)


def same_state(a: UserState, b: UserState, rtol: float = 1e-6, atol: float = 1e-9) -> bool:
    """Whether two states agree: counters and rings exactly, vector and scores within tolerance."""
    exact = (
        a.user_id, a.dim, a.sessions, a.session_events, a.events, a.impressions, a.clicks,
        a.late, a.version, a.recent_ids, a.recent_clicks,
    )  # fmt: skip
    other = (
        b.user_id, b.dim, b.sessions, b.session_events, b.events, b.impressions, b.clicks,
        b.late, b.version, b.recent_ids, b.recent_clicks,
    )  # fmt: skip
    if exact != other or set(a.intents) != set(b.intents) or set(a.bias) != set(b.bias):
        return False
    if not all(math.isclose(a.bias[c], b.bias[c], rel_tol=rtol, abs_tol=atol) for c in a.bias):
        return False
    if not math.isclose(a.last_ts, b.last_ts, rel_tol=0, abs_tol=1e-6):
        return False
    if not all(math.isclose(a.intents[c], b.intents[c], rel_tol=rtol, abs_tol=atol) for c in a.intents):
        return False
    return bool(np.allclose(a.vector, b.vector, rtol=rtol, atol=atol))
