"""Adapter snapshots and sequence bookkeeping in Redis (what replicas start from, what restarts resume).

Key layout (every key under `settings.redis_prefix`):

=====================================  ==========  =============================================
key                                    type        value
=====================================  ==========  =============================================
`adapter:{adapter_id}`                 string      the latest full snapshot: `AdapterDelta` JSON
                                                   with `snapshot=true` (serving reads this)
`adapter-meta:{adapter_id}`            hash        `version` (`seq-N`), `seq`, `base_version`,
                                                   `offsets` (JSON `{partition: offset}` of the
                                                   last input records in it), `updated_at`,
                                                   `epoch` (`legacy` or the number)
`adapter-seq`                          hash        adapter_id → `N@E`: highest seq N reserved in
                                                   epoch E (`N` alone: the legacy epoch); any seq
                                                   up to it may be on `ad.adapter-deltas`
`trainer-offsets:{topic}`              hash        partition → last input offset whose effect is
                                                   in the snapshots (a restart resumes after it)
=====================================  ==========  =============================================

A seq is reserved in `adapter-seq` **before** its delta is produced, so a restarted trainer never
reuses one; snapshots, their metadata and the partition offsets are written in one MULTI/EXEC.

The epoch lives in the same hash value as the seq, so the two are lost together: a Redis without
an adapter's seq record (a wipe, a new Redis) makes its trainer start a new epoch
(`schemas.delta.new_epoch`), which replicas take as a reset at its first snapshot, instead of
seqs from 0 that replicas would refuse as replays (`Restored.seq_record`).

Redis errors that can pass (connection refused or reset, timeouts, a server still loading:
`schemas.retry.is_transient`) are retried with capped exponential backoff
(`settings.online.redis_backoff`) before `StoreError` is raised; every
operation is idempotent (SET/HSET of the same values, reads), so a retry after a reply was lost
is harmless.

`ServeBound` holds the checks a serving replica applies to a whole adapter (`check_snapshot`,
`check_state`): the trainer neither publishes nor resumes from an adapter serving would refuse.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import torch

from schemas import codec
from schemas.delta import apply_delta, empty_state
from schemas.errors import AdapterError, ConfigError, SchemaError, StoreError
from schemas.events import AdapterDelta
from schemas.retry import Backoff, is_transient, redis_errors, retry

log = logging.getLogger(__name__)
T = TypeVar("T")

# what Redis (or the way to it) can raise; of these `schemas.retry.is_transient` says which are
# retried (refused, reset, timeouts, a server still loading). A WRONGTYPE reply is a StoreError at
# once; anything else (a bug here) propagates as it is.
REDIS_ERRORS = redis_errors()


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


# -- what serving accepts --------------------------------------------------------------------
class SnapshotRefused(AdapterError):
    """An adapter state or snapshot that a serving replica would refuse; `reason` is a metric label
    (`norm`: ΔW over the bound, `non_finite`: NaN/inf weights, `invalid`: anything else)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ServeBound:
    """The checks a serving replica applies to a whole adapter (see `check_snapshot`).

    `max_norm` is `settings.serving.adapter_max_norm`: replicas check every adapter they install with
    `serving.adapters.AdapterBank.check` against it. (`settings.online.delta_max_norm` bounds only the
    change an incremental delta makes; serving does not apply it to snapshots.)
    """

    base_version: str
    rank: int
    scale: float  # lora_alpha / lora_rank
    max_norm: float
    shapes: Mapping[str, tuple[int, int]]  # module → (in_features, out_features)

    def __post_init__(self) -> None:
        if not self.max_norm > 0:
            raise ConfigError(f"ServeBound.max_norm must be > 0 (got {self.max_norm!r})")


def delta_w_norm(tensors: Mapping[str, torch.Tensor], scale: float) -> float:
    """Norm of the change an adapter makes to the base, as serving computes it: the Frobenius norm
    of `scale · B @ A` per module, combined over modules (root of the summed squares)."""
    total = 0.0
    for m in sorted({k.rsplit(".", 1)[0] for k in tensors}):
        a, b = tensors[f"{m}.lora_A"], tensors[f"{m}.lora_B"]
        total += float(torch.linalg.matrix_norm(scale * (b.double() @ a.double()))) ** 2
    return math.sqrt(total)


def check_state(tensors: Mapping[str, torch.Tensor], bound: ServeBound) -> float:
    """The ΔW norm of full adapter weights (`{<m>.lora_A, <m>.lora_B}`), or SnapshotRefused."""
    for key, t in sorted(tensors.items()):
        if not torch.isfinite(t).all():
            raise SnapshotRefused("non_finite", f"tensor {key!r} has non-finite values")
    norm = delta_w_norm(tensors, bound.scale)
    if not norm <= bound.max_norm:
        raise SnapshotRefused(
            "norm", f"adapter ΔW norm {norm:.4g} exceeds serving.adapter_max_norm {bound.max_norm:.4g}"
        )
    return norm


