"""Offline training and scoring of a ranker with the sequence user tower (`user_tower="gru"`).

The same recipe as `trainers.offline.train_ranker` (Adam, shuffled mini-batches of rows, the
head's bias started at the base rate, early stopping on the log loss of the last `val_fraction`
of the time-ordered training rows) with each mini-batch's `UserSequences` selected beside it,
so a comparison with the decayed-state ranker differs only in the model — and in one detail of
the shuffling: the rows of a request (one served list) fall into the same mini-batch, so the GRU
runs once per request in training as in serving (~3× fewer sequences per batch of rows).
"""

from __future__ import annotations

import copy
import logging
import math

import torch
from torch.nn import functional as F

from schemas.errors import ConfigError
from trainers.models.features import RankerBatch
from trainers.models.ranker import Ranker, RankerConfig
from trainers.models.user_tower import UserSequences
from trainers.offline import TrainSpec
from trainers.quality import logloss

log = logging.getLogger(__name__)


def predict_with_sequences(
    model: Ranker, batch: RankerBatch, seq: UserSequences, chunk: int = 8192
) -> torch.Tensor:
    """Click probabilities of a (possibly large) batch with its sequences, chunked."""
    if len(seq) != len(batch):
        raise ConfigError(f"sequences have {len(seq)} rows for a batch of {len(batch)}")
    model.eval()
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(batch), chunk):
        index = torch.arange(i, min(i + chunk, len(batch)))
        out.append(model.score(batch.select(index).to(device), seq.select(index).to(device)).cpu())
    return torch.cat(out) if out else torch.empty(0)


@torch.no_grad()
def mean_gate(model: Ranker, batch: RankerBatch, seq: UserSequences, chunk: int = 8192) -> list[float]:
    """The tower's gate weights (decayed, sequence, context) averaged over the batch's requests."""
    model.eval()
    total, n = torch.zeros(3), 0
    for i in range(0, len(batch), chunk):
        index = torch.arange(i, min(i + chunk, len(batch)))
        part, part_seq = batch.select(index), seq.select(index)
        _, weights = model.user_vector(part.dense, part.ids, part_seq)
        total += weights.sum(0)
        n += weights.shape[0]
    return (total / max(n, 1)).tolist()


def _epoch(
    model: Ranker,
    opt: torch.optim.Optimizer,
    batch: RankerBatch,
    seq: UserSequences,
    size: int,
    gen: torch.Generator,
) -> float:
    model.train()
    # rows grouped by request (requests in random order): a mini-batch of `size` rows then runs
    # the GRU over ~size/3 sequences instead of ~size, the per-request cost serving pays too
    shuffled = torch.randperm(len(batch), generator=gen)
    rank = torch.randperm(seq.requests, generator=gen)[seq.row[shuffled]]
    order = shuffled[torch.argsort(rank, stable=True)]
    total = 0.0
    for i in range(0, len(batch), size):
        index = order[i : i + size]
        part, part_seq = batch.select(index), seq.select(index)
        assert part.label is not None
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(part.dense, part.ids, part_seq), part.label)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        total += float(loss.detach()) * len(part)
    return total / max(len(batch), 1)


def train_tower_ranker(
    train: RankerBatch, seq: UserSequences, config: RankerConfig, spec: TrainSpec | None = None
) -> Ranker:
    """A ranker with the user tower fitted on `train` (time-ordered) and its sequences."""
    spec = spec or TrainSpec()
    if config.user_tower == "none":
        raise ConfigError("train_tower_ranker needs RankerConfig.user_tower != 'none'")
    if train.label is None or len(train) == 0:
        raise ConfigError("train_tower_ranker needs labelled examples")
    if len(seq) != len(train):
        raise ConfigError(f"sequences have {len(seq)} rows for a batch of {len(train)}")
    if spec.device != "cpu":
        raise ConfigError(f"train_tower_ranker trains on the CPU (TrainSpec.device={spec.device!r})")
    torch.manual_seed(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed)
    model = Ranker(config)
    n_val = int(len(train) * spec.val_fraction)
    fit_index = torch.arange(0, len(train) - n_val)
    fit, fit_seq = train.select(fit_index), seq.select(fit_index)
    val_index = torch.arange(len(train) - n_val, len(train))
    val, val_seq = (train.select(val_index), seq.select(val_index)) if n_val else (None, None)
    with torch.no_grad():
        assert fit.label is not None
        rate = float(fit.label.mean().clamp(1e-4, 1 - 1e-4))
        model.head.bias.fill_(math.log(rate / (1 - rate)))
    opt = torch.optim.Adam(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    best, best_loss, stale = copy.deepcopy(model.state_dict()), math.inf, 0
    for epoch in range(spec.epochs):
        train_loss = _epoch(model, opt, fit, fit_seq, spec.batch_size, gen)
        if val is None or val_seq is None:
            log.info("epoch %d train logloss %.4f", epoch, train_loss)
            continue
        assert val.label is not None
        val_loss = logloss(predict_with_sequences(model, val, val_seq).numpy(), val.label.numpy())
        log.info("epoch %d train logloss %.4f val logloss %.4f", epoch, train_loss, val_loss)
        if val_loss < best_loss - 1e-5:
            best, best_loss, stale = copy.deepcopy(model.state_dict()), val_loss, 0
        else:
            stale += 1
            if stale >= spec.patience:
                break
    if val is not None:
        model.load_state_dict(best)
    model.eval()
    return model
