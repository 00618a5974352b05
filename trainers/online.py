"""The online LoRA trainer's core: progressive validation, sparse ΔW, guardrails (no Kafka here).

`OnlineTrainer.learn(examples)` takes one micro-batch of TrainingExamples (any adapters mixed),
groups it by `adapter_id` (PEFT trains one adapter per forward) and for each group:

1. **scores before learning** (progressive validation): the adapter's pre-step logits (the
   training forward itself) and the frozen base's; both feed rolling AUC/log loss windows;
2. takes one optimiser step on that adapter's LoRA tensors only (base frozen): Adam (`lr`) on
   the Linear targets, plain SGD (`embedding_lr`) on embedding targets (`emb.*`/`wide.*` id
   tables, when `lora.targets` name them; see `AdapterOptimizer` for why);
   (groups smaller than `min_step_examples` wait for the next micro-batch, but not past their
   deadline, `trainers.service`; a step on n < `min_step_examples` examples is taken at
   n / `min_step_examples` of the learning rates, so an adapter moves by its evidence, not by how
   often the deadline cuts its examples into steps: see `AdapterOptimizer.step`);
3. drops the step (restoring the adapter) if the loss, gradients or new weights are not finite
   or the step changed the adapter by more than `max_norm` — counted in `dropped`;
4. **sparsifies**: the magnitude of rank direction i of module m is
   `sqrt(|∇A[i,:]|² + |∇B[:,i]|²)`, summed over the steps since that direction was last
   published (error feedback, as in Deep Gradient Compression: a direction whose gradient is
   steady but never the largest of a step still reaches replicas once its sum is large; without
   it, replicas recovered 71–76 % of a drift the trainer recovered 68–92 % of, see
   `benchmarks/online_drift.py`); the directions at or above the `delta_percentile`-th
   percentile of that module's sliding window (its last `delta_window_steps` steps'
   magnitudes; per module because gradient scales differ by module — with one pooled
   percentile an id-table target took ~all published directions and the cross/deep layers'
   learning never reached replicas) are published as an `AdapterDelta` (`schemas.delta`
   format) with the next `seq` — when none passes, the single strongest direction is, so every
   step's examples (its `learned_offsets`) reach replicas in that step's delta; the trainer
   keeps the `published` state replicas hold, so deltas chain exactly. A delta that would
   exceed `max_norm` against the published state (accumulated unpublished change) is sent as a
   full snapshot instead;
5. **guards quality**: if the adapter's rolling AUC stays significantly below the base's (paired
   DeLong test on the same examples, `guard_z`) by more than
   `reset_margin` for `reset_patience` micro-batches and `reset_patience_examples` examples in
   a row, the adapter is reset to the base (its initial LoRA weights) and a snapshot of the
   reset state is published.

The per-user correction as an offset (`learn(corrections=…)`): serving adds the streams worker's
per-(user, category) logit bias to the adapted logit, and that correction learns from the served
score, adapters included. An adapter trained on base + adapter alone learns what the correction
already serves (the mean calibration, a category's shift), and the correction then cancels it
(measured in the live loop: ρ(adapter shift, correction) −0.54 where both are served, +0.33 where
the correction is served alone). With `corrections` each example's loss is taken on base +
adapter + its correction (a fixed offset, no gradient): the adapter learns the residual of what is
served. Progressive validation and the guard still score base + adapter against the base.

Delayed feedback (`settings.online.label_mode`, see `streams.join`): examples with final labels are
learned with log loss. In the fake-negative modes every impression arrives at once as a negative
(`label_kind="fake_negative"`) and its click later as a positive duplicate (`"click"`), so the
stream's click rate is b = p / (1 + p) for a true p (Ktena et al., RecSys 2019). `fn_loss`:
- "weighted" (FN weighting): importance weights p̂ / b on positives and (1 − p̂)(1 + p̂) on
  negatives, p̂ = the model's own prediction without gradient (the paper's eq. 7);
- "calibrated" (FN calibration with the calibration inside the loss): the likelihood of the
  observed stream under b = p / (1 + p), −y·log p + log(1 + p), whose minimiser is the true p,
  so the model's output needs no b/(1 − b) transform when served.
`"dwell"` label updates are not click labels: counted, not learned.

`snapshot(adapter_id)` makes a full snapshot (next seq; the published state becomes the full
state); `restore(snapshot, last_seq)` resumes an adapter after a restart without reusing seqs.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from itertools import compress
from operator import attrgetter
from types import EllipsisType

import numpy as np
import torch
from torch.nn import functional as F

from schemas.delta import (
    AdapterState,
    apply_delta,
    change_norm,
    empty_state,
    full_parts,
    make_delta,
    merge_parts,
    resolve_signing_key,
    select_parts,
)
from schemas.errors import ConfigError
from schemas.events import AdapterDelta, TrainingExample
from schemas.settings import OnlineSettings, Settings
from schemas.stats import paired_auc_difference
from trainers.models.features import RankerBatch, featurize
from trainers.models.lora import AdapterBank
from trainers.quality import RollingMetrics, key_ids

log = logging.getLogger(__name__)


class AdapterOptimizer:
    """The optimiser of one adapter: Adam (`spec.lr`) on the LoRA tensors of Linear targets,
    plain SGD (`spec.embedding_lr`) on those of embedding targets.

    Why SGD for id tables: Adam moves every coordinate by about `lr` per step whatever the size
    of its gradient, so the bias of an id whose clicks merely fluctuate random-walks as fast as
    one that really shifted. SGD's step is the mean residual of that id's rows — evidence-
    weighted, like the frozen + online category-bias reference of `benchmarks/online_drift.py`.
    Measured there (trend drift, seeds 7–9, LoRA on cross/deep + `wide.category`): Adam at
    lr 0.003 on the table scored 0.696 AUC before the drift (0.708 without the table) and 0.734
    over the first 5,000 examples after it; SGD at 0.2 scored 0.702 and 0.756.
    """

    def __init__(self, bank: AdapterBank, adapter_id: str, spec: OnlineSettings) -> None:
        pairs = bank.lora_params(adapter_id)
        dense = [p for m, pair in pairs.items() if m not in bank.embedding_modules for p in pair]
        tables = [p for m, pair in pairs.items() if m in bank.embedding_modules for p in pair]
        self.optimizers: list[torch.optim.Optimizer] = []
        # fused: one kernel for every tensor of the step (the per-tensor loop of PyTorch's
        # default CPU Adam cost ~2.5x as much on these small tensors)
        if dense:
            self.optimizers.append(torch.optim.Adam(dense, lr=spec.lr, fused=True))
        if tables:
            # weight decay is applied at the group's lr: a step at `scale` of the rates decays by
            # that share too (the decay follows the evidence, like the step)
            self.optimizers.append(
                torch.optim.SGD(tables, lr=spec.embedding_lr, weight_decay=spec.embedding_decay, fused=True)
            )
        self.params: list[torch.Tensor] = [*dense, *tables]
        self.lrs = [float(opt.param_groups[0]["lr"]) for opt in self.optimizers]
        self.scale = 1.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every LoRA tensor of the adapter (set to None: directly, without
        the optimisers' profiler records and per-group loops: 2 instead of 20 µs)."""
        if not set_to_none:
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=False)
            return
        for p in self.params:
            p.grad = None

    def step(self, scale: float = 1.0) -> None:
        """One step of each optimiser, at `scale` times its learning rate.

        Why scale: Adam moves every coordinate by about `lr` per step whatever the batch, and
        SGD's step is a mean gradient; so cutting the same examples into more, smaller steps
        (the trainer's deadline does that on quiet adapters: a step every few tens of ms instead
        of one per `min_step_examples`) would move an adapter that many times further: at 30
        steps/s of 3 examples, 15 times as far per second as 2 steps/s (a 3 × `lr` already made
        the live loop's adapters diverge, `schemas.settings.loop`). A step on n examples at
        n / `min_step_examples` of the rates moves it by its evidence, per example as far as a
        replay's full steps (which this leaves unchanged: n ≥ `min_step_examples` there)."""
        if scale != self.scale:
            for opt, lr in zip(self.optimizers, self.lrs, strict=True):
                for group in opt.param_groups:
                    group["lr"] = lr * scale
            self.scale = scale
        for opt in self.optimizers:
            opt.step()


