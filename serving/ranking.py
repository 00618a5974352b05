"""Rank: the base ranker with the adapter bank installed, scoring the candidates of many requests
in one forward pass; features are built from catalog columns (same spec as `trainers.models.features`).
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from torch import nn

from schemas.errors import AdapterError
from schemas.settings import Settings
from serving.adapters import CANDIDATE, STABLE, AdapterStack, BankBuffers
from serving.banked import BankContext, install, target_layers
from trainers.models.features import ID_COLUMNS, N_EXTRA_DENSE, N_QUERY_DENSE, slot_index
from trainers.models.ranker import (
    CONFIG_FILE,
    Ranker,
    RankerConfig,
    additive_in_logit,
    load_checkpoint,
    slot_buckets_for,
    weights_version,
)

log = logging.getLogger(__name__)


def find_checkpoint(model_dir: Path) -> Path | None:
    """The ranker checkpoint directory under `model_dir` (itself or `ranker/`), if any."""
    for candidate in (model_dir / "ranker", model_dir):
        if (candidate / CONFIG_FILE).exists():
            return candidate
    return None


def load_ranker(settings: Settings, device: torch.device) -> tuple[Ranker, str]:
    """The trained ranker from `settings.model_dir`, or (with a warning) a seeded untrained one."""
    path = find_checkpoint(settings.model_dir)
    if path is not None:
        return load_checkpoint(path, device)
    log.warning("no ranker checkpoint under %s: serving an untrained ranker", settings.model_dir)
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(0)
        model = Ranker(
            RankerConfig(state_dim=settings.state_dim, slot_buckets=slot_buckets_for(settings.slots.names))
        )
    model.eval().to(device)
    return model, weights_version(model)


@dataclass(frozen=True)
class RankInput:
    """One request's candidates as ranker tensors plus the bank row of each candidate's adapter,
    and the per-user correction of each candidate's logit (None: none)."""

    dense: torch.Tensor
    ids: torch.Tensor
    rows: torch.Tensor
    offset: torch.Tensor | None = None
    # the bank row every candidate's adapter has, where the caller knows that they share one
    # (`AdPipeline.shared_adapter_row`: a slot adapter); None: `FoldedSlots.model_for` checks
    row: int | None = None


def build_input(  # noqa: PLR0913 - the user's columns, the candidates', and the ranker's slot rows
    user_vector: np.ndarray,
    intent_by_category: np.ndarray,
    cand_ids: np.ndarray,
    cand_category: np.ndarray,
    slot: str,
    hour: int,
    state_dim: int,
    bias_by_category: np.ndarray | None = None,
    slot_buckets: int = 0,
    query_features: bool = False,
    query_match: np.ndarray | None = None,
) -> RankInput:
    """Tensors for n candidates of one user, column for column as `trainers.models.features.featurize`
    builds them for the training example of the same impression (position 0: rank scores every
    candidate as if at the top). The recall-score columns stay "absent" (0, flag 0): training
    examples never carry a recall score (impressions do not record it), so a served one would be
    an input the model was never fitted to (tests/unit/serving/test_feature_parity.py). Bank rows
    start at 0 (the base model); `AdPipeline.adapter_rows` fills them for the adapter rung.
    `bias_by_category` (the user's per-category logit bias, `streams.state`) becomes each
    candidate's logit offset. `slot_buckets`: the ranker's hashed slot rows (its
    `RankerConfig.slot_buckets`), for slots beyond the three defaults. `query_features`: the
    ranker has the query columns (`RankerConfig.query_features`); `query_match` is each
    candidate's match with the request's query (`serving.text.text_match`; None: no query), the
    value its impression logs and its training example carries."""
    n = cand_ids.shape[0]
    width = state_dim + N_EXTRA_DENSE + (N_QUERY_DENSE if query_features else 0)
    dense = np.zeros((n, width), dtype=np.float32)
    vec = np.asarray(user_vector, dtype=np.float32)[:state_dim]
    dense[:, : vec.shape[0]] = vec
    dense[:, state_dim] = intent_by_category[cand_category] if intent_by_category.size else 0.0
    if query_features and query_match is not None:
        dense[:, state_dim + N_EXTRA_DENSE] = query_match
        dense[:, state_dim + N_EXTRA_DENSE + 1] = 1.0
    ids = np.empty((n, 7), dtype=np.int64)
    ids[:, :4] = cand_ids
    ids[:, 4] = slot_index(slot, slot_buckets)
    ids[:, 5] = 0
    ids[:, 6] = hour
    offset = None
    if bias_by_category is not None and bias_by_category.size:
        offset = torch.from_numpy(np.ascontiguousarray(bias_by_category[cand_category], dtype=np.float32))
    return RankInput(
        torch.from_numpy(dense), torch.from_numpy(ids), torch.zeros(n, dtype=torch.int64), offset
    )


