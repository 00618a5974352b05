"""The adapter bank: every LoRA adapter of a replica stacked into per-layer tensors, so one batch
can mix any number of adapters; double-buffered so a swap is a reference change between batches.

Layout per adapted Linear layer (in → out, rank r): `Aᵀ [2·(N+1), in, r]`, `Bᵀ [2·(N+1), r, out]`.
Row `arm·(N+1) + slot` holds adapter `slot` (1 … N) of arm 0 (stable) or 1 (candidate); slot 0 of
each arm is all zeros (no adapter). A sample with row index `i` computes
`y = W x + b + scale · B[i] (A[i] x)`; the layers that do it are in `serving.banked`.

Narrow layers (`in·out ≤ r·(in+out)`: the ranker's `head`, 155 → 1, and small id tables such as
`wide.category`, 256 × 1) also keep the product `ΔWᵀ = scale·(B A)ᵀ [rows, in, out]`, written
with the factors on each swap: per sample that is `in·out` multiply-adds and one gather instead of
`r·(in+out)`, no larger in memory than the factors, and needs no batch plan (`LayerShape.dense`).
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from schemas.errors import AdapterError

log = logging.getLogger(__name__)
STABLE, CANDIDATE = 0, 1
Factors = tuple[torch.Tensor, torch.Tensor]  # one layer's LoRA (A [r, in], B [out, r])


@dataclass
class AdapterMeta:
    """What the bank knows of one adapter: versions per arm, last seq, freshness, rejections."""

    adapter_id: str
    slot: int
    base_version: str
    seq: int = -1
    version: str = ""
    stable_version: str = ""
    previous: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    # the weights the candidate row holds (written by `put` and `rollback`, owned by the bank)
    candidate: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    previous_version: str | None = None
    previous_seq: int = -1
    # the seq lineage (`AdapterDelta.epoch`) of the current and the previous version: a seq names
    # a version only within its epoch (a pin compares both)
    epoch: int | None = None
    previous_epoch: int | None = None
    updated_at: float = field(default_factory=time.time)
    rejected: int = 0


@dataclass(frozen=True)
class LayerShape:
    """An adapted Linear layer: its qualified name and its in/out widths."""

    name: str
    fan_in: int
    fan_out: int

    def dense(self, rank: int) -> bool:
        """Whether the bank keeps this layer's ΔW itself: no more numbers than its factors."""
        return self.fan_in * self.fan_out <= rank * (self.fan_in + self.fan_out)


class BankBuffers:
    """One copy of the bank's tables (factors, ΔW of narrow layers, row versions, readers)."""

    def __init__(self, shapes: list[LayerShape], rows: int, rank: int, device: torch.device) -> None:
        # both stored transposed (Aᵀ [rows, in, r], Bᵀ [rows, r, out]) so that, flattened, each row
        # of the tables is one input column's r weights / one rank direction's out weights
        self.a = {s.name: torch.zeros(rows, s.fan_in, rank, device=device) for s in shapes}
        self.b = {s.name: torch.zeros(rows, rank, s.fan_out, device=device) for s in shapes}
        # ΔWᵀ [rows, in, out] of the narrow layers, kept in step with a and b (`LayerShape.dense`)
        self.d = {
            s.name: torch.zeros(rows, s.fan_in, s.fan_out, device=device) for s in shapes if s.dense(rank)
        }
        # per row, the bank generation that wrote its content (equal content ⇔ equal version in
        # both copies): keys the merged-weight caches, so one adapter's update keeps the others'
        self.version = [0] * rows
        self.readers = 0  # batches bound to this copy (`AdapterStack.reading`)
        # row -> that row's adapter folded into a copy of the base model (`Folder`), written with
        # the row's factors, so a batch bound to this copy reads folds and factors of one swap
        self.folded: dict[int, Any] = {}

    def clone(self, copy_fold: Callable[[Any], Any] | None = None) -> BankBuffers:
        """A copy with the same weights, versions and (with `copy_fold`) folds, read by nobody."""
        twin = copy.copy(self)
        twin.a = {n: t.clone() for n, t in self.a.items()}
        twin.b = {n: t.clone() for n, t in self.b.items()}
        twin.d = {n: t.clone() for n, t in self.d.items()}
        twin.version = list(self.version)
        twin.folded = {r: copy_fold(f) for r, f in self.folded.items()} if copy_fold is not None else {}
        twin.readers = 0
        return twin


