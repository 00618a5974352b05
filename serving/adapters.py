"""The adapter bank: every LoRA adapter of a replica stacked into per-layer tensors, so one batch
can mix any number of adapters; double-buffered so a swap is a reference change between batches.

Layout per adapted Linear layer (in → out, rank r): `Aᵀ [2·(N+1), in, r]`, `Bᵀ [2·(N+1), r, out]`.
Row `arm·(N+1) + slot` holds adapter `slot` (1 … N) of arm 0 (stable) or 1 (candidate); slot 0 of
each arm is all zeros (no adapter). A sample with row index `i` computes
`y = W x + b + scale · B[i] (A[i] x)`; see `BankedLinear`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from schemas.errors import AdapterError

STABLE, CANDIDATE = 0, 1


@dataclass
class AdapterMeta:
    """What the bank knows of one adapter: versions per arm, last seq, freshness, rejections."""

    adapter_id: str
    slot: int
    base_version: str
    seq: int = -1
    version: str = ""
    stable_version: str = ""
    previous: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    previous_version: str | None = None
    previous_seq: int = -1
    updated_at: float = field(default_factory=time.time)
    rejected: int = 0


@dataclass(frozen=True)
class LayerShape:
    """An adapted Linear layer: its qualified name and its in/out widths."""

    name: str
    fan_in: int
    fan_out: int


class _Buffers:
    def __init__(self, shapes: list[LayerShape], rows: int, rank: int, device: torch.device) -> None:
        # both stored transposed (Aᵀ [rows, in, r], Bᵀ [rows, r, out]) so that, flattened, each row
        # of the tables is one input column's r weights / one rank direction's out weights
        self.a = {s.name: torch.zeros(rows, s.fan_in, rank, device=device) for s in shapes}
        self.b = {s.name: torch.zeros(rows, rank, s.fan_out, device=device) for s in shapes}


class AdapterBank:
    """Stacked LoRA weights of up to `capacity` adapters × 2 arms, with guarded, swapped updates."""

    def __init__(
        self,
        shapes: list[LayerShape],
        rank: int,
        alpha: float,
        capacity: int,
        max_norm: float,
        device: torch.device | str = "cpu",
    ) -> None:
        self.shapes = {s.name: s for s in shapes}
        self.rank = rank
        self.scale = alpha / rank
        self.capacity = capacity
        self.max_norm = max_norm
        self.device = torch.device(device)
        self.stride = capacity + 1
        rows = 2 * self.stride
        self._buffers = [_Buffers(shapes, rows, rank, self.device), _Buffers(shapes, rows, rank, self.device)]
        self._active = 0
        self._lock = threading.Lock()
        self.meta: dict[str, AdapterMeta] = {}
        self.generation = 0
        self.swaps = 0

    # -- reading ------------------------------------------------------------------------
    @property
    def active(self) -> _Buffers:
        """The buffers batches read; replaced (never mutated) by a swap."""
        return self._buffers[self._active]

    def row(self, adapter_id: str | None, arm: int) -> int:
        """The row index of an adapter in an arm (0-row of the arm when unknown)."""
        meta = self.meta.get(adapter_id) if adapter_id is not None else None
        return arm * self.stride + (meta.slot if meta else 0)

    def weights(self, adapter_id: str, arm: int = CANDIDATE) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Copies of one adapter's (A, B) per layer in an arm."""
        i = self.row(adapter_id, arm)
        buf = self.active
        return {n: (buf.a[n][i].T.clone(), buf.b[n][i].T.clone()) for n in self.shapes}

    # -- checking -----------------------------------------------------------------------
    def check(self, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Shape, dtype, finite and norm checks of full adapter weights; returns the ΔW norm.

        The norm is the Frobenius norm of `scale · B A` summed over layers (what changes in W).
        """
        unknown = sorted(set(weights) - set(self.shapes))
        if unknown:
            raise AdapterError(f"adapter names unknown layers {unknown} (known: {sorted(self.shapes)})")
        total = 0.0
        for name, (a, b) in weights.items():
            s = self.shapes[name]
            if tuple(a.shape) != (self.rank, s.fan_in) or tuple(b.shape) != (s.fan_out, self.rank):
                raise AdapterError(
                    f"layer {name!r}: shape A{tuple(a.shape)} B{tuple(b.shape)} does not fit "
                    f"A({self.rank}, {s.fan_in}) B({s.fan_out}, {self.rank})"
                )
            if not (a.is_floating_point() and b.is_floating_point()):
                raise AdapterError(
                    f"layer {name!r}: weights must be floating point (got {a.dtype}, {b.dtype})"
                )
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise AdapterError(f"layer {name!r}: non-finite values; the adapter seems to be broken")
            total += float(torch.linalg.matrix_norm(self.scale * (b.double() @ a.double()))) ** 2
        norm = math.sqrt(total)
        if norm > self.max_norm:
            raise AdapterError(f"adapter ΔW norm {norm:.3g} exceeds the bound {self.max_norm:.3g}")
        return norm

    # -- writing ------------------------------------------------------------------------
    def _slot_for(self, adapter_id: str, base_version: str) -> AdapterMeta:
        meta = self.meta.get(adapter_id)
        if meta is None:
            if len(self.meta) >= self.capacity:
                raise AdapterError(f"adapter bank is full ({self.capacity} adapters); raise capacity")
            meta = AdapterMeta(adapter_id=adapter_id, slot=len(self.meta) + 1, base_version=base_version)
            self.meta[adapter_id] = meta
        return meta

    def _write(self, rows: list[int], weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write into the inactive buffers, swap, then bring the other copy up to date."""
        with self._lock:
            inactive = self._buffers[1 - self._active]
            for name, (a, b) in weights.items():
                for r in rows:
                    inactive.a[name][r].copy_(a.T)
                    inactive.b[name][r].copy_(b.T)
            self._active = 1 - self._active
            self.swaps += 1
            stale = self._buffers[1 - self._active]
            for name, (a, b) in weights.items():
                for r in rows:
                    stale.a[name][r].copy_(a.T)
                    stale.b[name][r].copy_(b.T)
            self.generation += 1

    def put(
        self,
        adapter_id: str,
        weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        *,
        version: str,
        seq: int,
        base_version: str,
        arms: tuple[int, ...] = (CANDIDATE,),
    ) -> AdapterMeta:
        """Check and install full weights of one adapter (layers not given are zero).

        On a failed check nothing changes and AdapterError says why (the rejection is counted).
        """
        meta = self.meta.get(adapter_id)
        try:
            self.check(weights)
        except AdapterError:
            if meta is not None:
                meta.rejected += 1
            raise
        meta = self._slot_for(adapter_id, base_version)
        full = {
            n: weights.get(n) or (torch.zeros(self.rank, s.fan_in), torch.zeros(s.fan_out, self.rank))
            for n, s in self.shapes.items()
        }
        full = {
            n: (a.to(self.device, torch.float32), b.to(self.device, torch.float32))
            for n, (a, b) in full.items()
        }
        if meta.seq >= 0:
            meta.previous = self.weights(adapter_id, CANDIDATE)
            meta.previous_version, meta.previous_seq = meta.version, meta.seq
        self._write([arm * self.stride + meta.slot for arm in arms], full)
        meta.version, meta.seq, meta.base_version = version, seq, base_version
        if STABLE in arms:
            meta.stable_version = version
        meta.updated_at = time.time()
        return meta

    def rollback(self, adapter_id: str) -> AdapterMeta:
        """Put an adapter's previous weights back in both arms; AdapterError when there is none."""
        meta = self.meta.get(adapter_id)
        if meta is None:
            raise AdapterError(f"unknown adapter {adapter_id!r}")
        if meta.previous is None or meta.previous_version is None:
            raise AdapterError(f"adapter {adapter_id!r} has no previous version to roll back to")
        prev, prev_version, prev_seq = meta.previous, meta.previous_version, meta.previous_seq
        meta.previous = None
        meta.previous_version = None
        self._write([meta.slot, self.stride + meta.slot], prev)
        meta.version = meta.stable_version = prev_version
        meta.seq = prev_seq
        meta.updated_at = time.time()
        return meta

    def promote(self) -> None:
        """Candidate arm becomes the stable arm for every adapter (one swap)."""
        with self._lock:
            inactive = self._buffers[1 - self._active]
            for buf in (inactive,):
                for name in self.shapes:
                    buf.a[name][: self.stride].copy_(buf.a[name][self.stride :])
                    buf.b[name][: self.stride].copy_(buf.b[name][self.stride :])
            self._active = 1 - self._active
            self.swaps += 1
            stale = self._buffers[1 - self._active]
            for name in self.shapes:
                stale.a[name][: self.stride].copy_(stale.a[name][self.stride :])
                stale.b[name][: self.stride].copy_(stale.b[name][self.stride :])
            for meta in self.meta.values():
                meta.stable_version = meta.version
            self.generation += 1


class BankedLinear(nn.Module):
    """A Linear layer plus per-sample LoRA from the bank: rows come from `BankContext.rows`."""

    def __init__(self, base: nn.Linear, name: str, bank: AdapterBank, ctx: BankContext) -> None:
        super().__init__()
        self.base = base
        self.name = name
        self.bank = bank
        self.ctx = ctx
        self._merged: dict[tuple[int, int], torch.Tensor] = {}

    def merged(self, row: int) -> torch.Tensor:
        """W + scale·B·A of one bank row, cached until the bank changes."""
        key = (self.ctx.generation, row)
        w = self._merged.get(key)
        if w is None:
            if len(self._merged) > 64 or any(k[0] != key[0] for k in self._merged):
                self._merged.clear()
            buf = self.ctx.buffers
            delta = buf.b[self.name][row].T @ buf.a[self.name][row].T
            w = self._merged[key] = self.base.weight + self.bank.scale * delta
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.ctx.rows
        if rows is None:
            out: torch.Tensor = self.base(x)
            return out
        groups = self.ctx.groups
        if groups is not None:
            # few distinct adapters (e.g. one per slot): merged weights, as fast as the base layer
            if len(groups) == 1:
                return F.linear(x, self.merged(groups[0][0]), self.base.bias)
            y = x.new_empty(x.shape[0], self.base.out_features)
            for row, index in groups:
                assert index is not None
                y[index] = F.linear(x.index_select(0, index), self.merged(row), self.base.bias)
            return y
        # many adapters: a fused gather-and-weighted-sum (embedding_bag) over the flattened tables;
        # it never materialises per-sample weight copies (index_select + mul is 2×, bmm 5× slower)
        buf = self.ctx.buffers
        fan_in, rank = self.base.in_features, self.bank.rank
        a_table = buf.a[self.name].view(-1, rank)  # row (adapter, i) = A[adapter, :, i]
        b_table = buf.b[self.name].view(-1, self.base.out_features)  # row (adapter, j) = B[adapter, :, j]
        h = F.embedding_bag(self.ctx.bag_index(fan_in), a_table, per_sample_weights=x, mode="sum")
        lora = F.embedding_bag(self.ctx.bag_index(rank), b_table, per_sample_weights=h, mode="sum")
        base: torch.Tensor = self.base(x)
        return base.add_(lora, alpha=self.bank.scale)


class BankContext:
    """Per-forward state shared by the banked layers: the buffers snapshot and the sample rows."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None
        self.generation = -1
        self._bags: dict[int, torch.Tensor] = {}
        self.groups: list[tuple[int, torch.Tensor | None]] | None = None
        self.buffers: _Buffers

    def bag_index(self, width: int) -> torch.Tensor:
        """[n, width] indices `row·width + k` into a flattened table (cached per batch and width)."""
        index = self._bags.get(width)
        if index is None:
            assert self.rows is not None
            index = self.rows.unsqueeze(1) * width + torch.arange(width, device=self.rows.device)
            self._bags[width] = index
        return index

    @contextmanager
    def use(self, bank: AdapterBank, rows: torch.Tensor | None, group_limit: int = 8) -> Iterator[None]:
        """Bind one batch's rows (None = base model only) and the bank's current buffers."""
        self.buffers = bank.active  # a swap during this batch does not affect it
        self.generation = bank.generation
        self.rows = rows
        self.groups = None
        self._bags = {}
        if rows is not None:
            uniq = torch.unique(rows)
            if uniq.numel() == 1:
                self.groups = [(int(uniq[0]), None)]
            elif uniq.numel() <= group_limit:
                self.groups = [(int(u), (rows == u).nonzero().squeeze(1)) for u in uniq]
        try:
            yield
        finally:
            self.rows = None
            self.groups = None


def target_layers(model: nn.Module, targets: tuple[str, ...] | list[str]) -> list[LayerShape]:
    """The Linear layers of `model` a target list names: a target matches a module name exactly,
    as its last component, or as a prefix (`"cross"` adapts `cross.0`, `cross.1`, …)."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if any(name == t or name.endswith(f".{t}") or name.startswith(f"{t}.") for t in targets):
            found.append(LayerShape(name, module.in_features, module.out_features))
    if not found:
        raise AdapterError(f"no Linear layer of the model matches the LoRA targets {list(targets)}")
    return found


def install(model: nn.Module, bank: AdapterBank) -> BankContext:
    """Replace the bank's layers in `model` by BankedLinear (in place); returns their context."""
    ctx = BankContext()
    ctx.buffers = bank.active
    for name in bank.shapes:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = parent.get_submodule(child)
        if not isinstance(base, nn.Linear):
            raise AdapterError(f"layer {name!r} is {type(base).__name__}, not Linear")
        setattr(parent, child, BankedLinear(base, name, bank, ctx))
    return ctx