@dataclass
class AdapterRun:
    """Everything the trainer keeps per adapter."""

    adapter_id: str
    published: AdapterState
    optimizer: AdapterOptimizer
    online: RollingMetrics
    base: RollingMetrics
    magnitudes: deque[np.ndarray]
    # per [module, direction]: gradient magnitude summed since the direction was last published
    unpublished: np.ndarray | None = None
    offsets: dict[int, int] = field(default_factory=dict)  # input partition → last offset learned
    buffer: list[TrainingExample] = field(default_factory=list)  # waiting for min_step_examples
    buffer_offsets: list[tuple[int, int]] = field(default_factory=list)
    # the buffer's rows featurized by the caller (`learn(features=…)`), in chunks; None where a
    # chunk came without them (then the step featurizes the examples itself)
    buffer_rows: list[RankerBatch | None] = field(default_factory=list)
    # the buffer's per-example logit offsets (`learn(corrections=…)`), chunk by chunk (zeros where
    # a chunk came without them); None while no chunk of the buffer had any
    buffer_corrections: list[np.ndarray] | None = None
    below: int = 0
    below_examples: int = 0  # examples learned since the guard's loss was first significant
    # the guard's last paired online − base AUC difference and its standard error (DeLong)
    paired: tuple[float, float] | None = None
    counts: Counter[str] = field(default_factory=Counter)
    # buffers of the weights before the running step (`OnlineTrainer._before`)
    saved: dict[str, torch.Tensor] | None = None

    @property
    def seq(self) -> int:
        """The last seq used (published) for this adapter; -1 before the first."""
        return self.published.seq


