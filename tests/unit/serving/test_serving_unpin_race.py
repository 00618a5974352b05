"""An admin's unpin answers after the adapter re-synced, whoever lifted the pin first.

Found by a fresh-clone CI run (2026-12-08, `test_delta_hot_swap_poison_rollback`: the unpin
answered `seq-0`, the rolled-back version, where the snapshot's `seq-2` was due). The handler
clears the pin in Redis, and while it awaits that, the replica's pin loop (`_sync_pins`, every
housekeeping second) can read the pins, find this one gone, lift it here and start the re-sync
itself; the handler then found nothing to lift, skipped the re-sync and answered with the old
version while the loop's re-sync was still reading the snapshot."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace
from typing import Any

from serving.loops import ReplicaLoops

AID = "slot:search"


class _Applier:
    """The pin and version bookkeeping of `serving.hotswap.DeltaApplier` that the loops use."""

    def __init__(self) -> None:
        self.pinned = {AID: 0}
        self.version = 0

    def unpin(self, adapter_id: str) -> bool:
        return self.pinned.pop(adapter_id, None) is not None

    def missing_pins(self, shared: dict[str, int]) -> list[str]:
        return []

    def sync_pins(self, shared: dict[str, int], snapshots: Any = None) -> list[str]:
        lifted = [a for a in self.pinned if a not in shared]
        for a in lifted:
            self.unpin(a)
        return lifted

    async def resync(self, adapter_id: str, source: Any) -> str:
        self.version = await source(adapter_id)
        return "applied"


class _Redis:
    def __init__(self, clearing: asyncio.Event) -> None:
        self.pins_now = {AID: 0}
        self.clearing = clearing

    async def clear_pin(self, adapter_id: str) -> bool:
        self.pins_now.pop(adapter_id, None)
        self.clearing.set()
        await asyncio.sleep(0.01)  # the reply's round trip: the pin loop runs meanwhile
        return True

    async def pins(self) -> dict[str, int]:
        return dict(self.pins_now)

    async def snapshot(self, adapter_id: str) -> int:
        await asyncio.sleep(0.05)  # reading and decoding the snapshot
        return 2


class _Deltas:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def labels(self, outcome: str) -> SimpleNamespace:
        return SimpleNamespace(inc=lambda: self.counts.update([outcome]))


def _loops(applier: _Applier, redis: _Redis, deltas: _Deltas) -> ReplicaLoops:
    loops = ReplicaLoops.__new__(ReplicaLoops)  # only the pin and re-sync parts are exercised
    loops.applier = applier  # type: ignore[assignment]
    loops.redis = redis  # type: ignore[assignment]
    loops.metrics = SimpleNamespace(deltas=deltas)  # type: ignore[assignment]
    loops._resyncs = {}
    return loops


def test_the_unpin_answers_after_the_resync_the_pin_loop_started() -> None:
    async def run() -> tuple[int, Counter[str]]:
        clearing = asyncio.Event()
        applier, deltas = _Applier(), _Deltas()
        loops = _loops(applier, _Redis(clearing), deltas)

        async def pin_loop() -> None:  # its pass lands while the handler awaits the clear
            await clearing.wait()
            await loops._sync_pins()

        background = asyncio.create_task(pin_loop())
        await asyncio.sleep(0)
        await loops.redis.clear_pin(AID)  # as the handler: the pin leaves Redis, then
        await loops.unpinned(AID)
        answered = applier.version  # what the unpin's answer reports
        await background
        return answered, deltas.counts

    answered, counts = asyncio.run(run())
    assert answered == 2
    assert counts == Counter({"unpin_applied": 1})  # one re-sync, not one per lifter


def test_the_unpin_resyncs_itself_when_it_lifts_the_pin() -> None:
    async def run() -> tuple[int, Counter[str]]:
        applier, deltas = _Applier(), _Deltas()
        loops = _loops(applier, _Redis(asyncio.Event()), deltas)
        await loops.redis.clear_pin(AID)
        await loops.unpinned(AID)
        return applier.version, deltas.counts

    assert asyncio.run(run()) == (2, Counter({"unpin_applied": 1}))


def test_the_unpin_of_an_adapter_not_pinned_here_answers_at_once() -> None:
    async def run() -> tuple[int, Counter[str]]:
        applier, deltas = _Applier(), _Deltas()
        applier.pinned.clear()
        loops = _loops(applier, _Redis(asyncio.Event()), deltas)
        await loops.redis.clear_pin(AID)
        await loops.unpinned(AID)
        return applier.version, deltas.counts

    assert asyncio.run(run()) == (0, Counter())


def test_the_pin_loop_makes_every_lifted_adapters_resync_known_before_it_awaits_one() -> None:
    """Two pins lifted in one pass: both re-syncs are under way (and known) at once, so the
    unpin of the second waits for its own re-sync, not only for the first's."""

    async def run() -> tuple[set[str], dict[str, int]]:
        applier, deltas = _Applier(), _Deltas()
        applier.pinned = {AID: 0, "slot:feed": 0}
        versions: dict[str, int] = {}

        async def resync(adapter_id: str, source: Any) -> str:
            await asyncio.sleep(0.05 if adapter_id == AID else 0.1)
            versions[adapter_id] = 2
            return "applied"

        applier.resync = resync  # type: ignore[method-assign]
        redis = _Redis(asyncio.Event())
        redis.pins_now = {}
        loops = _loops(applier, redis, deltas)
        background = asyncio.create_task(loops._sync_pins())
        await asyncio.sleep(0.01)
        known = set(loops._resyncs)
        await loops.unpinned("slot:feed")
        answered = dict(versions)
        await background
        return known, answered

    known, answered = asyncio.run(run())
    assert known == {AID, "slot:feed"}
    assert answered.get("slot:feed") == 2
