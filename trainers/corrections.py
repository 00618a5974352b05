"""The per-user correction each training example was served with: the adapters' offset.

Serving adds the streams worker's per-(user, category) logit bias to the adapted logit
(`serving.pipeline`, `schemas.user_record.bias_at`); the trainer takes each example's loss with that
bias as a fixed offset (`trainers.online`, `learn(corrections=…)`), so the adapter learns the
residual of what is served instead of what the correction already serves.

The bias is read from the user's Redis record (one MGET per micro-batch for the users not seen
yet), decayed to the impression's time as serving decays it. The worker has folded the impression
itself into that record (its −lr·pctr step, small), and in the fake-negative modes the click's
positive duplicate arrives after the click was folded too (+lr): so an impression's correction is
read once, when its first row arrives, and its later rows (the click) reuse it; `remember`
impressions are kept (the oldest forgotten first).

>>> from schemas.settings import StateSettings
>>> offsets = CorrectionReader(None, "p:", StateSettings(), remember=4)
>>> offsets.remembered({"i1": 0.5, "i2": -0.25}), offsets.known("i1"), offsets.known("i3")
(2, 0.5, None)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from schemas.events import TrainingExample
from schemas.settings import StateSettings
from schemas.user_record import bias_at, decode_state, user_key


class CorrectionReader:
    """Each example's served per-user correction, from Redis (see the module docstring)."""

    def __init__(self, redis: Any, prefix: str, params: StateSettings, remember: int) -> None:
        self.redis = redis
        self.prefix = prefix
        self.params = params
        self.remember = max(1, remember)
        self._memo: dict[str, float] = {}  # impression id → its correction, oldest first

    def known(self, impression_id: str) -> float | None:
        """The correction an impression's first row was read with (None: not seen)."""
        return self._memo.get(impression_id)

    def remembered(self, values: dict[str, float]) -> int:
        """Keep `values` (impression id → correction); returns how many are kept in all."""
        self._memo.update(values)
        while len(self._memo) > self.remember:
            del self._memo[next(iter(self._memo))]
        return len(self._memo)

    async def read(self, examples: Sequence[TrainingExample]) -> np.ndarray:
        """The correction of every example (0.0 for a user without a record or a bias there)."""
        out = np.zeros(len(examples), dtype=np.float32)
        todo: dict[int, str] = {}  # position → user id, where the impression is new
        for i, ex in enumerate(examples):
            seen = self._memo.get(ex.impression_id)
            if seen is None:
                todo[i] = ex.user_id
            else:
                out[i] = seen
        if not todo:
            return out
        users = list(dict.fromkeys(todo.values()))
        raw = await self.redis.mget([user_key(self.prefix, u) for u in users])
        states = {u: decode_state(u, data) for u, data in zip(users, raw, strict=True) if data is not None}
        new: dict[str, float] = {}
        for i, user in todo.items():
            ex = examples[i]
            state = states.get(user)
            if state is not None and state.bias:
                value = bias_at(state, ex.impression_ts.timestamp(), self.params).get(ex.category, 0.0)
                out[i] = value
            new.setdefault(ex.impression_id, float(out[i]))
        self.remembered(new)
        return out
