"""The Redis user record: the contract between the streams worker (its writer) and serving
(its reader). The compact record of one user's state (binary float32 vector, intents, `last_ts`, version).

One key per user, ``{redis_prefix}user:{user_id}``, written by the streams worker with a TTL of
`state.ttl_s` and read by serving with `read_user_state`. Layout (little endian):

    header  magic "US", format 1, dim u16, n_intents u8, n_ids u8, n_clicks u8,
            last_ts f64, session_start_ts f64, sessions u32, session_events u32, events u32,
            impressions u32, clicks u32, late u32, version u64
    vector  dim × f32
    ids     n_ids × u32 (recent event-id hashes), n_clicks × u32 (clicked impression hashes)
    intents n_intents × (len u8, UTF-8 category, score f64), highest score first
    bias    (format 2 only) n_bias u8, n_bias × (len u8, UTF-8 category, bias f64)

Intents are stored highest first, so "top k intents" is a prefix of the record. Format 2 adds
the per-user correction (`UserState.bias`, `state.feedback_lr`); a state without one is still
written as format 1, so replicas of the previous release keep reading every user whose record
has no bias (upgrade serving first: an older replica takes a format-2 user as cold). Both
formats are read.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Final, Protocol

import numpy as np

from schemas.errors import StoreError
from schemas.settings import StateSettings

MAGIC: Final = b"US"
FORMAT: Final = 2
FORMATS: Final = frozenset({1, 2})  # what decode_state reads
_HEADER = struct.Struct("<2sBHBBBddIIIIIIQ")
_SCORE = struct.Struct("<d")


@dataclass(frozen=True, slots=True, eq=False)
class UserState:
    """One user's state as of `last_ts` (epoch seconds); scores and vector are decayed to it."""

    user_id: str
    dim: int
    vector: np.ndarray  # float32, never mutated in place
    intents: Mapping[str, float] = field(default_factory=dict)
    last_ts: float = 0.0
    session_start_ts: float = 0.0
    sessions: int = 0
    session_events: int = 0
    events: int = 0
    impressions: int = 0
    clicks: int = 0
    late: int = 0
    version: int = 0
    recent_ids: tuple[int, ...] = ()
    recent_clicks: tuple[int, ...] = ()
    bias: Mapping[str, float] = field(default_factory=dict)  # per-category logit bias as of last_ts

    @classmethod
    def empty(cls, user_id: str, dim: int) -> UserState:
        return cls(user_id=user_id, dim=dim, vector=np.zeros(dim, dtype=np.float32))

    def top_intents(self, k: int) -> list[tuple[str, float]]:
        """The k highest intent scores as of `last_ts`, highest first (ties by name)."""
        items = sorted(self.intents.items(), key=itemgetter(0))
        items.sort(key=itemgetter(1), reverse=True)  # stable: ties stay in name order
        return items[:k]


def decay(score: float, dt_s: float, half_life_s: float) -> float:
    """`score` after `dt_s` seconds of exponential decay with half-life `half_life_s`.

    >>> decay(8.0, 7200.0, 3600.0)
    2.0
    """
    if dt_s < 0:
        raise ValueError(f"dt_s must be >= 0, got {dt_s}")
    if half_life_s <= 0:
        raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
    return score * math.pow(0.5, dt_s / half_life_s)


def decay_factor(state: Timed, now_ts: float, params: StateSettings) -> float:
    """The factor every score of `state` is multiplied by when read (or updated) at `now_ts`."""
    if state.events == 0 or now_ts <= state.last_ts:
        return 1.0
    dt = now_ts - state.last_ts
    factor = decay(1.0, dt, params.half_life_s)
    if dt > params.session_gap_s:
        factor *= params.alpha_session
    return factor


def intent_scores(state: UserState, now_ts: float, params: StateSettings) -> dict[str, float]:
    """Lazy read: every intent score decayed from `last_ts` to `now_ts` (O(categories))."""
    f = decay_factor(state, now_ts, params)
    return {c: s * f for c, s in state.intents.items()}


def intent_score(state: UserState, category: str, now_ts: float, params: StateSettings) -> float:
    """Lazy read of one category's intent score at `now_ts`."""
    s = state.intents.get(category, 0.0)
    return s * decay_factor(state, now_ts, params) if s else 0.0


def vector_at(state: UserState, now_ts: float, params: StateSettings) -> np.ndarray:
    """The state vector decayed to `now_ts` (float32)."""
    f = decay_factor(state, now_ts, params)
    return state.vector if f == 1.0 else (state.vector * np.float32(f)).astype(np.float32)


def bias_factor(state: Timed, now_ts: float, params: StateSettings) -> float:
    """The factor the per-user bias of `state` is multiplied by when read at `now_ts`: the clock
    half-life only (no session discount)."""
    if state.events == 0 or now_ts <= state.last_ts:
        return 1.0
    return decay(1.0, now_ts - state.last_ts, params.half_life_s)