POSITION: Final = ID_COLUMNS.index("position")  # the id column of the served position


def at_positions(inp: RankInput, picks: np.ndarray, max_position: int) -> RankInput:
    """The candidates `picks` of `inp` (indices into it, in display order) as the ranker sees
    each where it is served: the i-th at position i (capped at `max_position` − 1, as
    `trainers.models.features` caps it), their adapters' bank rows and correction kept."""
    idx = torch.from_numpy(np.ascontiguousarray(picks, dtype=np.int64))
    ids = inp.ids.index_select(0, idx)  # a copy: the recalled input keeps position 0
    ids[:, POSITION] = torch.clamp(torch.arange(idx.shape[0]), max=max_position - 1)
    offset = None if inp.offset is None else inp.offset.index_select(0, idx)
    return RankInput(inp.dense.index_select(0, idx), ids, inp.rows.index_select(0, idx), offset, inp.row)


# the folds of a batch's slots stacked (`RankModel._stacked`): heads [models, in], their biases,
# and per wide table (id column, rows per model or 0 when not adapted, the table flat)
Wide = list[tuple[int, int, torch.Tensor]]
# the adapted wide tables summed into one table per model (`RankModel._stacked`): (id column,
# stride) per table, the entries per model, the models' tables flat, model after model
Combined = tuple[list[tuple[int, int]], int, torch.Tensor]
Stacked = tuple[torch.Tensor, torch.Tensor, Wide, Combined | None]
# the most entries per model of the combined table (the adapted tables' rows multiplied): the
# defaults (category 256 × slot 3 × position 16) make 12,288, 48 KB a model
COMBINED_MAX: Final = 1 << 16
STACK_CACHE = 64  # stacked sets kept (cleared when full: a swap's new versions make new keys)
PLAIN: Final = ("plain",)  # the stacked key of the plain model alone (its weights never change)

# one row's fold: the plain model with the adapted layers' weights replaced, and those weights
Fold = tuple[nn.Module, dict[str, torch.Tensor]]


