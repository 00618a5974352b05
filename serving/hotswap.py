"""Adapter hot swap: apply `AdapterDelta`s in `seq` order (checked by `schemas.delta.apply_delta`)
into the bank's inactive buffer and swap; re-sync from a snapshot on a gap; count everything.

An admin rollback *pins* the adapter at the version it rolled back to: later deltas for it are
counted (`pinned`) and not applied, so the next delta's seq gap cannot quietly re-sync the
rolled-back weights from the trainer's snapshot. `unpin` lifts the pin and marks the adapter for
a re-sync (the caller loads the latest snapshot). Pins are shared between replicas through Redis
(`serving.io.RedisIO.pins`); `sync_pins` makes a replica follow them.

The replica keeps each adapter's `AdapterState` (the trainers' layout) next to the bank rows that
serve it; `DeltaApplier.apply` is synchronous and runs between batches on the replica's loop.

Guards beyond `apply_delta`'s: with a signing `key`, only deltas the trainer signed are applied
(`unsigned` otherwise); live updates may move an adapter at most `max_drift` (L2 over its A and
B) from its promoted version (`drift`), so a chain of deltas each under the per-delta bound
cannot walk it anywhere; a full bank evicts the least recently updated unpinned adapter
(`evicted`). A rollback first `hold`s the adapter (no delta lands while the pin is stored) and
shares the rolled-back weights with the pin (`pinned_snapshot`), so a replica that does not hold
that seq installs exactly those weights.

Epochs (`schemas.delta` "Epochs"): a trainer that lost its seqs in Redis starts a new epoch.
Messages of an earlier epoch than the state's are ignored (`stale_epoch`); a signed snapshot of a
later epoch resets the adapter to it (under the same drift bound and canary arms as any update);
an incremental delta of a later epoch is refused (`new_epoch`) and the adapter re-synced from its
Redis snapshot. A pin names a seq, which repeats across epochs: a replica follows a pin by its own
versions only when the weights stored with the pin are of the same epoch, else it installs them.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import torch

from schemas.api import AdapterInfo
from schemas.delta import (
    AdapterState,
    EpochChangeError,
    SeqGapError,
    StaleDeltaError,
    StaleEpochError,
    apply_delta,
    describe_epoch,
    empty_state,
    full_parts,
    make_delta,
    resolve_signing_key,
    verify_delta,
)
from schemas.errors import AdapterError
from schemas.events import AdapterDelta
from schemas.settings import Settings
from serving.adapters import CANDIDATE, STABLE, AdapterStack, PreparedWrite

log = logging.getLogger(__name__)
SnapshotSource = Callable[[str], Awaitable[AdapterDelta | None]]


def version_of(state: AdapterState) -> str:
    """The version string of an adapter state (what responses and impressions carry)."""
    return f"seq-{state.seq}"


def to_weights(state: AdapterState) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`{"<m>.lora_A", "<m>.lora_B"}` tensors → bank weights `{m: (A, B)}`."""
    return {m: (state.tensors[f"{m}.lora_A"], state.tensors[f"{m}.lora_B"]) for m in state.modules}


def drift(state: AdapterState, reference: AdapterState | None) -> float:
    """L2 distance of an adapter's A and B factors from a reference state (zeros when None)."""
    total = 0.0
    for k, t in state.tensors.items():
        ref = reference.tensors.get(k) if reference is not None else None
        total += float((t if ref is None else t - ref).double().pow(2).sum())
    return math.sqrt(total)


@dataclass(frozen=True)
class Prepared:
    """What `DeltaApplier.prepare` made of a delta: the state it read, the state after the delta
    (None when it does not apply) and, then, the outcome and why."""

    state: AdapterState | None
    new: AdapterState | None
    outcome: str | None = None
    error: str = ""
    # the bank's half, done here too (checks, ΔW, the fold): None when the bank refuses the
    # weights (`commit` then lets the bank say why, at the point of the rules where it does)
    write: PreparedWrite | None = None
    # the new state's distance from the promoted one it was measured against (`commit` measures
    # again if the promoted version changed meanwhile)
    drift: float = 0.0
    drift_from: AdapterState | None = None


