"""The compact Redis record of one user's state (binary float32 vector, intents, `last_ts`, version).

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
from typing import Any, Final

import numpy as np

from schemas.errors import StoreError
from schemas.settings import StateSettings
from streams.state import UserState, intent_scores, vector_at

MAGIC: Final = b"US"
FORMAT: Final = 2
FORMATS: Final = frozenset({1, 2})  # what decode_state reads
_HEADER = struct.Struct("<2sBHBBBddIIIIIIQ")
_SCORE = struct.Struct("<d")


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
    per-user correction is read by `streams.state.bias_at`)."""
    scores = intent_scores(state, now_ts, params)
    top = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
    return vector_at(state, now_ts, params), top
