"""Offline (batch) training of the ranker from TrainingExamples, with a time-ordered holdout.

`time_split(examples, holdout)` sorts by impression time and cuts the last fraction off;
`train_ranker(train, config, spec)` fits a fresh `Ranker` (Adam, mini-batches, early stopping
on the last slice of the training data); `evaluate(model, examples)` gives AUC and log loss.

>>> from trainers.models.ranker import RankerConfig
>>> spec = TrainSpec(epochs=1, seed=0)
>>> spec.batch_size
512
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from schemas.errors import ConfigError
from schemas.events import TrainingExample
from trainers.models.features import RankerBatch, featurize
from trainers.models.ranker import Ranker, RankerConfig
from trainers.quality import auc, logloss

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSpec:
    """Optimiser settings of offline training; validated on construction."""

    epochs: int = 8
    batch_size: int = 512
    lr: float = 3e-3
    weight_decay: float = 1e-4
    val_fraction: float = 0.1
    holdout: float = 0.2  # the newest share of examples, kept out of training for the report
    patience: int = 2
    seed: int = 0
    device: str = "cpu"  # where the model trains ("cuda" on a GPU); the result is on the CPU

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ConfigError(f"TrainSpec.epochs must be >= 1 (got {self.epochs!r})")
        if self.batch_size < 1:
            raise ConfigError(f"TrainSpec.batch_size must be >= 1 (got {self.batch_size!r})")
        if not self.lr > 0:
            raise ConfigError(f"TrainSpec.lr must be > 0 (got {self.lr!r})")
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"TrainSpec.val_fraction must be in [0, 1) (got {self.val_fraction!r})")
        if not 0 < self.holdout < 1:
            raise ConfigError(f"TrainSpec.holdout must be in (0, 1) (got {self.holdout!r})")


@dataclass(frozen=True)
class EvalResult:
    """Quality of a model on a set of examples."""

    auc: float
    logloss: float
    n: int
    positives: int


def time_split(
    examples: Sequence[TrainingExample], holdout: float
) -> tuple[list[TrainingExample], list[TrainingExample]]:
    """(train, holdout): sorted by impression time, the last `holdout` fraction held out."""
    if not 0 < holdout < 1:
        raise ConfigError(f"holdout must be in (0, 1) (got {holdout!r})")
    ordered = sorted(examples, key=lambda e: (e.impression_ts, e.impression_id))
    cut = int(len(ordered) * (1 - holdout))
    return ordered[:cut], ordered[cut:]


def predict(model: Ranker, batch: RankerBatch, chunk: int = 8192) -> torch.Tensor:
    """Click probabilities of a (possibly large) batch, chunked to bound memory."""
    model.eval()
    device = next(model.parameters()).device
    out = [
        model.score(batch.select(torch.arange(i, min(i + chunk, len(batch)))).to(device)).cpu()
        for i in range(0, len(batch), chunk)
    ]
    return torch.cat(out) if out else torch.empty(0)


def evaluate(model: Ranker, examples: Sequence[TrainingExample] | RankerBatch) -> EvalResult:
    """AUC and log loss of `model` on labelled examples."""
    batch = examples if isinstance(examples, RankerBatch) else featurize(examples, model.config)
    if batch.label is None:
        raise ConfigError("evaluate needs labelled examples (every input needs `click`)")
    probs = predict(model, batch).numpy()
    labels = batch.label.numpy()
    return EvalResult(auc(probs, labels), logloss(probs, labels), len(labels), int(labels.sum()))


def _epoch(
    model: Ranker, opt: torch.optim.Optimizer, batch: RankerBatch, size: int, gen: torch.Generator
) -> float:
    model.train()
    assert batch.label is not None
    order = torch.randperm(len(batch), generator=gen).to(batch.dense.device)
    total = 0.0
    for i in range(0, len(batch), size):
        part = batch.select(order[i : i + size])
        assert part.label is not None
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(part.dense, part.ids), part.label)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        total += float(loss.detach()) * len(part)
    return total / max(len(batch), 1)


def train_ranker(
    train: Sequence[TrainingExample] | RankerBatch, config: RankerConfig, spec: TrainSpec | None = None
) -> Ranker:
    """A ranker fitted on `train` (time-ordered; its last `val_fraction` is for early stopping)."""
    spec = spec or TrainSpec()
    batch = train if isinstance(train, RankerBatch) else featurize(train, config)
    if batch.label is None or len(batch) == 0:
        raise ConfigError("train_ranker needs labelled examples")
    torch.manual_seed(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed)
    model = Ranker(config)
    n_val = int(len(batch) * spec.val_fraction)
    fit = batch.select(torch.arange(0, len(batch) - n_val))
    val = batch.select(torch.arange(len(batch) - n_val, len(batch))) if n_val else None
    model.to(spec.device)
    fit = fit.to(spec.device)
    with torch.no_grad():  # start from the base rate: the first epochs learn ranking, not the mean
        rate = float(fit.label.mean().clamp(1e-4, 1 - 1e-4).cpu()) if fit.label is not None else 0.5
        model.head.bias.fill_(math.log(rate / (1 - rate)))
    opt = torch.optim.Adam(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    best, best_loss, stale = copy.deepcopy(model.state_dict()), math.inf, 0
    for epoch in range(spec.epochs):
        train_loss = _epoch(model, opt, fit, spec.batch_size, gen)
        if val is None:
            log.info("epoch %d train logloss %.4f", epoch, train_loss)
            continue
        result = evaluate(model, val)
        log.info(
            "epoch %d train logloss %.4f val auc %.4f logloss %.4f",
            epoch,
            train_loss,
            result.auc,
            result.logloss,
        )
        if result.logloss < best_loss - 1e-5:
            best, best_loss, stale = copy.deepcopy(model.state_dict()), result.logloss, 0
        else:
            stale += 1
            if stale >= spec.patience:
                break
    if val is not None:
        model.load_state_dict(best)
    model.cpu()
    model.eval()
    return model