class Folder(Protocol):
    """Keeps some adapters folded into copies of the base model, per buffer and row
    (`serving.ranking.FoldedSlots`): the fold is computed once per write, off the lock, and
    written into each buffer's copy in place as part of the swap's change."""

    def folds_adapter(self, adapter_id: str) -> bool:
        """Whether this adapter's rows are kept folded."""
        ...

    def fold(self, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """The folded weights of an adapter's full (A, B) per layer."""
        ...

    def write(self, buf: BankBuffers, row: int, folded: Any) -> None:
        """Make `buf.folded[row]` hold `folded` (in place where it exists)."""
        ...

    def weights_of(self, fold: Any) -> Any:
        """What `fold` holds, in the form `fold` returns (for copying one row to another)."""
        ...

    def copy(self, fold: Any) -> Any:
        """An independent copy of one row's fold."""
        ...


@dataclass(frozen=True)
class PreparedWrite:
    """Full weights of one adapter, checked, with what its swap writes besides them
    (`AdapterStack.prepare`)."""

    adapter_id: str
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    deltas: Mapping[str, torch.Tensor]  # ΔWᵀ of the narrow layers
    folded: Any  # the folder's fold, or None (not folded, or the fold failed)


class AdapterStack:
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
        self.dense = frozenset(s.name for s in shapes if s.dense(rank))
        self.rank = rank
        self.scale = alpha / rank
        self.capacity = capacity
        self.max_norm = max_norm
        self.device = torch.device(device)
        self.stride = capacity + 1
        rows = 2 * self.stride
        self._buffers = [
            BankBuffers(shapes, rows, rank, self.device),
            BankBuffers(shapes, rows, rank, self.device),
        ]
        self._active = 0
        self._lock = threading.Lock()
        # changes made to the active copy that the other copy has yet to catch up with
        self._pending: list[tuple[Callable[[BankBuffers, int], None], int]] = []
        self.meta: dict[str, AdapterMeta] = {}
        self.free_slots: list[int] = []  # slots of evicted adapters, reused before new ones
        self.generation = 0
        self.swaps = 0
        # keeps some adapters folded into copies of the base, in both buffers (the rank model's
        # slot adapters: `serving.ranking.FoldedSlots`); None: no folds
        self.folder: Folder | None = None

    # -- reading ------------------------------------------------------------------------
    @property
    def active(self) -> BankBuffers:
        """The buffers batches read; replaced (never mutated) by a swap."""
        return self._buffers[self._active]

    @contextmanager
    def reading(self) -> Iterator[BankBuffers]:
        """The active buffers, held for one batch: until released, no swap writes into them."""
        with self._lock:
            buf = self.active
            buf.readers += 1
        try:
            yield buf
        finally:
            with self._lock:
                buf.readers -= 1

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
            if self.full:
                raise AdapterError(f"adapter bank is full ({self.capacity} adapters); raise capacity")
            slot = self.free_slots.pop() if self.free_slots else len(self.meta) + 1
            meta = AdapterMeta(adapter_id=adapter_id, slot=slot, base_version=base_version)
            self.meta[adapter_id] = meta
        return meta

    @property
    def full(self) -> bool:
        """Whether a new adapter needs another one evicted first."""
        return len(self.meta) >= self.capacity

    def evict(self, adapter_id: str) -> None:
        """Drop an adapter: its rows go back to zero (base model) in both arms and its slot is
        reused by the next new adapter (one swap)."""
        meta = self.meta.pop(adapter_id, None)
        if meta is None:
            return
        zeros = {
            n: (
                torch.zeros(self.rank, s.fan_in, device=self.device),
                torch.zeros(s.fan_out, self.rank, device=self.device),
            )
            for n, s in self.shapes.items()
        }
        self._write([meta.slot, self.stride + meta.slot], zeros, fold=False)
        self.free_slots.append(meta.slot)

    def _swap(self, change: Callable[[BankBuffers, int], None]) -> None:
        """Apply `change` to the inactive copy and make it the active one (one swap).

        The copy batches may still be reading is left alone until the next swap, which first
        replays this change onto it; if a batch still holds it then (one batch spanning two
        swaps), that swap writes a fresh copy instead: a bound batch never sees weights move.
        """
        with self._lock:
            version = self.generation + 1
            inactive = self._buffers[1 - self._active]
            if inactive.readers:
                copy_fold = self.folder.copy if self.folder is not None else None
                inactive = self._buffers[1 - self._active] = self.active.clone(copy_fold)
            else:
                for pending, pending_version in self._pending:
                    pending(inactive, pending_version)
            change(inactive, version)
            self._pending = [(change, version)]
            self._active = 1 - self._active
            self.swaps += 1
            self.generation = version

    def prepare(
        self, adapter_id: str, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> PreparedWrite:
        """Everything a write of full weights needs before its swap, and nothing that changes the
        bank, so it may run off the event loop: the checks (AdapterError), the weights on the
        bank's device (layers not given are zero), the narrow layers' ΔW and, for an adapter the
        folder keeps folded, its fold."""
        self.check(weights)
        full = {
            n: weights.get(n) or (torch.zeros(self.rank, s.fan_in), torch.zeros(s.fan_out, self.rank))
            for n, s in self.shapes.items()
        }
        full = {n: (self._own(a), self._own(b)) for n, (a, b) in full.items()}
        fold = self.folder is not None and self.folder.folds_adapter(adapter_id)
        return self._prepared(full, fold, adapter_id)

    def _own(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as float32 on the bank's device, in memory only the bank holds (a caller's tensor
        may change after `put`; the bank keeps what it wrote, for `rollback`)."""
        out = t.to(self.device, torch.float32)
        return out.clone() if out.data_ptr() == t.data_ptr() else out

    def _prepared(
        self, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]], fold: bool, adapter_id: str = ""
    ) -> PreparedWrite:
        deltas = {n: (self.scale * (b @ a)).T for n, (a, b) in weights.items() if n in self.dense}
        folded = None
        if self.folder is not None and fold:
            try:  # a failed fold leaves the rows to the banked path
                folded = self.folder.fold(weights)
            except Exception:
                log.exception("folding an adapter failed; the banked path scores its rows")
        return PreparedWrite(adapter_id, weights, deltas, folded)

    def _write(
        self, rows: list[int], weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]], *, fold: bool
    ) -> None:
        """Write full weights into some rows (one swap); with `fold`, their folds too (else the
        rows' folds go, and the banked path scores them)."""
        self._write_prepared(rows, self._prepared(weights, fold))

    def _write_prepared(self, rows: list[int], prepared: PreparedWrite) -> None:
        """Write what `prepare` made into some rows (one swap)."""
        weights, deltas, folded, folder = prepared.weights, prepared.deltas, prepared.folded, self.folder

        if len(rows) == 1:  # the usual delta: one arm's row
            row = rows[0]

            def put_rows(table: torch.Tensor, value: torch.Tensor) -> None:
                table[row].copy_(value)
        else:  # both arms: one indexed write per table
            index = torch.tensor(rows, device=self.device)

            def put_rows(table: torch.Tensor, value: torch.Tensor) -> None:
                table.index_copy_(0, index, value.expand(len(rows), *value.shape))

        def change(buf: BankBuffers, version: int) -> None:
            for name, (a, b) in weights.items():
                put_rows(buf.a[name], a.T)
                put_rows(buf.b[name], b.T)
            for name, delta in deltas.items():
                put_rows(buf.d[name], delta)
            for r in rows:
                buf.version[r] = version
            if folder is not None:
                self._write_folds(folder, buf, {r: folded for r in rows})

        self._swap(change)

    @staticmethod
    def _write_folds(folder: Folder, buf: BankBuffers, folds: Mapping[int, Any]) -> None:
        """Rows' folds written into `buf` (None: the row's fold goes); a write that fails drops
        the row's fold, so a batch never reads a half-written one."""
        for r, folded in folds.items():
            if folded is None:
                buf.folded.pop(r, None)
                continue
            try:
                folder.write(buf, r, folded)
            except Exception:
                buf.folded.pop(r, None)
                log.exception("writing an adapter's fold failed; the banked path scores row %d", r)

    def put(
        self,
        adapter_id: str,
        weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        *,
        version: str,
        seq: int,
        base_version: str,
        arms: tuple[int, ...] = (CANDIDATE,),
        epoch: int | None = None,
        prepared: PreparedWrite | None = None,
    ) -> AdapterMeta:
        """Check and install full weights of one adapter (layers not given are zero).

        On a failed check nothing changes and AdapterError says why (the rejection is counted).
        `prepared`: what `prepare` made of these weights (off the event loop); the swap is then
        all that is left to do here.
        """
        meta = self.meta.get(adapter_id)
        if prepared is None or prepared.adapter_id != adapter_id:
            try:
                prepared = self.prepare(adapter_id, weights)
            except AdapterError:
                if meta is not None:
                    meta.rejected += 1
                raise
        meta = self._slot_for(adapter_id, base_version)
        if meta.seq >= 0:
            current = meta.candidate
            meta.previous = current if current is not None else self.weights(adapter_id, CANDIDATE)
            meta.previous_version, meta.previous_seq = meta.version, meta.seq
            meta.previous_epoch = meta.epoch
        self._write_prepared([arm * self.stride + meta.slot for arm in arms], prepared)
        if CANDIDATE in arms:
            meta.candidate = prepared.weights
        meta.version, meta.seq, meta.base_version = version, seq, base_version
        meta.epoch = epoch
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
        fold = self.folder is not None and self.folder.folds_adapter(adapter_id)
        self._write([meta.slot, self.stride + meta.slot], prev, fold=fold)
        meta.candidate = prev
        meta.version = meta.stable_version = prev_version
        meta.seq = prev_seq
        meta.epoch = meta.previous_epoch
        meta.updated_at = time.time()
        return meta

    def promote(self) -> None:
        """Candidate arm becomes the stable arm for every adapter (one swap)."""

        # only the held adapters' rows: every other row is zero in both arms (a removed
        # adapter's rows are zeroed), and copying whole tables costs the loop time that grows
        # with `adapter_capacity` (4 ms of a swap's pause at 2,048), not with what it holds
        slots = sorted(meta.slot for meta in self.meta.values())
        stable_rows = torch.tensor(slots, dtype=torch.int64, device=self.device)
        candidate_rows = stable_rows + self.stride

        def change(buf: BankBuffers, version: int) -> None:
            if slots:
                for tables in (buf.a, buf.b):
                    for name in self.shapes:
                        tables[name].index_copy_(0, stable_rows, tables[name].index_select(0, candidate_rows))
                for name in self.dense:
                    buf.d[name].index_copy_(0, stable_rows, buf.d[name].index_select(0, candidate_rows))
            for r in slots:
                buf.version[r] = version
            folder = self.folder
            if folder is not None:  # each stable row's fold becomes its candidate row's
                stable = {r for r in buf.folded if r < self.stride}
                stable |= {r - self.stride for r in buf.folded if r >= self.stride}
                self._write_folds(
                    folder,
                    buf,
                    {
                        r: None if (f := buf.folded.get(self.stride + r)) is None else folder.weights_of(f)
                        for r in stable
                    },
                )

        self._swap(change)
        for meta in self.meta.values():
            meta.stable_version = meta.version