@dataclass
class DeltaApplier:
    """Per-replica adapter states and the rules for applying deltas to them."""

    bank: AdapterStack
    base_version: str
    max_norm: float
    key: bytes | None = None  # the trainer's signing key; None: unsigned deltas are accepted
    max_drift: float = math.inf  # bound on a live state's distance from its promoted version
    states: dict[str, AdapterState] = field(default_factory=dict)
    promoted: dict[str, AdapterState] = field(default_factory=dict)  # what the stable arm serves
    outcomes: Counter[str] = field(default_factory=Counter)
    needs_resync: set[str] = field(default_factory=set)
    last_delta_at: dict[str, float] = field(default_factory=dict)
    rejected_unknown: int = 0
    pinned: dict[str, int] = field(default_factory=dict)  # adapter → the seq it is pinned at
    held: set[str] = field(default_factory=set)  # a rollback is storing its pin: no delta lands
    unavailable_pins: set[tuple[str, int]] = field(default_factory=set)  # logged once each

    @classmethod
    def for_replica(cls, bank: AdapterStack, base_version: str, settings: Settings) -> DeltaApplier:
        """The applier a replica runs with `settings`: the trainer's per-delta norm bound and
        signing key, serving's drift bound (`serving.app.AdServer`, and the replay benchmark's
        replica, `benchmarks.online_drift`)."""
        return cls(
            bank,
            base_version,
            settings.online.delta_max_norm,
            key=resolve_signing_key(settings),
            max_drift=settings.serving.adapter_max_drift,
        )

    def _empty(self, adapter_id: str) -> AdapterState:
        shapes = {n: (s.fan_in, s.fan_out) for n, s in self.bank.shapes.items()}
        return empty_state(adapter_id, self.base_version, shapes, self.bank.rank)

    def apply(
        self, delta: AdapterDelta, arms: tuple[int, ...] = (CANDIDATE,), *, initial: bool = False
    ) -> str:
        """Apply one delta; returns the outcome (`applied`, `stale`, `stale_epoch`, `gap`,
        `new_epoch`, `rejected`, `unsigned`, `drift`, `pinned`).

        A rejected delta leaves the served weights untouched; a gap or a delta of a new epoch
        marks the adapter for re-sync; a pinned adapter (admin rollback) ignores deltas until it
        is unpinned; a message of an old epoch is ignored. `initial`: the
        start-up load of snapshots, which becomes the promoted version (no drift bound).
        `prepare` + `commit` are the same in two steps, the first of them safe off the loop.
        """
        return self.commit(delta, self.prepare(delta), arms, initial=initial)

    def prepare(self, delta: AdapterDelta) -> Prepared:
        """The costly, read-only half of `apply`: the signature (an HMAC over the payload), the
        safetensors decode and the checks, against the adapter's current state. It changes
        nothing, so a replica runs it in a worker thread for a large payload (a snapshot) while
        requests keep being served; `commit` then swaps on the loop."""
        aid = delta.adapter_id
        if aid in self.pinned or aid in self.held:
            return Prepared(None, None, "pinned")
        if self.key is not None:
            try:
                verify_delta(delta, self.key)
            except AdapterError as exc:
                return Prepared(None, None, "unsigned", str(exc))
        state = self.states.get(aid) or self._empty(aid)
        try:
            new = apply_delta(state, delta, self.max_norm)
        except StaleEpochError as exc:
            return Prepared(state, None, "stale_epoch", str(exc))
        except StaleDeltaError:
            return Prepared(state, None, "stale")
        except SeqGapError as exc:
            return Prepared(state, None, "gap", str(exc))
        except EpochChangeError as exc:
            return Prepared(state, None, "new_epoch", str(exc))
        except AdapterError as exc:
            return Prepared(state, None, "rejected", str(exc))
        promoted = self.promoted.get(aid)
        try:
            write: PreparedWrite | None = self.bank.prepare(aid, to_weights(new))
        except AdapterError:
            write = None
        return Prepared(state, new, write=write, drift=drift(new, promoted), drift_from=promoted)

    def commit(
        self,
        delta: AdapterDelta,
        prep: Prepared,
        arms: tuple[int, ...] = (CANDIDATE,),
        *,
        initial: bool = False,
    ) -> str:
        """Swap what `prepare` made into the bank (on the loop); the rest of `apply`'s rules.
        Redone on the loop when the adapter's state moved since `prepare` read it."""
        aid = delta.adapter_id
        if prep.state is not None and self.states.get(aid, prep.state) is not prep.state:
            return self.commit(delta, self.prepare(delta), arms, initial=initial)
        if aid in self.pinned or aid in self.held:
            return self._count("pinned")
        if prep.outcome is not None:
            return self._refused(delta, prep.outcome, prep.error)
        new = prep.new
        assert new is not None
        if not initial and STABLE not in arms:
            promoted = self.promoted.get(delta.adapter_id)
            moved = prep.drift if prep.drift_from is promoted else drift(new, promoted)
            if moved > self.max_drift:
                log.warning(
                    "adapter %r: delta seq %d would move it %.4g from its promoted version (bound %.4g)",
                    delta.adapter_id,
                    delta.seq,
                    moved,
                    self.max_drift,
                )
                self._rejected(delta.adapter_id)
                self.needs_resync.add(delta.adapter_id)  # after a promotion the snapshot may fit
                return self._count("drift")
        if delta.adapter_id not in self.bank.meta and self.bank.full and not self._evict_one():
            log.warning(
                "adapter %r: bank full of pinned adapters; delta seq %d dropped", delta.adapter_id, delta.seq
            )
            return self._count("rejected")
        try:  # the bank checks again (shape, finite, ΔW norm) and counts its own rejections
            self.bank.put(
                delta.adapter_id,
                to_weights(new),
                version=version_of(new),
                seq=new.seq,
                base_version=new.base_version,
                arms=(STABLE, CANDIDATE) if initial else arms,
                epoch=new.epoch,
                prepared=prep.write,
            )
        except AdapterError as exc:
            log.warning("adapter %r: bank refused seq %d: %s", delta.adapter_id, delta.seq, exc)
            return self._count("rejected")
        if prep.state is not None and prep.state.seq >= 0 and prep.state.epoch != new.epoch:
            self._epoch_reset(prep.state, new)
        self.states[delta.adapter_id] = new
        if initial or STABLE in arms:
            self.promoted[delta.adapter_id] = new
        self.needs_resync.discard(delta.adapter_id)
        self.last_delta_at[delta.adapter_id] = time.time()
        return self._count("applied")

    def _refused(self, delta: AdapterDelta, outcome: str, error: str) -> str:
        """Log and count a delta `prepare` refused; a gap or a new epoch marks a re-sync."""
        aid = delta.adapter_id
        if outcome == "unsigned":
            log.warning("adapter %r: refused delta: %s", aid, error)
        elif outcome in ("gap", "new_epoch"):
            log.warning("adapter %r: %s", aid, error)
            self.needs_resync.add(aid)
        elif outcome == "stale_epoch":
            log.info("adapter %r: ignored: %s", aid, error)  # a replay: counted, not shouted
        elif outcome == "rejected":
            log.warning("adapter %r: rejected delta seq %d: %s", aid, delta.seq, error)
            self._rejected(aid)
        return self._count(outcome)

    def _epoch_reset(self, old: AdapterState, new: AdapterState) -> None:
        log.warning(
            "adapter %r: reset to a new epoch %s at seq %d (was seq %d of %s)",
            new.adapter_id,
            describe_epoch(new.epoch),
            new.seq,
            old.seq,
            describe_epoch(old.epoch),
        )
        self._count("epoch_reset")

    def _rejected(self, adapter_id: str) -> None:
        meta = self.bank.meta.get(adapter_id)
        if meta is not None:
            meta.rejected += 1
        else:
            self.rejected_unknown += 1

    def _evict_one(self) -> bool:
        """Evict the least recently updated adapter that no pin or rollback holds."""
        free = [m for a, m in self.bank.meta.items() if a not in self.pinned and a not in self.held]
        if not free:
            return False
        victim = min(free, key=lambda m: m.updated_at).adapter_id
        self.bank.evict(victim)
        for table in (self.states, self.promoted, self.last_delta_at):
            table.pop(victim, None)
        self.needs_resync.discard(victim)
        log.info("adapter %r evicted from a full bank (%d adapters)", victim, self.bank.capacity)
        self._count("evicted")
        return True

    def promote(self) -> None:
        """The candidate arm becomes the stable arm (the canary promoted it, or start-up)."""
        self.bank.promote()
        self.promoted = dict(self.states)

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

    def hold(self, adapter_id: str) -> int:
        """Stop applying deltas to an adapter while a rollback stores its pin; returns the seq the
        rollback will go to (its previous version). AdapterError when there is nothing to roll back."""
        meta = self.bank.meta.get(adapter_id)
        if meta is None:
            raise AdapterError(f"unknown adapter {adapter_id!r}")
        if meta.previous is None:
            raise AdapterError(f"adapter {adapter_id!r} has no previous version to roll back to")
        self.held.add(adapter_id)
        return meta.previous_seq

    def release(self, adapter_id: str) -> None:
        """End a `hold` without rolling back (the pin could not be stored)."""
        self.held.discard(adapter_id)

    def rollback(self, adapter_id: str, expect_seq: int | None = None) -> AdapterInfo:
        """Serve the adapter's previous version again (both arms) and pin it there; with
        `expect_seq`, AdapterError unless that previous version is that seq."""
        meta = self.bank.meta.get(adapter_id)
        if expect_seq is not None and (
            meta is None or meta.previous is None or meta.previous_seq != expect_seq
        ):
            self.held.discard(adapter_id)
            have = None if meta is None or meta.previous is None else meta.previous_seq
            raise AdapterError(
                f"field 'seq': adapter {adapter_id!r} holds previous seq {have}, not {expect_seq}"
            )
        try:
            meta = self.bank.rollback(adapter_id)
        finally:
            self.held.discard(adapter_id)
        self.pinned[adapter_id] = meta.seq
        self.needs_resync.discard(adapter_id)
        state = self.states.get(adapter_id) or self._empty(adapter_id)
        weights = self.bank.weights(adapter_id, STABLE)
        self.states[adapter_id] = self.promoted[adapter_id] = AdapterState(
            state.adapter_id,
            state.base_version,
            state.rank,
            meta.seq,
            {
                **{f"{m}.lora_A": a for m, (a, _) in weights.items()},
                **{f"{m}.lora_B": b for m, (_, b) in weights.items()},
            },
            meta.epoch,  # the previous version's: a later snapshot of the trainer's epoch applies
        )
        return self.info(adapter_id)

    def pinned_snapshot(self, adapter_id: str) -> AdapterDelta:
        """The weights an adapter is pinned at, as a (signed) snapshot other replicas can install."""
        state = self.states[adapter_id]
        return make_delta(
            state, full_parts(state.tensors, state.rank), state.seq, snapshot=True, key=self.key
        )

    def previous_snapshot(self, adapter_id: str) -> AdapterDelta:
        """The adapter's previous version (what a rollback goes to) as a (signed) snapshot: shared
        with the pin so every replica serves exactly these weights."""
        meta = self.bank.meta[adapter_id]
        if meta.previous is None:
            raise AdapterError(f"adapter {adapter_id!r} has no previous version to roll back to")
        tensors = {
            **{f"{m}.lora_A": a.detach().cpu().clone() for m, (a, _) in meta.previous.items()},
            **{f"{m}.lora_B": b.detach().cpu().clone() for m, (_, b) in meta.previous.items()},
        }
        state = AdapterState(
            adapter_id, meta.base_version, self.bank.rank, meta.previous_seq, tensors, meta.previous_epoch
        )
        return make_delta(state, full_parts(tensors, state.rank), state.seq, snapshot=True, key=self.key)

    def unpin(self, adapter_id: str) -> bool:
        """Lift an adapter's pin (True if it was pinned); it then needs a re-sync from its snapshot."""
        if self.pinned.pop(adapter_id, None) is None:
            return False
        self.needs_resync.add(adapter_id)
        return True

    def missing_pins(self, shared: dict[str, int]) -> list[str]:
        """Adapters pinned elsewhere that this replica does not follow yet: their pinned weights are
        needed, if only to tell the pin's epoch (a seq this replica holds may be of another)."""
        return [a for a, seq in shared.items() if self.pinned.get(a) != seq and a not in self.held]

    def sync_pins(
        self, shared: dict[str, int], snapshots: Mapping[str, AdapterDelta | None] | None = None
    ) -> list[str]:
        """Follow the replica-wide pins (`adapter → seq`); returns the adapters it unpinned (each
        needs a re-sync from its snapshot).

        A pin set by another replica is followed when this replica can serve that seq (it is the
        current or the kept previous version), or from the pinned weights shared with the pin
        (`snapshots`: `pinned_snapshot` of the replica that rolled back); otherwise it is logged
        and counted, not guessed.
        """
        lifted = [a for a in self.pinned if a not in shared]
        for adapter_id in lifted:
            self.unpin(adapter_id)
        for adapter_id, seq in shared.items():
            if self.pinned.get(adapter_id) == seq or adapter_id in self.held:
                continue
            meta = self.bank.meta.get(adapter_id)
            snap = (snapshots or {}).get(adapter_id)
            # a seq names the pinned version only in the pinned weights' epoch (unknown without them)
            if meta is not None and meta.seq == seq and (snap is None or snap.epoch == meta.epoch):
                self.pinned[adapter_id] = seq
            elif (
                meta is not None
                and meta.previous is not None
                and meta.previous_seq == seq
                and (snap is None or snap.epoch == meta.previous_epoch)
            ):
                self.rollback(adapter_id)
            elif snap is not None and snap.seq == seq and self._install_pinned(snap) == "applied":
                self.pinned[adapter_id] = seq
            elif (adapter_id, seq) not in self.unavailable_pins:
                self.unavailable_pins.add((adapter_id, seq))
                self._count("pin_unavailable")
                log.warning("adapter %r: pinned at seq %d elsewhere, not held here", adapter_id, seq)
        return lifted

    def _install_pinned(self, snap: AdapterDelta) -> str:
        """Install pinned weights in both arms whatever this replica's seq (they were chosen by an
        admin, not by the seq order)."""
        if self.key is not None:
            try:
                verify_delta(snap, self.key)
            except AdapterError as exc:
                log.warning("adapter %r: refused pinned weights: %s", snap.adapter_id, exc)
                return self._count("unsigned")
        try:
            new = apply_delta(self._empty(snap.adapter_id), snap, self.max_norm)
        except AdapterError as exc:
            log.warning("adapter %r: pinned weights refused: %s", snap.adapter_id, exc)
            return self._count("rejected")
        if snap.adapter_id not in self.bank.meta and self.bank.full and not self._evict_one():
            return self._count("rejected")
        try:
            self.bank.put(
                snap.adapter_id,
                to_weights(new),
                version=version_of(new),
                seq=new.seq,
                base_version=new.base_version,
                arms=(STABLE, CANDIDATE),
                epoch=new.epoch,
            )
        except AdapterError as exc:
            log.warning("adapter %r: bank refused pinned weights: %s", snap.adapter_id, exc)
            return self._count("rejected")
        self.states[snap.adapter_id] = self.promoted[snap.adapter_id] = new
        self.needs_resync.discard(snap.adapter_id)
        self._count("pin_installed")
        return "applied"

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