def bias_at(state: UserState, now_ts: float, params: StateSettings) -> dict[str, float]:
    """Lazy read: the per-(user, category) logit biases decayed to `now_ts`, within
    ±`feedback_max` (the worker keeps them there; a state read from Redis is clamped again,
    whoever wrote the record)."""
    f = bias_factor(state, now_ts, params)
    lim = params.feedback_max
    return {c: min(lim, max(-lim, b * f)) for c, b in state.bias.items()}


class Timed(Protocol):
    """What the decay factors read of a state: `UserState`, or a `Folding` one."""

    @property
    def events(self) -> int: ...
    @property
    def last_ts(self) -> float: ...


def user_key(prefix: str, user_id: str) -> str:
    """The Redis key of a user's state record."""
    return f"{prefix}user:{user_id}"


def encode_state(state: UserState) -> bytes:
    """The binary record of `state` (see the module docstring for the layout)."""
    intents = state.top_intents(255)
    bias = sorted(state.bias.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:255]
    parts = [
        _HEADER.pack(
            MAGIC,
            FORMAT if bias else 1,
            state.dim,
            len(intents),
            len(state.recent_ids),
            len(state.recent_clicks),
            state.last_ts,
            state.session_start_ts,
            state.sessions,
            state.session_events,
            state.events,
            state.impressions,
            state.clicks,
            state.late,
            state.version,
        ),
        np.asarray(state.vector, dtype="<f4").tobytes(),
        struct.pack(f"<{len(state.recent_ids)}I", *state.recent_ids),
        struct.pack(f"<{len(state.recent_clicks)}I", *state.recent_clicks),
    ]
    for cat, score in intents:
        name = cat.encode()[:255]
        parts.append(bytes((len(name),)) + name + _SCORE.pack(score))
    if bias:
        parts.append(bytes((len(bias),)))
        for cat, b in bias:
            name = cat.encode()[:255]
            parts.append(bytes((len(name),)) + name + _SCORE.pack(b))
    return b"".join(parts)


def decode_state(user_id: str, data: bytes) -> UserState:
    """Parse a record written by `encode_state`; StoreError when it is not one."""
    try:
        (magic, fmt, dim, n_int, n_ids, n_clk, last_ts, start, sessions, sess_ev, events, imps,
         clicks, late, version) = _HEADER.unpack_from(data, 0)  # fmt: skip
        if magic != MAGIC or fmt not in FORMATS:
            raise StoreError(f"user record of {user_id!r}: bad magic/format {magic!r}/{fmt}")
        off = _HEADER.size
        vector = np.frombuffer(data, dtype="<f4", count=dim, offset=off).astype(np.float32)
        off += 4 * dim
        ids = tuple(int(x) for x in np.frombuffer(data, dtype="<u4", count=n_ids, offset=off))
        off += 4 * n_ids
        clk = tuple(int(x) for x in np.frombuffer(data, dtype="<u4", count=n_clk, offset=off))
        off += 4 * n_clk
        intents, off = _scores(data, off, n_int)
        bias: dict[str, float] = {}
        if fmt >= 2:
            bias, off = _scores(data, off + 1, data[off])
            if not all(math.isfinite(b) for b in bias.values()):
                raise ValueError("non-finite bias")
    except (struct.error, ValueError, IndexError) as exc:
        raise StoreError(f"user record of {user_id!r} is truncated or corrupt: {exc}") from exc
    return UserState(
        user_id=user_id,
        dim=dim,
        vector=vector,
        intents=intents,
        last_ts=last_ts,
        session_start_ts=start,
        sessions=sessions,
        session_events=sess_ev,
        events=events,
        impressions=imps,
        clicks=clicks,
        late=late,
        version=version,
        recent_ids=ids,
        recent_clicks=clk,
        bias=bias,
    )


def _scores(data: bytes, off: int, n: int) -> tuple[dict[str, float], int]:
    """n (len u8, UTF-8 category, f64) entries from `off`, and the offset after them."""
    out: dict[str, float] = {}
    for _ in range(n):
        size = data[off]
        cat = data[off + 1 : off + 1 + size].decode()
        (value,) = _SCORE.unpack_from(data, off + 1 + size)
        out[cat] = value
        off += 1 + size + _SCORE.size
    return out, off


def read_user_state(redis: Any, prefix: str, user_id: str) -> UserState | None:
    """Serving's read: the user's state from Redis (sync client), or None for an unknown user."""
    data = redis.get(user_key(prefix, user_id))
    return None if data is None else decode_state(user_id, data)


async def aread_user_state(redis: Any, prefix: str, user_id: str) -> UserState | None:
    """`read_user_state` for a `redis.asyncio` client."""
    data = await redis.get(user_key(prefix, user_id))
    return None if data is None else decode_state(user_id, data)


def served_view(
    state: UserState, now_ts: float, params: StateSettings, k: int = 8
) -> tuple[np.ndarray, list[tuple[str, float]]]:
    """What serving uses: the vector and the top-k intents, lazily decayed to `now_ts` (the
    per-user correction is read by `bias_at`)."""
    scores = intent_scores(state, now_ts, params)
    top = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
    return vector_at(state, now_ts, params), top