@dataclass
class ProgressiveLog:
    """Every (online, base, label) triple scored before learning, per adapter (replay reports)."""

    online: list[float] = field(default_factory=list)
    base: list[float] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)
    impression_ids: list[str] = field(default_factory=list)  # scoring order is grouped by adapter


Clock = Callable[[], datetime]
_ADAPTER_ID = attrgetter("adapter_id")
_LABEL_KIND = attrgetter("label_kind")
_IMPRESSION_ID = attrgetter("impression_id")


def module_thresholds(window: Sequence[np.ndarray], percentile: float) -> np.ndarray:
    """Per module, the `percentile`-th percentile of its direction magnitudes over `window`
    (steps of `[modules, r]` arrays): the publication threshold of each module's directions.

    `np.percentile(…, axis=1)` (its default linear method) bit for bit, without its generic
    machinery (a tenth of a step's time): the two order statistics around the virtual index,
    found by one `np.partition`, interpolated by numpy's own `_lerp` formula."""
    per_module = np.concatenate(window, axis=1)  # [modules, steps * r]; a percentile ignores order
    n = per_module.shape[1]
    virtual = (n - 1) * (percentile / 100)
    if n == 0 or not 0 <= virtual < n - 1 or np.isnan(per_module).any():
        return np.asarray(np.percentile(per_module, percentile, axis=1))  # edges: numpy's own rules
    lo = math.floor(virtual)
    ordered = np.partition(per_module, (lo, lo + 1), axis=1)
    below, above = ordered[:, lo], ordered[:, lo + 1]
    gamma = virtual - lo
    diff = above - below
    out: np.ndarray = above - diff * (1 - gamma) if gamma >= 0.5 else below + diff * gamma
    return out


def _checked_corrections(corrections: np.ndarray, n: int) -> np.ndarray:
    """`corrections` as float32 logit offsets of `n` examples (ValueError naming what is wrong)."""
    out = np.asarray(corrections, dtype=np.float32).reshape(-1)
    if len(out) != n:
        raise ValueError(f"corrections has {len(out)} values for {n} examples")
    if not np.isfinite(out).all():
        raise ValueError("corrections: not finite")
    return out


def _add_corrections(run: AdapterRun, corrections: np.ndarray | None, n: int) -> None:
    """Buffer the corrections of `n` examples added to `run` (zeros for none, once any chunk of
    the buffer has some)."""
    if corrections is None and run.buffer_corrections is None:
        return
    if run.buffer_corrections is None:  # the waiting examples came without: offset 0
        run.buffer_corrections = [np.zeros(len(run.buffer) - n, np.float32)]
    run.buffer_corrections.append(np.zeros(n, np.float32) if corrections is None else corrections)


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _with_offsets(delta: AdapterDelta, run: AdapterRun) -> AdapterDelta:
    """The delta stamped with the input offsets learned into its adapter so far (freshness: which
    examples a served version contains; none in replay mode)."""
    if not run.offsets:
        return delta
    return delta.model_copy(update={"learned_offsets": dict(run.offsets)})


def click_loss(
    logits: torch.Tensor, label: torch.Tensor, fake_negative: torch.Tensor | None, fn_loss: str
) -> torch.Tensor:
    """Mean click loss of a micro-batch: log loss where labels are final, the fake-negative loss
    (`fn_loss`, see the module docstring) where `fake_negative` marks a row of the FN stream
    (None: no row does)."""
    if fake_negative is None:  # the same value as the masked path's `bce.mean()`, in one op
        return F.binary_cross_entropy_with_logits(logits, label)
    bce = F.binary_cross_entropy_with_logits(logits, label, reduction="none")
    if not bool(fake_negative.any()):
        return bce.mean()
    if fn_loss == "weighted":
        p = torch.sigmoid(logits.detach())
        fn = torch.where(label > 0.5, 1 + p, (1 - p) * (1 + p)) * bce
    else:
        fn = torch.log1p(torch.sigmoid(logits)) - label * F.logsigmoid(logits)
    return torch.where(fake_negative, fn, bce).mean()