class FoldedSlots:
    """Slot adapters folded into copies of the plain base ranker (`W + scale·B·A`; an id table
    `E + scale·(B·A)ᵀ`), so a request whose candidates all use one slot adapter is scored by the
    base model's forward at the base model's cost. The bank's `Folder`: a write computes the fold
    once (before the swap, float64 sum rounded once: the same fold as
    `trainers.models.lora.fold_lora`, checked in tests/unit/serving/test_serving_folded.py) and
    each buffer keeps its own copy per row, written in place with the row's factors as part of
    the swap (a copy is made once per row and buffer: only the adapted layers are copied, the
    rest is shared with the plain model). A batch reads the folds of the buffers it holds, so
    folds and factors always come from one swap; the swap itself costs a few tensor copies.
    The arms' empty rows (unknown adapters) map to the plain model itself. Per-advertiser
    adapters are not folded (the banked path mixes them)."""

    def __init__(self, plain: nn.Module, bank: AdapterStack, fold_ids: frozenset[str]) -> None:
        self.plain = plain
        self.fold_ids = fold_ids
        self.scale = bank.scale
        self.null_rows = frozenset({bank.row(None, STABLE), bank.row(None, CANDIDATE)})
        self.layers: dict[str, nn.Linear | nn.Embedding] = {}
        for name in bank.shapes:
            layer = plain.get_submodule(name)
            if not isinstance(layer, nn.Linear | nn.Embedding):
                raise AdapterError(f"layer {name!r} is {type(layer).__name__}, not Linear or Embedding")
            self.layers[name] = layer
        self.folds = 0  # folds computed (one per write of a folded adapter)
        self.bank = bank
        bank.folder = self

    def rows(self) -> set[int]:
        """The rows folded in the bank's active buffers."""
        return set(self.bank.active.folded)

    def folds_adapter(self, adapter_id: str) -> bool:
        """Slot adapters are folded (every candidate of a request shares one)."""
        return adapter_id in self.fold_ids

    def fold(self, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Each adapted layer's weight with the adapter's ΔW folded in (A [r, in], B [out, r])."""
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, layer in self.layers.items():
                a, b = weights[name]
                delta = b.double() @ a.double()  # B·A, [out, in]
                if isinstance(layer, nn.Embedding):
                    delta = delta.T  # (B·A)ᵀ, [num_embeddings, dim]
                w = layer.weight
                out[name] = (w.double() + self.scale * delta.to(w.device)).to(w.dtype)
        self.folds += 1
        return out

    def write(self, buf: BankBuffers, row: int, folded: Mapping[str, torch.Tensor]) -> None:
        fold = buf.folded.get(row)
        if fold is None:
            buf.folded[row] = self._copy_with({n: t.clone() for n, t in folded.items()})
            return
        with torch.no_grad():
            for name, w in fold[1].items():
                w.copy_(folded[name])

    def weights_of(self, fold: Fold) -> dict[str, torch.Tensor]:
        return fold[1]

    def copy(self, fold: Fold) -> Fold:
        return self._copy_with({n: w.detach().clone() for n, w in fold[1].items()})

    def _copy_with(self, weights: dict[str, torch.Tensor]) -> Fold:
        """The plain model with these adapted layers' weights (held, so a write is in place)."""
        model = _with_weights(self.plain, weights)
        held: dict[str, torch.Tensor] = {}
        for n in weights:
            layer = model.get_submodule(n)
            assert isinstance(layer, nn.Linear | nn.Embedding)
            held[n] = layer.weight
        return model, held

    def model_for(self, rows: torch.Tensor, buf: BankBuffers, row: int | None = None) -> nn.Module | None:
        """The folded (or plain) model that scores every candidate of `rows` exactly, if any:
        all rows one folded slot adapter's in `buf`, or all the empty row. `row`: the row every
        one of `rows` is known to be (`RankInput.row`), not checked again."""
        if rows.numel() == 0:
            return None
        if row is not None:
            if row in self.null_rows:
                return self.plain
            known: Fold | None = buf.folded.get(row)
            return None if known is None else known[0]
        # the request's rows as numpy (a view; a fifth of torch's per-call cost on 500 rows)
        r = rows.numpy() if rows.device.type == "cpu" else rows.cpu().numpy()
        first = int(r[0])
        if first in self.null_rows:
            return self.plain if bool((r == first).all()) else None
        hit: Fold | None = buf.folded.get(first)
        if hit is None or not bool((r == first).all()):
            return None
        return hit[0]


def _table(model: Ranker, name: str) -> torch.Tensor:
    """The weight of one of `model`'s wide tables."""
    table = model.wide[name]
    assert isinstance(table, nn.Embedding)
    return table.weight


def _with_weights(module: nn.Module, weights: Mapping[str, torch.Tensor]) -> nn.Module:
    """A shallow copy of `module` whose named submodules (dotted paths) have the given weights;
    every other module and tensor is shared with `module`."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    out._parameters = dict(module._parameters)
    children: dict[str, dict[str, torch.Tensor]] = {}
    for name, w in weights.items():
        head, _, rest = name.partition(".")
        if name == "":
            out._parameters["weight"] = nn.Parameter(w, requires_grad=False)
        else:
            children.setdefault(head, {})[rest] = w
    for head, sub in children.items():
        child = module._modules[head]
        assert child is not None
        out._modules[head] = _with_weights(child, sub)
    return out


class _Trunk(nn.Module):
    """`Ranker.head_input` of one model as a module `torch.jit.trace` can record."""

    def __init__(self, model: Ranker) -> None:
        super().__init__()
        self.model = model

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.model.head_input(dense, ids)


def traced_trunk(model: Ranker) -> torch.jit.ScriptModule:
    """`model.head_input` (the embeddings, cross and deep layers) recorded by `torch.jit.trace`:
    the same ATen calls with the same results, bit for bit, run by TorchScript's interpreter
    instead of ~25 Python module calls. On the small passes of a one-request batch (~500
    candidates, then ~10 at their positions) that per-call cost is much of the forward. The trace
    shares `model`'s tensors: the model must not get new ones afterwards (the plain base never
    does; the folds differ from it only after the trunk). Without a user tower only (its
    sequence input is not a tensor)."""
    return _traced(_Trunk(model), _example(model))


class _Scorer(nn.Module):
    """`Ranker.forward` of one model with its head and wide tables as inputs: the logits of any
    model that differs from it only there (a fold of `stackable` adapters)."""

    def __init__(self, model: Ranker) -> None:
        super().__init__()
        self.model = model
        self.wide = wide_columns(model)

    def forward(
        self,
        dense: torch.Tensor,
        ids: torch.Tensor,
        head_w: torch.Tensor,
        head_b: torch.Tensor,
        tables: tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        # as `Ranker.forward` computes it after `head_input`, op for op (the same bits)
        logit = nn.functional.linear(self.model.head_input(dense, ids), head_w, head_b).squeeze(1)
        for (i, _), table in zip(self.wide, tables, strict=True):
            logit = logit + nn.functional.embedding(ids[:, i], table).squeeze(1)
        return logit


def _traced(module: nn.Module, inputs: tuple[Any, ...]) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        # deprecated for torch.export and torch.compile: export's module runs its graph op by op
        # in Python (no faster than eager here at 10-2,048 candidates), compile needs a C++
        # toolchain on the replica's machine at run time
        warnings.simplefilter("ignore", DeprecationWarning)
        with torch.inference_mode():
            traced: torch.jit.ScriptModule = torch.jit.trace(  # type: ignore[no-untyped-call]
                module, inputs, check_trace=False
            )
    return traced


def run_traced(module: torch.jit.ScriptModule, *args: Any) -> torch.Tensor:
    """`module(*args)` with TorchScript's graph optimizer off on this thread (a per-thread
    flag, restored after): its graph runs as recorded. On the CPU the optimizer fuses nothing
    here, and it re-specializes a graph for each new batch size, several milliseconds a time on
    a replica's first requests; interpreted, the speed is the same and every call alike."""
    optimize = torch._C._get_graph_executor_optimize()
    torch._C._set_graph_executor_optimize(False)
    try:
        out: torch.Tensor = module(*args)
    finally:
        torch._C._set_graph_executor_optimize(optimize)
    return out


