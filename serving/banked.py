"""The banked layers: a model's adapted Linear layers and id tables replaced by ones that add each
sample's LoRA from an `AdapterStack` (`install`), and the per-batch plan they share (`BankContext`).

Factor layers compute `scale · B[i] (A[i] x)`: adapters with many samples in a batch through
merged weights, the rest per sample (two fused gathers). Narrow layers (`LayerShape.dense`) add
the bank's stored ΔW row of each sample instead and need no plan.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

from schemas.errors import AdapterError
from serving.adapters import AdapterStack, BankBuffers, LayerShape


class _Banked(nn.Module):
    """What every banked layer holds: the wrapped layer, its bank name, the bank, the context,
    and whether the bank serves it from stored ΔW rows (`LayerShape.dense`)."""

    def __init__(self, base: nn.Module, name: str, bank: AdapterStack, ctx: BankContext) -> None:
        super().__init__()
        self.base = base
        self.name = name
        self.bank = bank
        self.ctx = ctx
        self.dense = name in bank.dense


class BankedLinear(_Banked):
    """A Linear layer plus per-sample LoRA from the bank, computed the way `BankContext` planned.

    Adapters with many samples in the batch go through merged weights `W + scale·B·A` (one
    GEMM per adapter over its contiguous rows: no LoRA cost beyond ~30 µs per call); the rest
    go through the per-sample path (base GEMM + two embedding_bag gathers of each sample's A
    and B). A narrow layer (`LayerShape.dense`) adds each sample's own ΔW row instead, whatever
    the plan.
    """

    base: nn.Linear

    def __init__(self, base: nn.Linear, name: str, bank: AdapterStack, ctx: BankContext) -> None:
        super().__init__(base, name, bank, ctx)
        self._merged: dict[tuple[int, int], torch.Tensor] = {}

    def merged(self, row: int) -> torch.Tensor:
        """W + scale·B·A of one bank row of the bound buffers, cached per (row, row version).

        Keyed by the row's own version, so an update of another adapter does not throw away
        the merged weights of the busy ones.
        """
        buf = self.ctx.buffers
        key = (row, buf.version[row])
        w = self._merged.get(key)
        if w is None:
            if len(self._merged) >= self.ctx.merged_cache:
                del self._merged[next(iter(self._merged))]  # oldest first
            delta = buf.b[self.name][row].T @ buf.a[self.name][row].T
            w = self._merged[key] = torch.add(self.base.weight, delta, alpha=self.bank.scale)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        if ctx.rows is None:
            out: torch.Tensor = self.base(x)
            return out
        if self.dense:
            return self._dense(x, ctx.rows)
        groups, tail = ctx.groups, ctx.tail
        if not groups:
            return self._per_sample(x, None)
        bias = self.base.bias
        if tail is None and len(groups) == 1:
            return F.linear(x, self.merged(groups[0][0]), bias)
        y = x.new_empty(x.shape[0], self.base.out_features)
        for row, where in groups:
            w = self.merged(row)
            if isinstance(where, slice):  # contiguous rows (the ranker sorts them so): no copies
                _linear_into(y[where], x[where], w, bias)
            else:
                y.index_copy_(0, where, F.linear(x.index_select(0, where), w, bias))
        if isinstance(tail, slice):
            self._per_sample(x[tail], y[tail])
        elif tail is not None:
            y.index_copy_(0, tail, self._per_sample(x.index_select(0, tail), None))
        return y

    def _dense(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Base + each sample's own ΔW row: `y = W x + b + ΔW[row] x` (any order of rows)."""
        table = self.ctx.buffers.d[self.name]  # ΔWᵀ [rows, in, out]
        y: torch.Tensor = self.base(x)
        n, fan_in, fan_out = x.shape[0], self.base.in_features, self.base.out_features
        if fan_out == 1:  # one dot product per sample: a batched [1, in] × [in, 1] (fastest measured)
            w = table.view(-1, fan_in).index_select(0, rows)
            return y.add_(torch.bmm(x.unsqueeze(1), w.unsqueeze(2)).view(n, 1))
        index = self.ctx.bag_index_of(rows, fan_in)
        return y.add_(F.embedding_bag(index, table.view(-1, fan_out), per_sample_weights=x, mode="sum"))

    def _per_sample(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Base + LoRA of each sample's own adapter (the tail rows), written into `out` if given.

        Two fused gather-and-weighted-sum passes (embedding_bag) over the flattened tables, so
        no per-sample weight copy is ever made, and with rows sorted by adapter each adapter's
        weights come from memory once and then from cache. Measured on one CPU thread (4,000
        candidates over 1,000 adapters), the LoRA term costs ~3× as much with a gathered weight
        copy + bmm per sample and ~2.5× with bmm over per-adapter chunks padded to 4 or 8 rows.
        """
        buf = self.ctx.buffers
        rank = self.bank.rank
        a_table = buf.a[self.name].view(-1, rank)  # row (adapter, i) = A[adapter, :, i]
        b_table = buf.b[self.name].view(-1, self.base.out_features)  # row (adapter, j) = B[adapter, :, j]
        h = F.embedding_bag(
            self.ctx.bag_index(self.base.in_features), a_table, per_sample_weights=x, mode="sum"
        )
        h.mul_(self.bank.scale)  # [n, r]: cheaper to scale than the [n, out] LoRA term
        lora = F.embedding_bag(self.ctx.bag_index(rank), b_table, per_sample_weights=h, mode="sum")
        # y = lora + b + x Wᵀ with the GEMM accumulating onto the LoRA term (one pass less than
        # a separate add); into `out` when given, so a slice of the layer's output needs no copy
        bias = self.base.bias
        if out is None:
            out = lora if bias is None else lora.add_(bias)
        elif bias is None:
            out.copy_(lora)
        else:
            torch.add(lora, bias, out=out)
        return out.addmm_(x, self.base.weight.T)


def _linear_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """`out = x Wᵀ + b` written into `out` (a row slice of the layer's output)."""
    if bias is None:
        torch.mm(x, weight.T, out=out)
    else:
        torch.addmm(bias, x, weight.T, out=out)


Where = slice | torch.Tensor


class BankContext:
    """Per-forward state shared by the banked layers: the bound buffers and the batch's plan.

    The plan (`use`) splits the samples into `groups`, adapters computed with merged weights,
    each `(row, where)`, and the `tail`, samples computed per sample; `where` is a slice when
    the samples are contiguous (after `order`), else an index tensor.
    """

    def __init__(self, group_limit: int = 8, merge_min: int = 64, merge_max: int = 32) -> None:
        self.group_limit = group_limit
        self.merge_min = merge_min
        self.merge_max = merge_max
        self.merged_cache = 4 * max(merge_max, group_limit)
        # whether any banked Linear reads the plan (groups/tail); `install` sets it
        self.needs_plan = True
        self.rows: torch.Tensor | None = None
        self.tail_rows: torch.Tensor | None = None
        self.generation = -1
        self._bags: dict[int, torch.Tensor] = {}
        self.groups: list[tuple[int, Where]] = []
        self.tail: Where | None = None
        self.buffers: BankBuffers

    def merge_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The bank rows of a batch to compute with merged weights, sorted.

        All of them when the batch has at most `group_limit` distinct rows (e.g. one adapter
        per slot); else the up to `merge_max` rows with at least `merge_min` samples (the heavy
        advertisers of skewed traffic), since merging pays off only over enough samples.
        """
        if rows.numel() == 0:
            return rows
        counts = torch.bincount(rows)
        present = counts.nonzero().squeeze(1)
        if present.numel() <= self.group_limit:
            return present
        heavy = (counts >= self.merge_min).nonzero().squeeze(1)
        if heavy.numel() > self.merge_max:
            top = torch.argsort(counts[heavy], descending=True, stable=True)[: self.merge_max]
            heavy = torch.sort(heavy[top]).values
        return heavy

    def order(self, rows: torch.Tensor) -> torch.Tensor:
        """A permutation of a batch that makes every `where` of its plan a slice: merged
        adapters first, then the tail, each sorted by bank row (which also keeps one adapter's
        samples adjacent, so its weights stay in cache)."""
        merged = self.merge_rows(rows)
        key = rows if merged.numel() == 0 else rows + (~torch.isin(rows, merged)) * (int(rows.max()) + 1)
        return torch.argsort(key, stable=True)

    def bag_index_of(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """[n, width] indices `row·width + k` for all of a batch's rows (id-table adapters)."""
        key = -width  # cached apart from the tail's indices of the same width
        index = self._bags.get(key)
        if index is None:
            index = rows.unsqueeze(1) * width + torch.arange(width, device=rows.device)
            self._bags[key] = index
        return index

    def bag_index(self, width: int) -> torch.Tensor:
        """[n, width] indices `row·width + k` into a flattened table for the tail rows (cached
        per batch and width)."""
        index = self._bags.get(width)
        if index is None:
            assert self.tail_rows is not None
            rows = self.tail_rows
            # int32 when it fits: half the index bytes to build and to read (~10% of the path)
            dtype = torch.int32 if len(self.buffers.version) * width < 2**31 else torch.int64
            index = rows.to(dtype).unsqueeze(1) * width + torch.arange(width, device=rows.device, dtype=dtype)
            self._bags[width] = index
        return index

    @contextmanager
    def use(self, bank: AdapterStack, rows: torch.Tensor | None) -> Iterator[None]:
        """Bind one batch's rows (None = base model only) and the bank's current buffers.

        Any order of `rows` is exact; the order of `order` avoids gathers and scatters.
        """
        with bank.reading() as buffers:
            self.buffers = buffers  # held for the batch: a swap meanwhile does not affect it
            self.generation = bank.generation
            self.rows = None if rows is None or rows.numel() == 0 else rows
            self.groups, self.tail, self.tail_rows = [], None, None
            self._bags = {}
            if self.rows is not None and self.needs_plan:
                self._plan(self.rows)
            try:
                yield
            finally:
                self.rows = self.tail_rows = None
                self.groups, self.tail = [], None
                self._bags = {}

    def _plan(self, rows: torch.Tensor) -> None:
        merged = self.merge_rows(rows)
        n = rows.shape[0]
        if merged.numel() == 0:
            self.tail, self.tail_rows = slice(0, n), rows
            return
        is_merged = torch.isin(rows, merged)
        lead = int(is_merged.sum())
        if bool(is_merged[:lead].all()):  # in `order`: merged rows first, one run each?
            runs, counts = torch.unique_consecutive(rows[:lead], return_counts=True)
            if runs.numel() == merged.numel():
                ends = torch.cumsum(counts, 0).tolist()
                starts = [0, *ends[:-1]]
                self.groups = [(r, slice(a, b)) for r, a, b in zip(runs.tolist(), starts, ends, strict=True)]
                if lead < n:
                    self.tail, self.tail_rows = slice(lead, n), rows[lead:]
                return
        for row in merged.tolist():  # any other order: index tensors (gathers and scatters)
            self.groups.append((row, _where((rows == row).nonzero().squeeze(1))))
        rest = (~is_merged).nonzero().squeeze(1)
        if rest.numel():
            self.tail = _where(rest)
            self.tail_rows = rows[self.tail]


def _where(index: torch.Tensor) -> Where:
    """A slice for sorted contiguous indices (the common case after `BankContext.order`)."""
    first, last = int(index[0]), int(index[-1])
    return slice(first, last + 1) if last - first + 1 == index.numel() else index


class BankedEmbedding(_Banked):
    """An id table plus per-sample LoRA from the bank, PEFT's embedding LoRA: a sample with bank
    row `a` looking up id `i` gets `E[i] + scale · B[a] A[a][:, i]` (A [r, num_embeddings],
    B [dim, r]; stored transposed like every bank table). Rows come from `BankContext.rows`.

    A small table (`LayerShape.dense`: `wide.category`, `wide.slot`, `wide.position`) adds the
    bank's stored row `ΔE[a][i]`, one gather per sample; a larger one gathers r values of A and
    then B (r·dim floats).
    """

    base: nn.Embedding

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(ids)
        rows = self.ctx.rows
        if rows is None:
            return out
        buf = self.ctx.buffers
        rank, dim = self.bank.rank, self.base.embedding_dim
        at = rows * self.base.num_embeddings + ids  # row (bank row, id) of a flattened table
        if self.dense:  # a small table: row `id` of each sample's ΔEᵀ, one gather
            return out.add_(buf.d[self.name].view(-1, dim).index_select(0, at))
        h = buf.a[self.name].view(-1, rank).index_select(0, at)  # column `id` of each sample's A: [n, r]
        h.mul_(self.bank.scale)
        b_table = buf.b[self.name].view(-1, dim)  # row (adapter, k) = B[adapter][:, k]
        lora = F.embedding_bag(self.ctx.bag_index_of(rows, rank), b_table, per_sample_weights=h, mode="sum")
        return out.add_(lora)


def _matches(name: str, targets: tuple[str, ...] | list[str]) -> bool:
    # the trainers' rule (`trainers.models.lora.target_modules`): a name or a prefix, nothing else, so
    # a replica adapts exactly the modules the trainer publishes
    return any(name == t or name.startswith(f"{t}.") for t in targets)


def target_layers(model: nn.Module, targets: tuple[str, ...] | list[str]) -> list[LayerShape]:
    """The Linear layers and id tables (Embedding) of `model` a target list names: a target
    matches a module name exactly or as a prefix (`"cross"` adapts `cross.0`, `cross.1`, …).
    An Embedding's shape is (num_embeddings, embedding_dim), PEFT's (in, out) of an embedding
    LoRA."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and _matches(name, targets):
            found.append(LayerShape(name, module.in_features, module.out_features))
        elif isinstance(module, nn.Embedding) and _matches(name, targets):
            found.append(LayerShape(name, module.num_embeddings, module.embedding_dim))
    if not found:
        raise AdapterError(
            f"no Linear or Embedding layer of the model matches the LoRA targets {list(targets)}"
        )
    return found


def install(model: nn.Module, bank: AdapterStack, ctx: BankContext | None = None) -> BankContext:
    """Replace the bank's layers in `model` by BankedLinear / BankedEmbedding (in place); returns
    their context."""
    ctx = ctx or BankContext()
    ctx.buffers = bank.active
    ctx.needs_plan = False
    for name in bank.shapes:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = parent.get_submodule(child)
        if isinstance(base, nn.Linear):
            setattr(parent, child, BankedLinear(base, name, bank, ctx))
            ctx.needs_plan = ctx.needs_plan or name not in bank.dense
        elif isinstance(base, nn.Embedding):
            setattr(parent, child, BankedEmbedding(base, name, bank, ctx))
        else:
            raise AdapterError(f"layer {name!r} is {type(base).__name__}, not Linear or Embedding")
    return ctx
