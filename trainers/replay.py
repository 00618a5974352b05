"""Replay mode: the online trainer's code path over a finished list of TrainingExamples.

`replay(examples, trainer, micro_batch)` cuts the time-ordered examples into micro-batches
exactly like the live loop (`OnlineTrainer.learn`, progressive validation included) and
`progressive_report(trainer)` summarises what was scored before being learned: AUC and log
loss of the online adapters and of the frozen base, overall and per adapter, plus counters.

Order matters: the label join emits a clicked impression's example at the click but a negative
only when its attribution window closes, so in emission order the label leaks into the position
(a short log ends with a flush of negatives: an online model that tracks the running click rate
then "predicts" labels and beats the oracle). `impression_order` sorts by impression time, the
order in which progressive validation is meaningful; replays use it by default.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from schemas.events import AdapterDelta, TrainingExample
from trainers.online import OnlineTrainer
from trainers.quality import auc, logloss


def impression_order(examples: Iterable[TrainingExample]) -> list[TrainingExample]:
    """Examples sorted by (impression time, impression id): a leak-free progressive order."""
    return sorted(examples, key=lambda e: (e.impression_ts, e.impression_id))


def replay(
    examples: Iterable[TrainingExample],
    trainer: OnlineTrainer,
    micro_batch: int,
    on_deltas: Callable[[list[AdapterDelta]], None] | None = None,
    before_learn: Callable[[list[TrainingExample]], None] | None = None,
) -> int:
    """Feed `examples` (in order) to `trainer` in micro-batches; returns how many were learned.

    `on_deltas` gets each micro-batch's deltas (to publish, or to apply to a replica);
    `before_learn` sees each micro-batch before the trainer does, e.g. to score it with what
    replicas hold at that moment (the published state, progressive like the trainer's own)."""
    if micro_batch < 1:
        raise ValueError(f"online.micro_batch must be >= 1, got {micro_batch}")
    n = 0
    chunk: list[TrainingExample] = []
    for ex in examples:
        chunk.append(ex)
        if len(chunk) >= micro_batch:
            n += _feed(trainer, chunk, on_deltas, before_learn)
            chunk = []
    if chunk:
        n += _feed(trainer, chunk, on_deltas, before_learn)
    rest = trainer.flush() + trainer.take_pending()
    if on_deltas is not None and rest:
        on_deltas(rest)
    return n


def _feed(
    trainer: OnlineTrainer,
    chunk: list[TrainingExample],
    on_deltas: Callable[[list[AdapterDelta]], None] | None,
    before_learn: Callable[[list[TrainingExample]], None] | None = None,
) -> int:
    if before_learn is not None:
        before_learn(chunk)
    deltas = trainer.learn(chunk) + trainer.take_pending()
    if on_deltas is not None and deltas:
        on_deltas(deltas)
    return len(chunk)


def _quality(online: np.ndarray, base: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    def clean(x: float) -> float | None:
        return None if math.isnan(x) else round(x, 6)

    return {
        "n": len(labels),
        "positives": int(labels.sum()),
        "auc_online": clean(auc(online, labels)),
        "auc_base": clean(auc(base, labels)),
        "logloss_online": clean(logloss(online, labels)),
        "logloss_base": clean(logloss(base, labels)),
    }


def progressive_report(trainer: OnlineTrainer) -> dict[str, Any]:
    """Progressive AUC/log loss (online vs frozen base), overall and per adapter, and counters."""
    if trainer.log is None:
        raise ValueError("progressive_report needs an OnlineTrainer(keep_log=True)")
    lg = trainer.log
    online, base = np.asarray(lg.online), np.asarray(lg.base)
    labels, adapters = np.asarray(lg.labels), np.asarray(lg.adapters)
    per = {}
    for aid in sorted(set(lg.adapters)):
        mask = adapters == aid
        run = trainer.runs[aid]
        per[aid] = _quality(online[mask], base[mask], labels[mask]) | {
            "last_seq": run.seq,
            **{k: v for k, v in sorted(run.counts.items())},
        }
    return {
        "overall": _quality(online, base, labels),
        "adapters": per,
        "counts": dict(sorted(trainer.counts.items())),
    }