class OnlineTrainer:
    """Online LoRA training over a bank of adapters (see the module docstring)."""

    def __init__(
        self,
        bank: AdapterBank,
        spec: OnlineSettings,
        *,
        signing_key: bytes | None = None,
        keep_log: bool = False,
        clock: Clock = _utcnow,
    ) -> None:
        self.bank = bank
        self.spec = spec
        self.signing_key = signing_key  # signs every delta and snapshot (schemas.delta.resolve_signing_key)
        self.runs: dict[str, AdapterRun] = {}
        self.log: ProgressiveLog | None = ProgressiveLog() if keep_log else None
        self.clock = clock
        self.counts: Counter[str] = Counter()
        self.pending: list[AdapterDelta] = []
        self.evicted: list[AdapterDelta] = []

    @classmethod
    def from_settings(
        cls, bank: AdapterBank, settings: Settings, *, keep_log: bool = False, clock: Clock = _utcnow
    ) -> OnlineTrainer:
        """The trainer of `settings.online`, signing with the stack's delta key (the replicas' key)."""
        return cls(
            bank, settings.online, signing_key=resolve_signing_key(settings), keep_log=keep_log, clock=clock
        )

    # -- adapters ------------------------------------------------------------------------
    def run_for(self, adapter_id: str, epoch: int | None = None) -> AdapterRun:
        """The adapter's run state, created (adapter equal to the base) on first sight, in `epoch`
        (the seq lineage its messages carry; the service makes one per Redis seq record)."""
        run = self.runs.get(adapter_id)
        if run is None:
            self.bank.ensure(adapter_id)
            start = empty_state(adapter_id, self.bank.base_version, self.bank.shapes, self.bank.spec.rank)
            run = AdapterRun(
                adapter_id=adapter_id,
                published=replace(start, epoch=epoch),
                optimizer=self._optimizer(adapter_id),
                online=RollingMetrics(self.spec.progressive_window),
                base=RollingMetrics(self.spec.progressive_window),
                magnitudes=deque(maxlen=self.spec.delta_window_steps),
            )
            self.runs[adapter_id] = run
        return run

    def make_room(self, adapter_ids: Iterable[str]) -> None:
        """Evict least recently used adapters until the new ones among `adapter_ids` fit in
        `max_adapters` (an id from a forged event must not grow the trainer without bound, and
        a real new advertiser must not be refused). `adapter_ids` themselves are never evicted:
        a batch with more distinct adapters than the limit holds them all until the next call.
        Each eviction learns the adapter's waiting examples, then queues its snapshot in
        `pending` and in `evicted` (the service stores it in Redis, where `restore` finds it)."""
        wanted = set(adapter_ids)
        new = len(wanted - self.runs.keys())
        while len(self.runs) + new > self.spec.max_adapters:
            idle = [a for a, r in self.runs.items() if a not in wanted and not r.buffer]
            victims = idle or [a for a in self.runs if a not in wanted]
            if not victims:
                self.counts["over_limit"] += 1
                return
            self.evict(victims[0])

    def evict(self, adapter_id: str) -> AdapterDelta:
        """Drop an adapter from the trainer (and its bank) after learning what waits for it;
        returns its final snapshot (also queued in `pending` and `evicted`)."""
        run = self.runs[adapter_id]
        if run.buffer and (delta := self._learn_buffer(run)) is not None:
            self.pending.append(delta)
        snap = self.snapshot(adapter_id)
        self.pending.append(snap)
        self.evicted.append(snap)
        del self.runs[adapter_id]
        self.bank.remove(adapter_id)
        self.counts["evictions"] += 1
        log.info("adapter %s evicted (trainer_max_adapters %d)", adapter_id, self.spec.max_adapters)
        return snap

    def forget(self, adapter_id: str) -> None:
        """Drop an adapter without a snapshot (its partition moved to another trainer, which
        resumes it from Redis)."""
        if self.runs.pop(adapter_id, None) is not None:
            self.bank.remove(adapter_id)

    def take_evicted(self) -> list[AdapterDelta]:
        """Drain `evicted`: the final snapshots of evicted adapters, to store once published."""
        out, self.evicted = self.evicted, []
        return out

    def _optimizer(self, adapter_id: str) -> AdapterOptimizer:
        return AdapterOptimizer(self.bank, adapter_id, self.spec)

    def _state(self, run: AdapterRun) -> dict[str, torch.Tensor]:
        return self.bank.get_state(run.adapter_id)

    # -- the step ------------------------------------------------------------------------
    def learn(
        self,
        examples: Sequence[TrainingExample],
        offsets: Sequence[tuple[int, int]] | None = None,
        *,
        flush: bool = False,
        features: RankerBatch | None = None,
        corrections: np.ndarray | None = None,
    ) -> list[AdapterDelta]:
        """Score, learn and sparsify one micro-batch; returns the deltas to publish, in order.

        Examples are grouped by adapter; a group smaller than `min_step_examples` waits in the
        adapter's buffer for the next call (one Adam step on a handful of rows is mostly noise),
        unless `flush`. Waiting examples are still scored before they are learned.
        `offsets[i]` is `(partition, offset)` of `examples[i]` on the input topic (recorded per
        adapter once learned, for restart); omit it in replay mode. `features` may carry
        `featurize(examples)` when the caller has it already (the service validates a batch by
        featurizing it): the step then reuses those rows instead of featurizing again.
        `corrections[i]`: the per-user correction served with `examples[i]` (a logit offset its
        loss is taken with, see the module docstring); None: no offset.
        """
        if features is not None and len(features) != len(examples):
            raise ValueError(f"features has {len(features)} rows for {len(examples)} examples")
        if corrections is not None:
            corrections = _checked_corrections(corrections, len(examples))
        ids = list(map(_ADAPTER_ID, examples))
        groups: dict[str, list[int] | None]  # adapter → positions, in order (None: all of them)
        if ids and ids.count(ids[0]) == len(ids):  # one adapter (a partition of one slot's examples)
            groups = {ids[0]: None}
        else:
            many: defaultdict[str, list[int]] = defaultdict(list)
            for i, aid in enumerate(ids):
                many[aid].append(i)
            groups = dict(many)
        self.make_room(groups)
        for adapter_id, index in groups.items():
            run = self.run_for(adapter_id)
            self.runs[adapter_id] = self.runs.pop(adapter_id)  # the most recently used goes last
            if index is None:
                run.buffer += examples
                run.buffer_rows.append(features)
                _add_corrections(run, corrections, len(examples))
                if offsets is not None:
                    run.buffer_offsets += offsets
                continue
            run.buffer += [examples[i] for i in index]
            run.buffer_rows.append(
                None if features is None else features.select(torch.as_tensor(index, dtype=torch.int64))
            )
            _add_corrections(run, None if corrections is None else corrections[index], len(index))
            if offsets is not None:
                run.buffer_offsets += [offsets[i] for i in index]
        out: list[AdapterDelta] = []
        for run in list(self.runs.values()):
            if not run.buffer or (len(run.buffer) < self.spec.min_step_examples and not flush):
                continue
            if (delta := self._learn_buffer(run)) is not None:
                out.append(delta)
        return out

    def _learn_buffer(self, run: AdapterRun) -> AdapterDelta | None:
        """One step on everything waiting in `run`'s buffer; its offsets count as learned and
        stamp the delta it makes (if any)."""
        delta = self._step(run, *self._take_buffer(run))
        for part, off in run.buffer_offsets:
            run.offsets[part] = max(off, run.offsets.get(part, -1))
        run.buffer_offsets = []
        return None if delta is None else _with_offsets(delta, run)

    def flush(self) -> list[AdapterDelta]:
        """Learn every waiting example now (before a snapshot or at the end of a replay)."""
        return self.learn([], flush=True)

    def waiting(self) -> int:
        """Examples buffered but not learned yet."""
        return sum(len(r.buffer) for r in self.runs.values())

    @staticmethod
    def _take_buffer(
        run: AdapterRun,
    ) -> tuple[list[TrainingExample], RankerBatch | None, np.ndarray | None]:
        examples, chunks, corr = run.buffer, run.buffer_rows, run.buffer_corrections
        run.buffer, run.buffer_rows, run.buffer_corrections = [], [], None
        offset = None if corr is None else np.concatenate(corr)
        if not chunks or any(c is None for c in chunks):
            return examples, None, offset
        rows = [c for c in chunks if c is not None]
        return examples, rows[0] if len(rows) == 1 else RankerBatch.cat(rows), offset

    def _step(
        self,
        run: AdapterRun,
        examples: list[TrainingExample],
        rows: RankerBatch | None = None,
        corrections: np.ndarray | None = None,
    ) -> AdapterDelta | None:
        kinds = list(map(_LABEL_KIND, examples))
        if "dwell" in kinds:  # dwell label updates: not click labels
            keep = list(map("dwell".__ne__, kinds))
            kinds = list(compress(kinds, keep))
            clicks = list(compress(examples, keep))
            run.counts["dwell_updates"] += len(examples) - len(clicks)
            self.counts["dwell_updates"] += len(examples) - len(clicks)
            if not clicks:
                return None
            examples = clicks
            rows = None if rows is None else rows.select(torch.tensor(keep))
            corrections = None if corrections is None else corrections[np.asarray(keep)]
        batch = rows if rows is not None and rows.label is not None else featurize(examples, self.bank.config)
        assert batch.label is not None
        # the live weights, not a copy: they become the stepped weights in place, read until the
        # next step only (the parts, the norms); what is kept (published state, snapshots) is
        # copied where it is made
        after = self.bank.state_views(run.adapter_id)
        weights = list(after.values())
        before = self._before(run, after)  # a copy: a dropped step puts it back
        run.optimizer.zero_grad(set_to_none=True)
        logits, base_logits = self.bank.train_logits_and_base(batch, run.adapter_id)
        base_p = torch.sigmoid(base_logits)
        online_p = torch.sigmoid(logits.detach())
        self._record(run, online_p, base_p, batch.label, examples, kinds)
        if kinds.count("final") == len(kinds):
            fake = None
        else:
            mark = np.fromiter(map("final".__ne__, kinds), dtype=bool, count=len(kinds))
            fake = torch.from_numpy(mark).to(logits.device)
        # the loss of what is served: base + adapter + the per-user correction (a fixed offset)
        fit = logits if corrections is None else logits + torch.from_numpy(corrections).to(logits)
        loss = click_loss(fit, batch.label, fake, self.spec.fn_loss)
        if not torch.isfinite(loss):
            return self._drop(run, before, "non_finite_loss")
        loss.backward()  # type: ignore[no-untyped-call]
        grads: list[torch.Tensor] = []  # A, B of each module in turn
        for a, b in self.bank.lora_params(run.adapter_id).values():
            if a.grad is None or b.grad is None:
                return self._drop(run, before, "no_gradient")
            grads += (a.grad, b.grad)
        # sqrt(|∇A[i,:]|² + |∇B[:,i]|²) per module, with fused squares and sums across modules
        squares = torch._foreach_mul(grads, grads)
        magnitude = torch.stack(
            torch._foreach_add([sq.sum(1) for sq in squares[::2]], [sq.sum(0) for sq in squares[1::2]])
        ).sqrt_()  # [modules, r]
        if not torch.isfinite(magnitude).all():
            return self._drop(run, before, "non_finite_gradient")
        run.optimizer.step(min(1.0, len(examples) / self.spec.min_step_examples))
        # one fused pass: a weight's norm is finite only when all its entries are
        norms = torch.stack(
            torch._foreach_norm([*weights, *torch._foreach_sub(weights, list(before.values()))])
        ).tolist()
        if not all(math.isfinite(v) for v in norms[: len(weights)]):
            return self._drop(run, before, "non_finite_weights")
        step_norm = math.sqrt(sum(v * v for v in norms[len(weights) :]))
        if step_norm > self.spec.delta_max_norm:
            return self._drop(run, before, "oversized")
        run.counts["steps"] += 1
        run.counts["examples"] += len(examples)
        self.counts["steps"] += 1
        delta = self._sparse_delta(run, after, magnitude.numpy())
        self._guard(run, len(examples))
        return delta

    @staticmethod
    def _before(run: AdapterRun, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A copy of the adapter's weights before the step, into buffers the run keeps (one fused
        copy instead of a fresh tensor per weight each step)."""
        saved = run.saved
        if saved is None or saved.keys() != weights.keys():
            saved = run.saved = {k: torch.empty_like(v) for k, v in weights.items()}
        torch._foreach_copy_(list(saved.values()), list(weights.values()))
        return saved

    def _record(
        self,
        run: AdapterRun,
        online: torch.Tensor,
        base: torch.Tensor,
        label: torch.Tensor,
        examples: Sequence[TrainingExample],
        kinds: Sequence[str],
    ) -> None:
        """Progressive validation: each impression one (score, label) pair in the rolling
        windows. On the fake-negative stream that is its fake negative, scored before anything
        was learned from it; its click's positive duplicate (learned, not scored) relabels that
        pair positive — counting the duplicate as a pair of its own put the impression in both
        classes, a tie for the frozen base but a loss for the model that had just learned the
        fake negative. The log keeps every row as scored."""
        o, b, y = online.numpy(), base.numpy(), label.numpy()
        if "click" not in kinds and "fake_negative" not in kinds:
            run.online.extend(o, y)
            run.base.extend(b, y)
        else:
            ids = key_ids(map(_IMPRESSION_ID, examples))
            click = np.fromiter(map("click".__eq__, kinds), dtype=bool, count=len(kinds))
            new = ~click
            run.online.extend(o[new], y[new], ids[new])
            run.base.extend(b[new], y[new], ids[new])
            if click.any():
                found = RollingMetrics.relabel_all((run.online, run.base), ids[click])
                missed = int(click.sum()) - found
                run.counts["clicks_unmatched"] += missed
                self.counts["clicks_unmatched"] += missed
        if self.log is not None:
            self.log.online += o.tolist()
            self.log.base += b.tolist()
            self.log.labels += [int(v) for v in y.tolist()]
            self.log.adapters += [run.adapter_id] * len(y)
            self.log.impression_ids += [e.impression_id for e in examples]

    def _drop(self, run: AdapterRun, before: dict[str, torch.Tensor], reason: str) -> AdapterDelta | None:
        self.bank.set_state(run.adapter_id, before)
        run.optimizer = self._optimizer(run.adapter_id)  # its moments saw the bad gradient
        run.counts[f"dropped_{reason}"] += 1
        self.counts[f"dropped_{reason}"] += 1
        log.warning("adapter %s: update dropped (%s)", run.adapter_id, reason)
        return None

    def _sparse_delta(
        self, run: AdapterRun, state: dict[str, torch.Tensor], mags: np.ndarray
    ) -> AdapterDelta | None:
        acc = mags if run.unpublished is None else run.unpublished + mags
        run.unpublished = acc
        run.magnitudes.append(acc)
        thresholds = module_thresholds(run.magnitudes, self.spec.delta_percentile)
        chosen = acc >= thresholds[:, None]
        if not chosen.any():
            # nothing passed its module's percentile: publish the single strongest direction
            # anyway, so what this step learned (its offsets) reaches replicas now (freshness)
            chosen.flat[int(np.argmax(acc / np.maximum(thresholds, 1e-30)[:, None]))] = True
        modules = self.bank.modules
        dirs = {
            modules[i]: torch.from_numpy(np.flatnonzero(chosen[i])) for i in np.flatnonzero(chosen.any(1))
        }
        parts = select_parts(state, dirs)
        if not parts:
            return None
        norm = change_norm(run.published.tensors, parts)
        if norm > self.spec.delta_max_norm:
            self.counts["oversized_as_snapshot"] += 1
            return self.snapshot(run.adapter_id)
        delta = make_delta(
            run.published, parts, run.seq + 1, now=self.clock(), key=self.signing_key, norm=norm
        )
        run.unpublished = np.where(chosen, 0.0, acc)
        run.published = replace(
            run.published, seq=delta.seq, tensors=merge_parts(run.published.tensors, parts)
        )
        run.counts["deltas"] += 1
        self.counts["deltas"] += 1
        self.counts["directions"] += int(np.count_nonzero(chosen))
        return delta

    def _guard(self, run: AdapterRun, examples: int) -> None:
        """Reset an adapter that scores significantly below the frozen base on the same examples
        for `reset_patience` micro-batches and `reset_patience_examples` examples (at most one
        `progressive_window`; this step's `examples` included) in a row: the paired difference of
        their AUCs (DeLong) plus `guard_z` standard errors still below −`reset_margin`. A
        difference inside its noise (~500 examples with 10–40 clicks give a standard error of
        ~0.02) never resets.

        Why examples: the test is repeated after every step on a sliding window, and steps are as
        small as the trainer's deadline makes them (a few examples at `online.max_wait_s`), so 20
        micro-batches in a row were ~60 new examples of a 2,000-example window: one look, not
        twenty. A loss that holds while a window's worth of new examples arrives is seen on
        evidence none of which was in the window that first showed it. Measured on two scorers
        fed in steps of 4 examples (4 seeds of 10,000): a loss lasting 1,000 or 1,500 examples
        (an adapter lagging a drift for a while) reset 3 and 4 of 4 adapters at 20 micro-batches,
        none at a window of examples; a loss that lasts (6,000 examples) still resets, 1–2 times
        instead of 6–7; two equally good scorers reset none under either rule (4 × 50,000)."""
        spec = self.spec
        if run.online.count < spec.min_guard_examples or run.online.positives < spec.min_guard_positives:
            return
        a_online, a_base = run.online.auc(), run.base.auc()
        if math.isnan(a_online) or math.isnan(a_base) or a_online >= a_base - spec.reset_margin:
            run.below = run.below_examples = 0  # not even the point estimate is a loss (the common case)
            return
        (p_online, y), (p_base, _) = run.online.pairs(), run.base.pairs()
        diff, se = paired_auc_difference(p_online, p_base, y)
        run.paired = (diff, se)
        if math.isnan(diff) or diff + spec.guard_z * se >= -spec.reset_margin:
            run.below = run.below_examples = 0
            return
        run.below += 1
        run.below_examples += examples
        patience_examples = min(spec.reset_patience_examples, spec.progressive_window)
        if run.below >= spec.reset_patience and run.below_examples >= patience_examples:
            self.reset(
                run.adapter_id,
                f"rolling AUC {a_online:.4f} < base {a_base:.4f}: difference {diff:.4f} "
                f"(95 % upper {diff + spec.guard_z * se:.4f}) below -{spec.reset_margin}",
            )

    # -- lifecycle -----------------------------------------------------------------------
    def reset(self, adapter_id: str, reason: str) -> AdapterDelta:
        """Reset an adapter to the base model; returns the snapshot to publish (also queued)."""
        run = self.run_for(adapter_id)
        log.warning("adapter %s reset: %s", adapter_id, reason)
        self.bank.reset(adapter_id)
        run.optimizer = self._optimizer(adapter_id)
        run.online.clear()
        run.base.clear()
        run.magnitudes.clear()
        run.below = run.below_examples = 0
        run.counts["resets"] += 1
        self.counts["resets"] += 1
        snap = self.snapshot(adapter_id)
        self.pending.append(snap)
        return snap

    def take_pending(self) -> list[AdapterDelta]:
        """Drain `pending`: snapshots made by resets, to publish after `learn`'s deltas."""
        out, self.pending = self.pending, []
        return out

    def snapshot(self, adapter_id: str) -> AdapterDelta:
        """A full snapshot of the adapter's current weights with the next seq; replicas that apply
        it hold exactly the trainer's state, so it becomes the published state."""
        run = self.run_for(adapter_id)
        state = self._state(run)
        snap = make_delta(
            run.published,
            full_parts(state, run.published.rank),
            run.seq + 1,
            snapshot=True,
            now=self.clock(),
            key=self.signing_key,
        )
        run.published = replace(run.published, seq=snap.seq, tensors=state)
        run.unpublished = None  # replicas hold everything now
        run.counts["snapshots"] += 1
        self.counts["snapshots"] += 1
        return _with_offsets(snap, run)

    def restore(
        self,
        adapter_id: str,
        snap: AdapterDelta | None,
        last_seq: int,
        offsets: dict[int, int] | None = None,
        epoch: int | EllipsisType | None = ...,
    ) -> AdapterRun:
        """Resume an adapter after a restart from its snapshot (or from the base when there is
        none); the next seq follows `last_seq` (the highest seq ever reserved), so none is reused.
        When `last_seq` is past the snapshot, replicas may hold later deltas: publish a fresh
        `snapshot()` next to re-align them. `epoch`: the lineage to go on in (default: the
        snapshot's); another than the snapshot's also needs that fresh `snapshot()`."""
        run = self.run_for(adapter_id)
        start = empty_state(adapter_id, self.bank.base_version, self.bank.shapes, self.bank.spec.rank)
        if snap is not None:
            if snap.adapter_id != adapter_id:
                raise ConfigError(f"snapshot of {snap.adapter_id!r} given for adapter {adapter_id!r}")
            restored = apply_delta(start, snap, self.spec.delta_max_norm)
            self.bank.set_state(adapter_id, dict(restored.tensors))
            tensors = restored.tensors
        else:
            self.bank.reset(adapter_id)
            tensors = start.tensors
        seq = max(last_seq, snap.seq if snap is not None else -1)
        if isinstance(epoch, EllipsisType):
            epoch = snap.epoch if snap is not None else None
        run.published = AdapterState(adapter_id, start.base_version, start.rank, seq, tensors, epoch)
        run.unpublished = None
        run.optimizer = self._optimizer(adapter_id)
        run.offsets = dict(offsets or {})
        return run
