"""Adapter hot swap: apply `AdapterDelta`s in `seq` order (checked by `trainers.delta.apply_delta`)
into the bank's inactive buffer and swap; re-sync from a snapshot on a gap; count everything.

An admin rollback *pins* the adapter at the version it rolled back to: later deltas for it are
counted (`pinned`) and not applied, so the next delta's seq gap cannot quietly re-sync the
rolled-back weights from the trainer's snapshot. `unpin` lifts the pin and marks the adapter for
a re-sync (the caller loads the latest snapshot). Pins are shared between replicas through Redis
(`serving.io.RedisIO.pins`); `sync_pins` makes a replica follow them.

The replica keeps each adapter's `AdapterState` (the trainers' layout) next to the bank rows that
serve it; `DeltaApplier.apply` is synchronous and runs between batches on the replica's loop.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from schemas.api import AdapterInfo
from schemas.errors import AdapterError
from schemas.events import AdapterDelta
from serving.adapters import CANDIDATE, STABLE, AdapterBank
from trainers.delta import AdapterState, SeqGapError, StaleDeltaError, apply_delta, empty_state

log = logging.getLogger(__name__)
SnapshotSource = Callable[[str], Awaitable[AdapterDelta | None]]


def version_of(state: AdapterState) -> str:
    """The version string of an adapter state (what responses and impressions carry)."""
    return f"seq-{state.seq}"


def to_weights(state: AdapterState) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`{"<m>.lora_A", "<m>.lora_B"}` tensors → bank weights `{m: (A, B)}`."""
    return {m: (state.tensors[f"{m}.lora_A"], state.tensors[f"{m}.lora_B"]) for m in state.modules}


@dataclass
class DeltaApplier:
    """Per-replica adapter states and the rules for applying deltas to them."""

    bank: AdapterBank
    base_version: str
    max_norm: float
    states: dict[str, AdapterState] = field(default_factory=dict)
    outcomes: Counter[str] = field(default_factory=Counter)
    needs_resync: set[str] = field(default_factory=set)
    last_delta_at: dict[str, float] = field(default_factory=dict)
    rejected_unknown: int = 0
    pinned: dict[str, int] = field(default_factory=dict)  # adapter → the seq it is pinned at
    unavailable_pins: set[tuple[str, int]] = field(default_factory=set)  # logged once each

    def _empty(self, adapter_id: str) -> AdapterState:
        shapes = {n: (s.fan_in, s.fan_out) for n, s in self.bank.shapes.items()}
        return empty_state(adapter_id, self.base_version, shapes, self.bank.rank)

    def apply(self, delta: AdapterDelta, arms: tuple[int, ...] = (CANDIDATE,)) -> str:
        """Apply one delta; returns the outcome (`applied`, `stale`, `gap`, `rejected`).

        A rejected delta leaves the served weights untouched; a gap marks the adapter for re-sync;
        a pinned adapter (admin rollback) ignores deltas until it is unpinned.
        """
        if delta.adapter_id in self.pinned:
            return self._count("pinned")
        state = self.states.get(delta.adapter_id) or self._empty(delta.adapter_id)
        try:
            new = apply_delta(state, delta, self.max_norm)
        except StaleDeltaError:
            return self._count("stale")
        except SeqGapError as exc:
            log.warning("adapter %s: %s", delta.adapter_id, exc)
            self.needs_resync.add(delta.adapter_id)
            return self._count("gap")
        except AdapterError as exc:
            log.warning("adapter %s: rejected delta seq %d: %s", delta.adapter_id, delta.seq, exc)
            meta = self.bank.meta.get(delta.adapter_id)
            if meta is not None:
                meta.rejected += 1
            else:
                self.rejected_unknown += 1
            return self._count("rejected")
        try:  # the bank checks again (shape, finite, ΔW norm) and counts its own rejections
            self.bank.put(
                delta.adapter_id,
                to_weights(new),
                version=version_of(new),
                seq=new.seq,
                base_version=new.base_version,
                arms=arms,
            )
        except AdapterError as exc:
            log.warning("adapter %s: bank refused seq %d: %s", delta.adapter_id, delta.seq, exc)
            return self._count("rejected")
        self.states[delta.adapter_id] = new
        self.needs_resync.discard(delta.adapter_id)
        self.last_delta_at[delta.adapter_id] = time.time()
        return self._count("applied")

    def _count(self, outcome: str) -> str:
        self.outcomes[outcome] += 1
        return outcome

    async def resync(self, adapter_id: str, source: SnapshotSource) -> str:
        """Load the adapter's latest snapshot (applies to any older state); `missing` if none."""
        snap = await source(adapter_id)
        if snap is None:
            return "missing"
        if not snap.snapshot:
            self.outcomes["rejected"] += 1
            return "rejected"
        return self.apply(snap)

    def rollback(self, adapter_id: str) -> AdapterInfo:
        """Serve the adapter's previous version again (both arms) and pin it there."""
        meta = self.bank.rollback(adapter_id)
        self.pinned[adapter_id] = meta.seq
        self.needs_resync.discard(adapter_id)
        state = self.states.get(adapter_id)
        if state is not None:
            self.states[adapter_id] = AdapterState(
                state.adapter_id,
                state.base_version,
                state.rank,
                meta.seq,
                {
                    **{f"{m}.lora_A": a for m, (a, _) in self.bank.weights(adapter_id, STABLE).items()},
                    **{f"{m}.lora_B": b for m, (_, b) in self.bank.weights(adapter_id, STABLE).items()},
                },
            )
        return self.info(adapter_id)

    def unpin(self, adapter_id: str) -> bool:
        """Lift an adapter's pin (True if it was pinned); it then needs a re-sync from its snapshot."""
        if self.pinned.pop(adapter_id, None) is None:
            return False
        self.needs_resync.add(adapter_id)
        return True

    def sync_pins(self, shared: dict[str, int]) -> list[str]:
        """Follow the replica-wide pins (`adapter → seq`); returns the adapters it unpinned (each
        needs a re-sync from its snapshot).

        A pin set by another replica is followed when this replica can serve that seq (it is the
        current or the kept previous version); otherwise it is logged and counted, not guessed.
        """
        lifted = [a for a in self.pinned if a not in shared]
        for adapter_id in lifted:
            self.unpin(adapter_id)
        for adapter_id, seq in shared.items():
            if self.pinned.get(adapter_id) == seq:
                continue
            meta = self.bank.meta.get(adapter_id)
            if meta is not None and meta.seq == seq:
                self.pinned[adapter_id] = seq
            elif meta is not None and meta.previous is not None and meta.previous_seq == seq:
                self.rollback(adapter_id)
            elif (adapter_id, seq) not in self.unavailable_pins:
                self.unavailable_pins.add((adapter_id, seq))
                self._count("pin_unavailable")
                log.warning("adapter %s: pinned at seq %d elsewhere, not held here", adapter_id, seq)
        return lifted

    def info(self, adapter_id: str) -> AdapterInfo:
        meta = self.bank.meta[adapter_id]
        return AdapterInfo(
            adapter_id=adapter_id,
            version=meta.version or "seq--1",
            seq=max(meta.seq, 0),
            previous_version=meta.previous_version,
            staleness_s=max(0.0, time.time() - meta.updated_at),
            rejected_deltas=meta.rejected,
            pinned=adapter_id in self.pinned,
        )

    def infos(self) -> list[AdapterInfo]:
        return [self.info(a) for a in sorted(self.bank.meta)]

    def max_staleness_s(self) -> float:
        now = time.time()
        return max((now - m.updated_at for m in self.bank.meta.values()), default=0.0)