def check_snapshot(snap: AdapterDelta, adapter_id: str, bound: ServeBound) -> float:
    """What a replica does with a snapshot, without a replica: apply it to an empty adapter
    (adapter id, base version, rank, every module in full, shapes, dtypes, finite values, the
    declared norm) and bound the result's ΔW norm. Returns that norm, or raises SnapshotRefused."""
    if not snap.snapshot:
        raise SnapshotRefused("invalid", f"message seq {snap.seq} of {adapter_id!r} is not a snapshot")
    start = empty_state(adapter_id, bound.base_version, bound.shapes, bound.rank)
    try:
        state = apply_delta(start, snap, bound.max_norm)  # max_norm bounds only incremental deltas
    except AdapterError as exc:
        raise SnapshotRefused("invalid", f"snapshot seq {snap.seq} of {adapter_id!r}: {exc}") from exc
    return check_state(state.tensors, bound)


# -- retries ---------------------------------------------------------------------------------
# how long the trainer rides out Redis errors (`settings.online.redis_backoff` in the service)
REDIS_BACKOFF = Backoff(first_s=0.05, max_s=2.0, give_up_s=300.0)


Observer = Callable[[str, str], None]  # (operation, "retried" | "gave_up")


@dataclass(frozen=True)
class Restored:
    """What Redis knows about one adapter: its snapshot (if any and decodable), the highest seq
    reserved or snapshotted (-1 if none), the snapshot's offsets, and why a stored snapshot was
    discarded (`invalid`, None when it was fine or absent); `epoch` of the seq record, and
    whether there is a readable one (`seq_record`; without it the seqs already published are
    unknown, so the adapter must go on in a new epoch)."""

    snapshot: AdapterDelta | None
    last_seq: int
    offsets: dict[int, int]
    invalid: str | None = None
    epoch: int | None = None
    seq_record: bool = False


