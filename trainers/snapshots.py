"""Adapter snapshots and sequence bookkeeping in Redis (what replicas start from, what restarts resume).

Key layout (every key under `settings.redis_prefix`):

=====================================  ==========  =============================================
key                                    type        value
=====================================  ==========  =============================================
`adapter:{adapter_id}`                 string      the latest full snapshot: `AdapterDelta` JSON
                                                   with `snapshot=true` (serving reads this)
`adapter-meta:{adapter_id}`            hash        `version` (`seq-N`), `seq`, `base_version`,
                                                   `offsets` (JSON `{partition: offset}` of the
                                                   last input records in it), `updated_at`
`adapter-seq`                          hash        adapter_id → highest seq reserved; any seq up
                                                   to it may be on `ad.adapter-deltas`
`trainer-offsets:{topic}`              hash        partition → last input offset whose effect is
                                                   in the snapshots (a restart resumes after it)
=====================================  ==========  =============================================

A seq is reserved in `adapter-seq` **before** its delta is produced, so a restarted trainer never
reuses one; snapshots, their metadata and the partition offsets are written in one MULTI/EXEC.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from schemas import codec
from schemas.errors import SchemaError, StoreError
from schemas.events import AdapterDelta


def snapshot_key(prefix: str, adapter_id: str) -> str:
    """Key of an adapter's latest snapshot."""
    return f"{prefix}adapter:{adapter_id}"


def meta_key(prefix: str, adapter_id: str) -> str:
    """Key of an adapter's snapshot metadata hash."""
    return f"{prefix}adapter-meta:{adapter_id}"


def seq_key(prefix: str) -> str:
    """Key of the hash of reserved seqs."""
    return f"{prefix}adapter-seq"


def offsets_key(prefix: str, topic: str) -> str:
    """Key of the hash of snapshotted input offsets per partition."""
    return f"{prefix}trainer-offsets:{topic}"


@dataclass(frozen=True)
class Restored:
    """What Redis knows about one adapter: its snapshot (if any) and the highest reserved seq."""

    snapshot: AdapterDelta | None
    last_seq: int
    offsets: dict[int, int]


class SnapshotStore:
    """Async Redis access for the trainer (a `redis.asyncio.Redis` client is passed in)."""

    def __init__(self, client: Any, prefix: str, topic: str) -> None:
        self.client = client
        self.prefix = prefix
        self.topic = topic

    async def reserve(self, seqs: Mapping[str, int]) -> None:
        """Record that these seqs are about to be published (call before producing)."""
        if not seqs:
            return
        try:
            await self.client.hset(seq_key(self.prefix), mapping={k: str(v) for k, v in seqs.items()})
        except Exception as exc:
            raise StoreError(f"could not reserve adapter seqs in Redis: {exc}") from exc

    async def write(
        self,
        snaps: Sequence[tuple[AdapterDelta, Mapping[int, int]]],
        partition_offsets: Mapping[int, int],
        now: datetime | None = None,
    ) -> None:
        """Store snapshots, their metadata and the snapshotted partition offsets atomically."""
        now = now or datetime.now(UTC)
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                for snap, offsets in snaps:
                    if not snap.snapshot:
                        raise StoreError(f"delta seq {snap.seq} of {snap.adapter_id!r} is not a snapshot")
                    pipe.set(snapshot_key(self.prefix, snap.adapter_id), codec.encode(snap))
                    pipe.hset(
                        meta_key(self.prefix, snap.adapter_id),
                        mapping={
                            "version": f"seq-{snap.seq}",
                            "seq": str(snap.seq),
                            "base_version": snap.base_version,
                            "offsets": json.dumps({str(k): v for k, v in sorted(offsets.items())}),
                            "updated_at": now.isoformat(),
                        },
                    )
                if partition_offsets:
                    pipe.hset(
                        offsets_key(self.prefix, self.topic),
                        mapping={str(k): str(v) for k, v in partition_offsets.items()},
                    )
                await pipe.execute()
        except StoreError:
            raise
        except Exception as exc:
            raise StoreError(f"could not write adapter snapshots to Redis: {exc}") from exc

    async def read(self, adapter_id: str) -> Restored:
        """The adapter's snapshot (None if absent or invalid), highest reserved seq (-1) and offsets."""
        try:
            raw = await self.client.get(snapshot_key(self.prefix, adapter_id))
            seq = await self.client.hget(seq_key(self.prefix), adapter_id)
            offsets_raw = await self.client.hget(meta_key(self.prefix, adapter_id), "offsets")
        except Exception as exc:
            raise StoreError(f"could not read adapter {adapter_id!r} from Redis: {exc}") from exc
        snap = None
        if raw is not None:
            try:
                msg = codec.decode(AdapterDelta, raw)
                snap = msg if isinstance(msg, AdapterDelta) and msg.snapshot else None
            except SchemaError:
                snap = None
        offsets = {int(k): int(v) for k, v in json.loads(offsets_raw).items()} if offsets_raw else {}
        last = int(seq) if seq is not None else -1
        if snap is not None:
            last = max(last, snap.seq)
        return Restored(snap, last, offsets)

    async def partition_offsets(self) -> dict[int, int]:
        """Snapshotted input offset per partition (empty before the first snapshot)."""
        try:
            raw = await self.client.hgetall(offsets_key(self.prefix, self.topic))
        except Exception as exc:
            raise StoreError(f"could not read trainer offsets from Redis: {exc}") from exc
        return {int(k): int(v) for k, v in raw.items()}