def traced_scorer(model: Ranker) -> torch.jit.ScriptModule:
    """`_Scorer` of `model` recorded by `torch.jit.trace`: called with a fold's head and wide
    tables, that fold's logits (see `traced_trunk`)."""
    dense, ids = _example(model)
    tables = tuple(model.wide[name].weight for _, name in wide_columns(model))
    return _traced(_Scorer(model), (dense, ids, model.head.weight, model.head.bias, tables))


def wide_columns(model: Ranker) -> list[tuple[int, str]]:
    """(id column index, name) of each id column with a `wide` table, in `ID_COLUMNS` order: the
    order `Ranker.forward` adds them and `_Scorer` takes their tables."""
    return [(i, name) for i, name in enumerate(ID_COLUMNS) if name in model.wide]


def _example(model: Ranker) -> tuple[torch.Tensor, torch.Tensor]:
    device = next(model.parameters()).device
    dense = torch.zeros(4, model.config.dense_dim, device=device)
    return dense, torch.zeros(4, len(ID_COLUMNS), dtype=torch.int64, device=device)


class RankModel:
    """The base ranker with banked LoRA layers; `score` takes several requests' inputs at once.

    `chunk` (CPU only; `settings.serving.rank_chunk`) splits a batch into forward passes of at
    most that many candidates (2,048: base and adapter batches both ran 5–10 % faster than with
    1,024 or 4,096 on a one-thread replica; `benchmarks/rank.py --chunk`); `group_limit`,
    `merge_min` and `merge_max` (`settings.serve_merge_*`) decide which adapters of a batch are
    computed with merged weights (see `BankContext.merge_rows`).
    """

    def __init__(
        self,
        model: Ranker,
        version: str,
        settings: Settings,
        device: torch.device,
    ) -> None:
        self.model = model
        self.version = version
        self.device = device
        plain = copy.deepcopy(model).eval()  # before the bank's layers go in: the folds' base
        shapes = target_layers(model, list(settings.lora.targets))
        self.bank = AdapterStack(
            shapes,
            rank=settings.lora.rank,
            alpha=settings.lora.alpha,
            capacity=settings.serving.adapter_capacity,
            max_norm=settings.serving.adapter_max_norm,
            device=device,
        )
        ctx = BankContext(
            group_limit=settings.serving.merge_group_limit,
            merge_min=settings.serving.merge_min,
            merge_max=settings.serving.merge_max,
        )
        self.ctx: BankContext = install(model, self.bank, ctx)
        # slot adapters (one per slot: every candidate of a request shares it) are folded into
        # copies of the base at swap time; per-advertiser adapters take the banked (mixed) path
        self.folded = FoldedSlots(plain, self.bank, frozenset(settings.slots.names))
        # the folds differ from the plain model only in layers that add to the logit (the
        # default targets: head, wide tables), so a batch of several slots runs the trunk once
        self._stacks: dict[Any, Stacked] = {}  # `_stacked` per buffer and fold versions
        self.stackable = (
            isinstance(plain, Ranker)
            and plain.tower is None
            and all(additive_in_logit(name) for name in self.bank.shapes)
        )
        # the trunk every fold shares (`stackable`: the plain model's) and a fold's whole forward,
        # traced (CPU: the per-layer Python cost they save is the CPU's), run in passes of at
        # most `rank_trace_rows` candidates (`_chunk`: above ~1,000 the traced trunk was no
        # faster than the eager one, and the eager chunk's 2,048 is slower traced)
        self.trace_rows = settings.serving.rank_trace_rows if device.type == "cpu" else 0
        self._trunk: torch.jit.ScriptModule | None = None
        self._scorer: torch.jit.ScriptModule | None = None
        self._wide_names: list[str] = []
        if self.stackable and self.trace_rows > 0:
            assert isinstance(plain, Ranker)
            try:
                self._trunk, self._scorer = traced_trunk(plain), traced_scorer(plain)
            except Exception:  # a torch that cannot trace any more: the eager ranker, same scores
                log.warning("the ranker could not be traced; ranking with the eager one", exc_info=True)
                self._trunk, self._scorer, self.trace_rows = None, None, 0
            self._wide_names = [name for _, name in wide_columns(plain)]
        # the wide tables the adapters change, in id-column order: summed into one table per
        # model where small enough (`_stacked`), so a batch of several slots gathers them once
        # with one index whatever the number of slots, as the plain model does
        adapted = {name.removeprefix("wide.") for name in self.bank.shapes if name.startswith("wide.")}
        self.combined_names = [name for name in ID_COLUMNS if name in adapted]
        self.config: RankerConfig = model.config
        self.chunk = settings.serving.rank_chunk

    @torch.inference_mode()
    def score(self, inputs: list[RankInput], use_adapters: bool) -> list[np.ndarray]:
        """pCTR per candidate for each input, from one forward pass over all of them.

        With adapters, the candidates are put in `BankContext.order` first: the adapters with
        many candidates (per-slot adapters, heavy advertisers) are computed with merged weights
        (as fast as the base model), the rest per sample, sorted by adapter so each adapter's
        weights are read once while cached; the scores come back in the input order.
        """
        if not inputs:
            return []
        if use_adapters:
            return self._score_folded(inputs)
        if self.stackable:  # the plain model through the same pass as the slots' folds
            total = sum(i.dense.shape[0] for i in inputs)
            return self._split(inputs, self._forward_stacked(inputs, [self.folded.plain], [total], PLAIN))
        return self._split(inputs, self._forward(inputs, use_adapters))

    def _score_folded(self, inputs: list[RankInput]) -> list[np.ndarray]:
        """With adapters: the inputs whose candidates share one folded slot adapter (or none)
        go through that model's plain forward, one pass per model; the rest (mixed adapters)
        through the banked layers."""
        out: list[np.ndarray | None] = [None] * len(inputs)
        with self.bank.reading() as buf:
            if self.stackable:
                fast = self._score_named_rows(inputs, buf)
                if fast is not None:
                    return fast
            groups: dict[int, tuple[nn.Module, list[int]]] = {}
            row_of: dict[int, int] = {}
            rest: list[int] = []
            for i, inp in enumerate(inputs):
                model = self.folded.model_for(inp.rows, buf, inp.row)
                if model is None:
                    rest.append(i)
                else:
                    groups.setdefault(id(model), (model, []))[1].append(i)
                    row_of.setdefault(id(model), inp.row if inp.row is not None else int(inp.rows[0]))
            if len(groups) > 1 and self.stackable:
                # several folded slots (or the plain model) in one batch: the trunk once, the
                # slots' heads and adapted wide tables stacked (`_forward_stacked`)
                idx = [i for _, ix in groups.values() for i in ix]
                part = [inputs[i] for i in idx]
                models = [m for m, _ in groups.values()]
                sizes = [sum(inputs[i].dense.shape[0] for i in ix) for _, ix in groups.values()]
                # the stacked weights of these folds as this buffer holds them now: a swap that
                # rewrites a fold in place bumps its row's version
                rows = [row_of[k] for k in groups]
                key = (id(buf), *((r, buf.version[r] if r < len(buf.version) else -1) for r in rows))
                p_all = self._forward_stacked(part, models, sizes, key)
                for i, p in zip(idx, self._split(part, p_all), strict=True):
                    out[i] = p
            else:
                for model, ix in groups.values():
                    part = [inputs[i] for i in ix]
                    for i, p in zip(ix, self._split(part, self._forward(part, False, model)), strict=True):
                        out[i] = p
        if rest:
            part = [inputs[i] for i in rest]
            for i, p in zip(rest, self._split(part, self._forward(part, True)), strict=True):
                out[i] = p
        return [p if p is not None else np.zeros(0) for p in out]

    def _score_named_rows(self, inputs: list[RankInput], buf: BankBuffers) -> list[np.ndarray] | None:
        """The folded path when every input names its shared row (`RankInput.row`, as the ad
        server gives it) and every row is folded or empty: the inputs grouped by row in one
        stacked pass (`_forward_stacked`), grouped with plain ints and each row's fold looked up
        once. None where that does not hold (the general path decides per input)."""
        null = self.folded.null_rows
        groups: dict[int, list[int]] = {}
        for i, inp in enumerate(inputs):
            r = inp.row
            if r is None:
                return None
            groups.setdefault(-1 if r in null else r, []).append(i)
        models: list[nn.Module] = []
        key: list[Any] = [id(buf)]
        versions = buf.version
        for r in groups:
            if r == -1:
                models.append(self.folded.plain)
                key.append((-1, -1))
                continue
            fold = buf.folded.get(r)
            if fold is None:
                return None
            models.append(fold[0])
            key.append((r, versions[r] if r < len(versions) else -1))
        if len(models) == 1:  # one model for the whole batch: its own forward
            return self._split(inputs, self._forward(inputs, False, models[0]))
        idx = [i for ix in groups.values() for i in ix]
        part = [inputs[i] for i in idx]
        counts = [inp.dense.shape[0] for inp in part]
        sizes: list[int] = []
        start = 0
        for ix in groups.values():
            sizes.append(sum(counts[start : start + len(ix)]))
            start += len(ix)
        p_all = self._forward_stacked(part, models, sizes, tuple(key))
        out: list[np.ndarray] = [p_all] * len(inputs)
        at = 0
        for i, n in zip(idx, counts, strict=True):
            out[i] = p_all[at : at + n]
            at += n
        return out

    def _stacked(self, models: list[nn.Module]) -> Stacked:
        """The models' heads [models, in] and biases, and per wide table (id column, rows per
        model or 0 when no model adapts it, the table flat: stacked where adapted)."""
        plain = self.folded.plain
        assert isinstance(plain, Ranker)  # `stackable`
        rankers = [m for m in models if isinstance(m, Ranker)]
        assert len(rankers) == len(models)  # the folds are copies of the plain ranker
        head_w = torch.cat([r.head.weight for r in rankers]).detach()  # [models, in], as nn.Linear
        head_b = torch.cat([r.head.bias for r in rankers]).detach()
        combined = self._combined(rankers)
        skip = set(self.combined_names) if combined is not None else set()
        wide: list[tuple[int, int, torch.Tensor]] = []
        for col, name in enumerate(ID_COLUMNS):
            if name not in plain.wide or name in skip:
                continue
            tables = [_table(r, name) for r in rankers]
            if all(t is tables[0] for t in tables):  # not adapted: the plain model's own
                wide.append((col, 0, tables[0].detach().view(-1)))
            else:
                wide.append((col, tables[0].shape[0], torch.cat(tables).detach().view(-1)))
        return head_w, head_b, wide, combined

    def _combined(self, rankers: list[Ranker]) -> Combined | None:
        """The adapted wide tables of each model summed over every combination of their ids
        (`t₁[i] + t₂[j] + …` at `i·s₁ + j·s₂ + …`), the models' tables one after another; None
        when there are none or their rows multiply past `COMBINED_MAX` (each table is then
        gathered on its own, `_add_wide`). The plain model alone is combined the same way, so
        the base and the slots' folds do the same wide work but for the models' offsets."""
        names = [n for n in self.combined_names if n in rankers[0].wide]
        if not names:
            return None
        sizes = [_table(rankers[0], n).shape[0] for n in names]
        per = int(np.prod(sizes))
        if per > COMBINED_MAX:
            return None
        strides = [int(np.prod(sizes[k + 1 :])) for k in range(len(sizes))]
        cols = [(ID_COLUMNS.index(n), st) for n, st in zip(names, strides, strict=True)]
        blocks = []
        for r in rankers:
            first = _table(r, names[0])
            block = torch.zeros(sizes, dtype=first.dtype, device=first.device)
            for k, n in enumerate(names):
                shape = [1] * len(names)
                shape[k] = sizes[k]
                block += _table(r, n).detach().view(shape)
            blocks.append(block.view(-1))
        return cols, per, torch.cat(blocks)

    def _forward_stacked(
        self, inputs: list[RankInput], models: list[nn.Module], sizes: list[int], key: Any = None
    ) -> np.ndarray:
        """pCTR of the inputs' candidates in input order, the first `sizes[0]` candidates scored
        by `models[0]` and so on, in one pass: the plain model's trunk (`head_input`) once for
        all of them, then each model's head on its candidates and each adapted wide table
        stacked row-wise (one gather). Equal to one forward per model when every adapted layer
        only adds to the logit (`stackable`): the folds differ from the plain model only there.
        The folds are read under the caller's `bank.reading()`; their stacked copies are kept
        under `key` (the buffer and its rows' versions: a swap's rewrite makes a new key)."""
        plain = self.folded.plain
        assert isinstance(plain, Ranker)  # `stackable`
        got = self._stacks.get(key) if key is not None else None
        if got is None:
            got = self._stacked(models)
            if key is not None:
                if len(self._stacks) >= STACK_CACHE:
                    self._stacks.clear()
                self._stacks[key] = got
        head_w, head_b, wide, combined = got
        dense = torch.cat([i.dense for i in inputs]).to(self.device, non_blocking=True)
        ids = torch.cat([i.ids for i in inputs]).to(self.device, non_blocking=True)
        offset = self._offsets(inputs)
        if offset is not None:
            offset = offset.to(self.device, non_blocking=True)
        bounds = [0, *np.cumsum(sizes).tolist()]
        n = dense.shape[0]
        chunk = self._chunk() if self.device.type == "cpu" else max(1, n)
        # the trunk in chunks (each chunk's activations stay in cache), each model's head on its
        # rows of the chunk (the candidates come grouped by model: one GEMV each, as cheap as one
        # over the chunk; a [models, in] GEMM is not) into one logit vector
        logit = torch.empty(n, dtype=head_w.dtype, device=self.device)
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            h = self._head_input(dense[start:stop], ids[start:stop])
            for j in range(len(models)):
                lo, hi = max(bounds[j], start), min(bounds[j + 1], stop)
                if lo < hi:
                    torch.addmv(head_b[j], h[lo - start : hi - start], head_w[j], out=logit[lo:hi])
        RankModel._add_wide(logit, ids, wide, bounds)
        if combined is not None:
            RankModel._add_combined(logit, ids, combined, bounds)
        if offset is not None:
            logit += offset
        return torch.sigmoid_(logit).float().cpu().numpy()

    def _chunk(self) -> int:
        """Candidates per forward pass on the CPU: `trace_rows` through the traced ranker,
        `chunk` through the eager one."""
        if self._trunk is not None and self.trace_rows > 0:
            return max(1, min(self.chunk, self.trace_rows))
        return max(1, self.chunk)

    def _head_input(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`head_input` of the plain model, which is every fold's (`stackable`): through the
        traced trunk when it is on (its passes are cut at `trace_rows`: `_chunk`)."""
        if self._trunk is not None and self.trace_rows > 0:
            return run_traced(self._trunk, dense, ids)
        plain = self.folded.plain
        assert isinstance(plain, Ranker)
        return plain.head_input(dense, ids)

    @staticmethod
    def _add_wide(logit: torch.Tensor, ids: torch.Tensor, wide: Wide, bounds: list[int]) -> None:
        """Each wide table's bias added to `logit` in place, once over the whole batch (a gather
        each): an adapted table's rows stacked per model, the candidate's model (its block of
        `bounds`) picking its block of the table."""
        which: torch.Tensor | None = None
        for col, rows, table in wide:
            if rows == 0:
                logit += table.index_select(0, ids[:, col])
                continue
            if which is None:
                which = torch.empty(logit.shape[0], dtype=torch.int64, device=logit.device)
                for j in range(len(bounds) - 1):
                    which[bounds[j] : bounds[j + 1]] = j
            logit += table.index_select(0, torch.add(ids[:, col], which, alpha=rows))

    @staticmethod
    def _add_combined(logit: torch.Tensor, ids: torch.Tensor, combined: Combined, bounds: list[int]) -> None:
        """The combined adapted tables' sum added to `logit` in place: one index from the id
        columns (their strides), each model's block of candidates offset to its table, one gather."""
        cols, per, table = combined
        col, stride = cols[0]
        idx = ids[:, col] * stride
        for col, stride in cols[1:]:
            idx.add_(ids[:, col], alpha=stride)
        for j in range(1, len(bounds) - 1):
            if bounds[j] < bounds[j + 1]:
                idx[bounds[j] : bounds[j + 1]] += j * per
        logit += table.index_select(0, idx)

    def _forward(
        self, inputs: list[RankInput], use_adapters: bool, model: nn.Module | None = None
    ) -> np.ndarray:
        """pCTR of the inputs' candidates in input order: through the banked model (with or
        without adapters), or through `model` (a folded copy or the plain base) when given."""
        dense = torch.cat([i.dense for i in inputs]) if len(inputs) > 1 else inputs[0].dense
        ids = torch.cat([i.ids for i in inputs]) if len(inputs) > 1 else inputs[0].ids
        offset = self._offsets(inputs)
        rows = None
        order = None
        if use_adapters:
            rows = torch.cat([i.rows for i in inputs]) if len(inputs) > 1 else inputs[0].rows
            if self.ctx.needs_plan:  # only the merged/per-sample factor paths care about order
                order = self.ctx.order(rows)
                dense, ids, rows = (
                    dense.index_select(0, order),
                    ids.index_select(0, order),
                    rows.index_select(0, order),
                )
                if offset is not None:
                    offset = offset.index_select(0, order)
        dense, ids = dense.to(self.device, non_blocking=True), ids.to(self.device, non_blocking=True)
        if rows is not None:
            rows = rows.to(self.device)
        if offset is not None:
            offset = offset.to(self.device, non_blocking=True)
        chunk = self._chunk() if self.device.type == "cpu" else max(1, dense.shape[0])
        parts = []
        for start in range(0, max(1, dense.shape[0]), chunk):
            sl = slice(start, start + chunk)
            if model is not None and self._scorer is not None and self.trace_rows > 0:
                # a fold or the plain model: the traced forward with its head and tables
                assert isinstance(model, Ranker)
                d, i = dense[sl], ids[sl]
                tables = tuple(model.wide[name].weight for name in self._wide_names)
                logit = run_traced(self._scorer, d, i, model.head.weight, model.head.bias, tables)
            elif model is not None:
                logit = model(dense[sl], ids[sl])
            else:
                with self.ctx.use(self.bank, None if rows is None else rows[sl]):
                    logit = self.model(dense[sl], ids[sl])
            if offset is not None:
                logit = logit + offset[sl]
            parts.append(torch.sigmoid(logit).float())
        p = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu()
        if order is not None:
            p = torch.empty_like(p).index_copy_(0, order, p)
        return p.numpy()

    @staticmethod
    def _offsets(inputs: list[RankInput]) -> torch.Tensor | None:
        """The candidates' logit offsets in input order (zeros for inputs without), or None
        when no input has any."""
        if all(i.offset is None for i in inputs):
            return None
        return torch.cat(
            [
                i.offset if i.offset is not None else torch.zeros(i.dense.shape[0], dtype=torch.float32)
                for i in inputs
            ]
        )

    @staticmethod
    def _split(inputs: list[RankInput], p: np.ndarray) -> list[np.ndarray]:
        out, start = [], 0
        for i in inputs:
            n = i.dense.shape[0]
            out.append(p[start : start + n])
            start += n
        return out

    def warmup(self, n: int = 512, rounds: int = 3) -> None:
        """Run the forward paths once (allocator, kernels, lazy init) before taking traffic."""
        cfg = self.config
        dense = torch.zeros(n, cfg.dense_dim)
        ids = torch.zeros(n, 7, dtype=torch.int64)
        rows = torch.arange(n) % (self.bank.stride * 2)
        for _ in range(rounds):
            self.score([RankInput(dense, ids, rows)], use_adapters=True)
            self.score([RankInput(dense, ids, torch.zeros(n, dtype=torch.int64))], use_adapters=True)
            self.score([RankInput(dense, ids, rows)], use_adapters=False)
            # a one-request batch's second pass: its served ads at their positions
            small = torch.zeros(10, dtype=torch.int64)
            self.score([RankInput(dense[:10], ids[:10], small)], use_adapters=True)