class SnapshotStore:
    """Async Redis access for the trainer (a `redis.asyncio.Redis` client is passed in).

    `observer(op, outcome)` hears of every retried error and every give-up (for metrics); setting
    `abort` (e.g. the service's stop event) makes the next failure final instead of waiting.
    """

    def __init__(
        self,
        client: Any,
        prefix: str,
        topic: str,
        retry: Backoff | None = None,
        observer: Observer | None = None,
        ttl_s: int = 30 * 24 * 3600,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.topic = topic
        # an adapter that stops training does not keep its snapshot forever (`settings.online.snapshot_ttl_s`;
        # refreshed on every write); its reserved seqs stay, so a seq is never reused
        self.ttl_s = ttl_s
        self.retry = retry or REDIS_BACKOFF
        self.observer = observer
        self.abort: asyncio.Event | None = None

    async def _call(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        """`fn()`, retrying transient Redis errors (`self.retry`); StoreError when Redis fails for
        good or for longer than `give_up_s`; a bug in `fn` propagates as it is."""

        async def step() -> T:
            try:
                return await fn()
            except REDIS_ERRORS as exc:
                if is_transient(exc):
                    raise  # retried by `retry`, wrapped when it gives up
                raise StoreError(f"Redis {op} failed: {_describe(exc)}") from exc

        def gave_up(message: str, exc: BaseException) -> BaseException:
            return StoreError(f"Redis {message}")

        return await retry(
            step,
            op,
            backoff=self.retry,
            on_retry=lambda exc, attempt, delay: self._observe(op, "retried"),
            on_give_up=lambda exc: self._observe(op, "gave_up"),
            abort=self.abort,
            wrap=gave_up,
        )

    def _observe(self, op: str, outcome: str) -> None:
        if self.observer is not None:
            self.observer(op, outcome)

    async def reserve(self, seqs: Mapping[str, int], epochs: Mapping[str, int | None] | None = None) -> None:
        """Record that these seqs (in these epochs; legacy where not given) are about to be
        published (call before producing). Rewriting the epoch every time is idempotent, and puts
        it back when Redis lost it while this trainer ran (the lineage goes on unbroken)."""
        if not seqs:
            return
        mapping = {k: seq_record(v, (epochs or {}).get(k)) for k, v in seqs.items()}
        await self._call("reserve", lambda: self.client.hset(seq_key(self.prefix), mapping=mapping))

    async def write(
        self,
        snaps: Sequence[tuple[AdapterDelta, Mapping[int, int]]],
        partition_offsets: Mapping[int, int],
        now: datetime | None = None,
    ) -> None:
        """Store snapshots, their metadata and the snapshotted partition offsets atomically."""
        now = now or datetime.now(UTC)
        for snap, _ in snaps:
            if not snap.snapshot:
                raise StoreError(f"delta seq {snap.seq} of {snap.adapter_id!r} is not a snapshot")
        encoded = [(snap, codec.encode(snap), offsets) for snap, offsets in snaps]

        async def transaction() -> None:
            async with self.client.pipeline(transaction=True) as pipe:
                for snap, payload, offsets in encoded:
                    pipe.set(snapshot_key(self.prefix, snap.adapter_id), payload, ex=self.ttl_s)
                    pipe.hset(
                        meta_key(self.prefix, snap.adapter_id),
                        mapping={
                            "version": f"seq-{snap.seq}",
                            "seq": str(snap.seq),
                            "base_version": snap.base_version,
                            "offsets": json.dumps({str(k): v for k, v in sorted(offsets.items())}),
                            "updated_at": now.isoformat(),
                            "epoch": "legacy" if snap.epoch is None else str(snap.epoch),
                        },
                    )
                    pipe.expire(meta_key(self.prefix, snap.adapter_id), self.ttl_s)
                if partition_offsets:
                    pipe.hset(
                        offsets_key(self.prefix, self.topic),
                        mapping={str(k): str(v) for k, v in partition_offsets.items()},
                    )
                await pipe.execute()

        await self._call("write", transaction)

    async def read(self, adapter_id: str) -> Restored:
        """The adapter's snapshot (None if absent or unreadable; `invalid` says why), the highest
        seq any key records for it (-1) and the snapshot's offsets."""

        async def fetch() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.get(snapshot_key(self.prefix, adapter_id))
                pipe.hget(seq_key(self.prefix), adapter_id)
                pipe.hmget(meta_key(self.prefix, adapter_id), ["seq", "offsets"])
                result: list[Any] = await pipe.execute()
                return result

        raw, reserved, (meta_seq, offsets_raw) = await self._call("read", fetch)
        snap, invalid = None, None
        if raw is not None:
            try:
                msg = codec.decode(AdapterDelta, raw)
            except SchemaError as exc:
                invalid = f"stored snapshot is not a valid AdapterDelta: {exc}"
            else:
                if isinstance(msg, AdapterDelta) and msg.snapshot:
                    snap = msg
                else:
                    invalid = f"stored message seq {getattr(msg, 'seq', '?')} is not a snapshot"
        record = parse_seq_record(reserved, adapter_id)
        seqs = [
            -1,
            snap.seq if snap is not None else None,
            record[0] if record is not None else None,
            _int_or_none(meta_seq, "adapter-meta seq", adapter_id),
        ]
        last = max(v for v in seqs if v is not None)
        offsets: dict[int, int] = {}
        if snap is not None and offsets_raw:
            try:
                offsets = {int(k): int(v) for k, v in json.loads(offsets_raw).items()}
            except (ValueError, TypeError, AttributeError) as exc:
                log.warning(
                    "adapter %s: snapshot offsets %r unreadable (%s); ignored", adapter_id, offsets_raw, exc
                )
        if record is None:
            return Restored(snap, last, offsets, invalid)
        return Restored(snap, last, offsets, invalid, epoch=record[1], seq_record=True)

    async def partition_offsets(self) -> dict[int, int]:
        """Snapshotted input offset per partition (empty before the first snapshot)."""
        raw: dict[Any, Any] = await self._call(
            "offsets", lambda: self.client.hgetall(offsets_key(self.prefix, self.topic))
        )
        out = {}
        for k, v in raw.items():
            try:
                out[int(k)] = int(v)
            except ValueError:
                key = offsets_key(self.prefix, self.topic)
                raise StoreError(f"Redis key {key!r}: partition {k!r} → {v!r} is not an offset") from None
        return out


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"  # redis-py's reprs drop the message


def seq_record(seq: int, epoch: int | None) -> str:
    """An `adapter-seq` value: `N@E`, or `N` in the legacy epoch."""
    return str(seq) if epoch is None else f"{seq}@{epoch}"


def parse_seq_record(value: Any, adapter_id: str) -> tuple[int, int | None] | None:
    """(seq, epoch) of an `adapter-seq` value; None when absent or unreadable (logged), which the
    trainer treats like a lost record: a new epoch."""
    if value is None:
        return None
    text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    seq_text, at, epoch_text = text.partition("@")
    seq = _int_or_none(seq_text, "adapter-seq", adapter_id)
    if seq is None or seq < 0:
        return None
    if not at:
        return seq, None
    epoch = _int_or_none(epoch_text, "adapter-seq epoch", adapter_id)
    return (seq, epoch) if epoch is not None and epoch > 0 else None


def _int_or_none(value: Any, field: str, adapter_id: str) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        log.warning("adapter %s: %s value %r is not a seq; ignored", adapter_id, field, value)
        return None
