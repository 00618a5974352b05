"""The replica's I/O at the edges: Redis (user state, frequency caps, spend, adapter snapshots)
and Kafka (impressions out; catalog, adapter deltas and clicks in). Thin async shells.

Redis keys written/read by serving (under `settings.redis_prefix`):
- `fcap:{yyyymmdd}:{h}` hash ad_id → impressions today of the user whose id hashes to `h`
  (`fcap_key`: 32 hex, whatever the id's length), expiring an hour after that UTC day ends: the
  only per-user key serving writes, for ids that passed the contract, and it cannot outlive its day
- `spend:{yyyymmdd}` hash campaign_id → spend billed today (`schemas.billing`: written by the
  streams worker on shown CPM impressions and CPC clicks; read here for pacing; TTL 2 days)
- the user record (`schemas.user_record`, written by streams; read through a `UserCodec`, by default
  `UserRecordCodec`)
- adapter snapshots (`adapter:{adapter_id}`: an `AdapterDelta` JSON with `snapshot=true`)
- `adapter-pins` hash adapter_id → seq: adapters an admin rolled back (shared by all replicas),
  and `adapter-pin:{adapter_id}` the pinned weights (a snapshot), for replicas that lack that seq

Kafka: impressions go out through a bounded queue that one task drains, counting each
impression when the broker acknowledged it (`sent`), could not take it (`failed`) or found the
queue full (`dropped`); a producer that cannot connect at start keeps retrying. Topics are
followed from a start position (the beginning, or `replay_s` back for deltas) and, across
reconnects, from where the replica left off; large records are parsed off the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import numpy as np

from schemas import codec, topics
from schemas.billing import spend_key
from schemas.clients import fetch_args, kafka_args, redis_args
from schemas.errors import AdstreamError, SchemaError
from schemas.events import AdapterDelta, Impression, Message
from schemas.retry import kafka_errors
from schemas.settings import Settings, StateSettings
from schemas.user_record import bias_at, decode_state, served_view, user_key
from serving.pipeline import UserView

log = logging.getLogger(__name__)
_encode = codec.encoder(Impression)  # `codec.encode`'s bytes in one serializer call
PARTITION_CACHE = 100_000  # users whose impressions' partition the sink remembers
# one record batch per partition and window, closed when handed over (the producer sends it at
# once: the window is the sink's own linger); a window with more goes in several batches
IMPRESSION_BATCH_BYTES = 256 * 1024
WINDOW_MAX = 8192  # impressions the sender takes from the queue for one window at most
RESTART_S = 1.0  # pause before a dead impression sender starts again
DAY_TTL_S = 2 * 24 * 3600
FCAP_GRACE_S = 3600  # a frequency-cap key outlives its UTC day by this much (clock skew, late flush)
OFF_LOOP_BYTES = 64 * 1024  # records larger than this are parsed in a worker thread
# the counter flush as one script: ARGV holds 4 per write (op, key index, field, value), each write
# runs under pcall, and the reply lists (write number, error) of those Redis refused
FLUSH_SCRIPT = """
local failed, n = {}, 0
for i = 1, #ARGV, 4 do
  local op, key = ARGV[i], KEYS[tonumber(ARGV[i + 1])]
  local r
  if op == "i" then r = redis.pcall("HINCRBY", key, ARGV[i + 2], ARGV[i + 3])
  elseif op == "f" then r = redis.pcall("HINCRBYFLOAT", key, ARGV[i + 2], ARGV[i + 3])
  elseif op == "a" then r = redis.pcall("EXPIREAT", key, ARGV[i + 2])
  else r = redis.pcall("EXPIRE", key, ARGV[i + 2]) end
  n = n + 1
  if type(r) == "table" and r.err then
    failed[#failed + 1] = n
    failed[#failed + 1] = r.err
  end
end
return failed
"""


class UserCodec(Protocol):
    """How serving finds and reads a user's state record (provided by the deployer: streams' format)."""

    def key(self, prefix: str, user_id: str) -> str: ...

    def view(self, user_id: str, data: bytes, now_ts: float) -> UserView: ...


class UserRecordCodec:
    """The Redis user record the streams worker writes (`schemas.user_record`), read as serving's
    `UserView` decayed to request time."""

    def __init__(self, params: StateSettings) -> None:
        self.params = params

    def key(self, prefix: str, user_id: str) -> str:
        return user_key(prefix, user_id)

    def view(self, user_id: str, data: bytes, now_ts: float) -> UserView:
        state = decode_state(user_id, data)
        # every intent streams keeps (training saw all of them), not served_view's default top 8
        vector, top = served_view(state, now_ts, self.params, k=self.params.max_intents)
        # the per-user correction, unless turned off (state.feedback_lr = 0 stops using it too)
        bias = bias_at(state, now_ts, self.params) if self.params.feedback_lr > 0 else {}
        return UserView(np.asarray(vector, dtype=np.float32), dict(top), bias)


def day_of(now: datetime) -> str:
    return now.strftime("%Y%m%d")


def fcap_key(prefix: str, day: str, user_id: str) -> str:
    """The frequency-cap hash of one user for one day (the id hashed: keys stay 32 hex long).

    >>> fcap_key("p:", "20260101", "u1")
    'p:fcap:20260101:53199585bddea28e67fe7143a42baef7'
    """
    digest = hashlib.blake2b(user_id.encode(), digest_size=16).hexdigest()
    return f"{prefix}fcap:{day}:{digest}"


def fcap_expiry(day: str) -> int:
    """Unix time at which a day's frequency-cap keys expire: the day's end plus `FCAP_GRACE_S`."""
    start = datetime.strptime(day, "%Y%m%d").replace(tzinfo=UTC)
    return int((start + timedelta(days=1)).timestamp()) + FCAP_GRACE_S


def parse_pins(raw: dict[Any, Any]) -> dict[str, int]:
    """The `adapter-pins` hash as adapter_id → seq; an entry whose seq is not a non-negative
    integer (written by hand, say) is logged and skipped, never followed.

    >>> parse_pins({b"feed": b"3", b"adv:x": b"soon", "adv:y": "-1"})
    {'feed': 3}
    """
    out: dict[str, int] = {}
    for k, v in raw.items():
        key = k.decode() if isinstance(k, bytes) else str(k)
        try:
            seq = int(v)
        except (TypeError, ValueError):
            seq = -1
        if seq < 0:
            log.warning("ignoring adapter pin %r=%r: seq must be a non-negative integer", key, v)
            continue
        out[key] = seq
    return out


class RedisIO:
    """Per-request reads in one round trip, and fire-and-forget writes of what was served."""

    def __init__(self, settings: Settings, codec_: UserCodec | None) -> None:
        import redis.asyncio as aredis

        self.prefix = settings.redis_prefix
        self.client = aredis.Redis.from_url(**redis_args(settings), socket_timeout=1.0)
        self.codec = codec_
        self.cap = settings.serving.frequency_cap
        self._fcap: dict[tuple[str, str], dict[str, int]] = {}
        self._fcap_inflight: dict[tuple[str, str], dict[str, int]] = {}
        self._spend: dict[str, dict[str, float]] = {}
        self.errors = 0
        self.dropped = 0  # counter writes Redis refused inside the flush script (not retried)
        self._flush_script = self.client.register_script(FLUSH_SCRIPT)

    async def read(self, user_id: str, now: datetime) -> tuple[UserView | None, list[str]]:
        """The user's view (None when unknown/cold or unreadable) and the ads capped for them."""
        return (await self.read_many([user_id], now))[0]

    async def read_many(self, user_ids: list[str], now: datetime) -> list[tuple[UserView | None, list[str]]]:
        """`read` of a batch of users in one round trip (one pipeline: each user's record and
        frequency-cap hash)."""
        pipe = self.client.pipeline(transaction=False)
        day = day_of(now)
        for user_id in user_ids:
            if self.codec is not None:
                pipe.get(self.codec.key(self.prefix, user_id))
            pipe.hgetall(fcap_key(self.prefix, day, user_id))
        res = await pipe.execute()
        per = 2 if self.codec is not None else 1
        out = []
        for i, user_id in enumerate(user_ids):
            raw = res[i * per : (i + 1) * per]
            view = None
            if self.codec is not None and raw[0] is not None:
                try:
                    view = self.codec.view(user_id, raw[0], now.timestamp())
                # a bad record makes the user cold, never fails the request (a bug in the codec does)
                except (AdstreamError, ValueError, struct.error, IndexError) as exc:
                    self.errors += 1
                    log.warning("unreadable state record of a user: %s", exc)
            counts = {k.decode(): int(v) for k, v in raw[-1].items()}
            out.append((view, self._capped(counts, day, user_id)))
        return out

    def pending_capped(self, user_id: str, now: datetime) -> list[str]:
        """The ads capped for a user by what this replica counted and has not written yet (the
        caps it can still hold when Redis does not answer)."""
        return self._capped({}, day_of(now), user_id)

    def _capped(self, counts: dict[str, int], day: str, user_id: str) -> list[str]:
        for source in (self._fcap, self._fcap_inflight):  # not yet in Redis, or being written now
            for ad, n in source.get((day, user_id), {}).items():
                counts[ad] = counts.get(ad, 0) + n
        return [ad for ad, n in counts.items() if n >= self.cap]

    def record(
        self, user_id: str, now: datetime, imps: list[Impression], spend: list[float] | None = None
    ) -> None:
        """Count impressions per user/ad (frequency cap) and, when given, spend per campaign, in
        memory until the next `flush` (the cap check adds what is pending, so it holds in between).
        Serving passes no spend: what campaigns pay is billed by the streams worker on views and
        clicks (`schemas.billing`) into the same hash."""
        day = day_of(now)
        fcap = self._fcap.setdefault((day, user_id), {})
        for imp in imps:
            fcap[imp.ad_id] = fcap.get(imp.ad_id, 0) + 1
        if spend is None:
            return
        camp = self._spend.setdefault(day, {})
        for imp, cost in zip(imps, spend, strict=True):
            camp[imp.campaign_id] = camp.get(imp.campaign_id, 0.0) + float(cost)

    async def flush(self) -> int:
        """Write the pending counters in one script call; returns the number of writes sent.

        One `EVALSHA` of `FLUSH_SCRIPT` carries every increment and expiry: per command, a
        pipeline cost redis-py a packed command and a parsed reply (~0.6 ms of the replica's loop
        per request at 100 req/s, more than the recall). Like MULTI/EXEC the script runs whole or
        not at all as far as the connection goes, and inside it each write succeeds or fails alone
        (`redis.pcall`): the failed ones (WRONGTYPE, an increment that would overflow) cannot
        succeed on a retry and are dropped (counted, logged), the applied ones are never re-sent
        (re-sending them would count them twice). A call that never ran (connection lost,
        timeout) keeps the counts for the next flush: a lost count would let a capped ad through.
        """
        if not self._fcap and not self._spend:
            return 0
        fcap, spend = self._fcap, self._spend
        self._fcap, self._spend = {}, {}
        self._fcap_inflight = fcap
        keys: list[str] = []
        args: list[str] = []
        what: list[tuple[str, str, str] | None] = []  # per write: (kind, key, field)
        for (day, user_id), ads in fcap.items():
            key = fcap_key(self.prefix, day, user_id)
            keys.append(key)
            index = str(len(keys))
            for ad, count in ads.items():
                args += ("i", index, ad, str(count))
                what.append(("fcap", key, ad))
            # never in the past (a day that ended while its counts waited): that would delete the key
            args += ("a", index, str(max(fcap_expiry(day), int(time.time()) + FCAP_GRACE_S)), "")
            what.append(None)
        for day, camps in spend.items():
            key = spend_key(self.prefix, day)
            keys.append(key)
            index = str(len(keys))
            for camp, cost in camps.items():
                args += ("f", index, camp, repr(float(cost)))
                what.append(("spend", key, camp))
            args += ("e", index, str(DAY_TTL_S), "")
            what.append(None)
        try:
            failures = await self._flush_script(keys=keys, args=args, client=self.client)
        except Exception:  # put the counts back for the next flush, and re-raise whatever it was
            _merge_counts(self._fcap, fcap)
            _merge_counts(self._spend, spend)
            raise
        finally:
            self._fcap_inflight = {}
        failed = [(what[int(failures[i]) - 1], failures[i + 1]) for i in range(0, len(failures), 2)]
        if failed:
            self.errors += len(failed)
            self.dropped += len(failed)
            log.warning(
                "%d counter write(s) refused by Redis, dropped (a retry cannot succeed), e.g. %s: %s",
                len(failed), failed[0][0], failed[0][1],
            )  # fmt: skip
        return len(what)

    async def spend(self, now: datetime) -> dict[str, float]:
        raw = await self.client.hgetall(spend_key(self.prefix, day_of(now)))
        return {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in raw.items()}

    async def snapshot(self, adapter_id: str) -> AdapterDelta | None:
        data = await self.client.get(f"{self.prefix}adapter:{adapter_id}")
        if data is None:
            return None
        try:
            msg = codec.decode(AdapterDelta, data)
        except SchemaError as exc:
            log.warning("adapter snapshot of %s is invalid: %s", adapter_id, exc)
            return None
        assert isinstance(msg, AdapterDelta)
        return msg

    async def snapshot_ids(self) -> list[str]:
        start = len(f"{self.prefix}adapter:")
        return [
            k.decode()[start:]
            async for k in self.client.scan_iter(match=f"{self.prefix}adapter:*", count=1000)
        ]

    async def pins(self) -> dict[str, int]:
        """The replica-wide adapter pins (admin rollbacks): adapter_id → pinned seq."""
        return parse_pins(await self.client.hgetall(f"{self.prefix}adapter-pins"))

    async def set_pin(self, adapter_id: str, seq: int, weights: AdapterDelta | None = None) -> None:
        """Pin an adapter at `seq` for every replica, with the pinned weights (a snapshot) for
        replicas that do not hold that seq; both in one MULTI/EXEC."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(f"{self.prefix}adapter-pins", adapter_id, seq)
        if weights is not None:
            pipe.set(f"{self.prefix}adapter-pin:{adapter_id}", codec.encode(weights))
        await pipe.execute()

    async def pin_snapshots(self, adapter_ids: Iterable[str]) -> dict[str, AdapterDelta | None]:
        """The weights stored with the pins of `adapter_ids` (None where absent or invalid)."""
        ids = list(adapter_ids)
        if not ids:
            return {}
        raw = await self.client.mget([f"{self.prefix}adapter-pin:{a}" for a in ids])
        out: dict[str, AdapterDelta | None] = {}
        for adapter_id, data in zip(ids, raw, strict=True):
            msg = None
            if data is not None:
                try:
                    msg = codec.decode(AdapterDelta, data)
                except SchemaError as exc:
                    log.warning("pinned weights of adapter %r are invalid: %s", adapter_id, exc)
            out[adapter_id] = msg if isinstance(msg, AdapterDelta) else None
        return out

    async def clear_pin(self, adapter_id: str) -> bool:
        pipe = self.client.pipeline(transaction=True)
        pipe.hdel(f"{self.prefix}adapter-pins", adapter_id)
        pipe.delete(f"{self.prefix}adapter-pin:{adapter_id}")
        removed, _ = await pipe.execute()
        return bool(removed)

    async def close(self) -> None:
        await self.client.aclose()


class ImpressionSink:
    """Produces served impressions to `ad.impressions` without making the request wait.

    `emit` puts impressions on a bounded queue (full: `dropped`; the bound counts those handed to
    the producer and not yet acknowledged too); one task takes what a linger window
    (`serving.impression_linger_ms`, from the first impression queued) gathered and hands it to
    the producer as one closed record batch per partition (`create_batch` / `send_batch`: a
    record appended to a batch costs a few µs, where `send` made a coroutine, a future and an
    accumulator entry of each, ~50 µs of the replica a record), and counts each impression when
    the broker acknowledged its batch (`sent`, acks=all) or refused it (`failed`), waiting for
    acknowledgements aside. Started while Kafka is down, the producer keeps retrying in the
    background and what was queued meanwhile goes out once it connects. `stop` drains the queue
    (bounded by `timeout_s`).
    """

    def __init__(
        self,
        settings: Settings,
        on_outcome: Callable[[str, int], None],
        on_sent: Callable[[float], None] | None = None,
    ) -> None:
        self.settings = settings
        self.on_sent = on_sent  # seconds one batch took to hand to the producer (the loop's time)
        self.topic = topics.topic_name(topics.IMPRESSIONS, settings.topic_prefix)
        self.producer: Any = None
        self.on_outcome = on_outcome
        self.limit = settings.serving.impressions_pending
        self._queue: deque[Impression] = deque()
        self._inflight = 0  # handed to the producer, not acknowledged yet
        self._taking = 0  # taken from the queue by `_send`, not handed yet
        self._acks: set[asyncio.Task[None]] = set()  # the tasks waiting for them
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.connect_attempts = 0
        from aiokafka.partitioner import DefaultPartitioner

        self._partitioner = DefaultPartitioner()  # the producer's own: `send`'s murmur2 of the key
        self._parts: list[int] = []
        self._partition_of: dict[bytes, int] = {}  # user key → partition of `_parts`

    @property
    def pending(self) -> int:
        """Impressions not sent yet: queued, being handed to the producer, or with it and not
        acknowledged."""
        return len(self._queue) + self._taking + self._inflight

    async def start(self) -> None:
        """Start the sender (it connects, retrying, in the background: start never waits for Kafka)."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="adstream-impressions")
        self._task.add_done_callback(self._died)

    def _died(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self._stopping:
            return
        exc = task.exception()
        # a bug is not retried as "Kafka down": it surfaces here, with its traceback, and the
        # sender restarts after a pause (not in a tight loop when the bug is in every start)
        log.error("impression sender died (%r); restarting in %.0f s", exc, RESTART_S, exc_info=exc)
        asyncio.get_running_loop().call_later(RESTART_S, self._restart)

    def _restart(self) -> None:
        if self._stopping:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="adstream-impressions")
        self._task.add_done_callback(self._died)

    async def _connect(self) -> None:
        from aiokafka import AIOKafkaProducer

        delay = 0.5
        while self.producer is None and not self._stopping:
            self.connect_attempts += 1
            # the sink lingers itself (`_run`) and hands closed batches, sent at once
            producer = AIOKafkaProducer(
                **kafka_args(self.settings), acks="all", max_batch_size=IMPRESSION_BATCH_BYTES
            )
            try:
                await asyncio.wait_for(producer.start(), 10)
            except asyncio.CancelledError:
                await producer.stop()
                raise
            except kafka_errors() as exc:  # a bug (bad client arguments) is not "could not connect"
                log.warning("impression producer could not connect (%s); retrying in %.1fs", exc, delay)
                await producer.stop()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            self.producer = producer
            log.info("impression producer connected")

    def emit(self, imps: list[Impression]) -> None:
        if not imps:
            return
        room = max(0, self.limit - self.pending)
        if room < len(imps):
            self.on_outcome("dropped", len(imps) - room)
            imps = imps[:room]
        self._queue.extend(imps)
        self._wake.set()

    async def _run(self) -> None:
        await self._connect()
        linger = self.settings.serving.impression_linger_ms / 1000
        while not (self._stopping and not self._queue):
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            if linger > 0 and not self._stopping:  # the window: what comes meanwhile goes with it
                await asyncio.sleep(linger)
            batch = [self._queue.popleft() for _ in range(min(len(self._queue), WINDOW_MAX))]
            await self._send(batch)
        if self._acks:
            await asyncio.gather(*self._acks, return_exceptions=True)

    async def _send(self, imps: list[Impression]) -> None:
        """Hand `imps` to the producer as one closed record batch per partition (more where one
        would pass `IMPRESSION_BATCH_BYTES`); it waits only while a partition's previous batch is
        still with the producer. Their acknowledgements are awaited by a task of their own."""
        handed: list[tuple[Any, int]] = []  # (the batch's future, its impressions)
        done = 0  # impressions handed over (or refused) so far
        t = time.perf_counter()
        self._taking += len(imps)  # out of the queue, not with the producer yet: still pending
        try:
            by_part = self._by_partition(imps, sorted(await self.producer.partitions_for(self.topic)))
            producer, topic = self.producer, self.topic
            for p, records in by_part.items():
                at = 0
                while at < len(records):
                    batch, n = _filled(producer.create_batch(), records, at)
                    handed.append((await producer.send_batch(batch, topic, partition=p), n))
                    done += n
                    at += n
        except kafka_errors() as exc:  # the broker's (buffer full, too large …): counted as failed
            log.warning("impressions not produced: %s", exc)
            self.on_outcome("failed", len(imps) - done)
        except asyncio.CancelledError:  # `stop` ran out of time: what the producer did not take
            self.on_outcome("dropped", len(imps) - done)
            raise
        except Exception:  # a bug: counted too, then raised (the sender restarts, see `_died`)
            self.on_outcome("failed", len(imps) - done)
            raise
        finally:  # what the producer took is counted when acknowledged, whatever happened after
            self._taking -= len(imps)
            if handed:
                self._inflight += done
                task = asyncio.get_running_loop().create_task(self._acked(handed))
                self._acks.add(task)
                task.add_done_callback(self._acks.discard)
        if self.on_sent is not None:
            self.on_sent(time.perf_counter() - t)

    def _by_partition(self, imps: list[Impression], parts: list[int]) -> dict[int, list[tuple[bytes, bytes]]]:
        """Each impression's (key, JSON) under the partition `send` would pick for its user (the
        producer's murmur2 of the key, ~3.5 µs in Python: remembered per user); `parts`: the
        topic's partitions now (others than before: users move)."""
        if parts != self._parts:
            self._parts, self._partition_of = parts, {}
        part_of = self._partition_of
        by_part: dict[int, list[tuple[bytes, bytes]]] = {}
        for imp in imps:
            key = imp.user_id.encode()
            p = part_of.get(key)
            if p is None:
                if len(part_of) >= PARTITION_CACHE:
                    part_of.clear()
                p = part_of[key] = self._partitioner(key, parts, parts)
            records = by_part.get(p)
            if records is None:
                records = by_part[p] = []
            records.append((key, _encode(imp)))
        return by_part

    async def _acked(self, handed: list[tuple[Any, int]]) -> None:
        try:
            results = await asyncio.gather(*(future for future, _ in handed), return_exceptions=True)
        finally:
            self._inflight -= sum(n for _, n in handed)
        failed = sum(n for (_, n), r in zip(handed, results, strict=True) if isinstance(r, BaseException))
        if failed:
            log.warning("%d impression(s) not acknowledged by the broker: %r", failed, next(
                r for r in results if isinstance(r, BaseException)
            ))  # fmt: skip
            self.on_outcome("failed", failed)
        if sent := sum(n for _, n in handed) - failed:
            self.on_outcome("sent", sent)

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (up to `timeout_s`), then close; what is left is counted `dropped`."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except (TimeoutError, asyncio.CancelledError, Exception):
                self._task.cancel()
        if self._queue:
            self.on_outcome("dropped", len(self._queue))
            self._queue.clear()
        if self.producer is not None:
            await self.producer.stop()  # sends what it holds: every acknowledgement is settled
            self.producer = None
        if self._acks:
            await asyncio.gather(*self._acks, return_exceptions=True)


def _filled(batch: Any, records: list[tuple[bytes, bytes]], at: int) -> tuple[Any, int]:
    """`batch` (an empty `BatchBuilder`) with `records[at:]` appended until it is full, closed
    (the producer sends a closed batch at once: nothing else joins it); and how many it took (at
    least one: an empty batch takes any record, the broker judges its size)."""
    n = 0
    for key, value in itertools.islice(records, at, None):
        if batch.append(key=key, value=value, timestamp=None) is None:
            break  # full: the rest goes in the next batch
        n += 1
    if not n:  # never loop on a record no batch takes
        raise RuntimeError(f"an empty record batch refused an impression of {len(records[at][1])} bytes")
    batch.close()
    return batch, n


async def follow(
    settings: Settings,
    base_topic: str,
    handle: Callable[[Message], Awaitable[None] | None],
    from_beginning: bool,
    on_invalid: Callable[[str], None],
    *,
    replay_s: float | None = None,
    positions: dict[int, int] | None = None,
) -> None:
    """Consume a contract topic forever (no consumer group: every replica sees everything).

    Starts at the beginning (`from_beginning`), `replay_s` seconds back (by record time: older
    deltas are in the snapshots) or at the end; `positions` (partition → next offset, updated
    as records are handled) carries on across reconnects, so a reconnect never replays the
    topic. Records over `OFF_LOOP_BYTES` are parsed in a worker thread.
    """
    from aiokafka import AIOKafkaConsumer

    topic = topics.topic_name(base_topic, settings.topic_prefix)
    model = codec.MODEL_BY_TOPIC[base_topic]
    positions = {} if positions is None else positions
    while True:
        consumer = AIOKafkaConsumer(
            topic,
            **kafka_args(settings),
            **fetch_args(settings),
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest" if from_beginning else "latest",
            metadata_max_age_ms=2000,
        )
        try:
            await consumer.start()
            await _seek_start(consumer, positions, replay_s)
            since_ms = int((time.time() - replay_s) * 1000) if replay_s is not None else None
            fresh = {tp.partition for tp in consumer.assignment()} - set(positions)
            async for rec in consumer:
                if since_ms is not None and rec.partition in fresh and rec.timestamp < since_ms:
                    continue  # before the replay window (a broker without a time index seeks to 0)
                positions[rec.partition] = rec.offset + 1
                try:
                    if len(rec.value or b"") > OFF_LOOP_BYTES:
                        msg = await asyncio.to_thread(codec.decode, model, rec.value)
                    else:
                        msg = codec.decode(model, rec.value)
                except SchemaError as exc:
                    on_invalid(str(exc))
                    continue
                try:
                    out = handle(msg)
                    if out is not None:
                        await out
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # a per-message guard, logged with traceback
                    # one message the handler cannot use must not stall the topic: re-reading
                    # from the start would hit it again forever. Count it and go on.
                    log.exception("handler of %s failed on offset %d", topic, rec.offset)
                    on_invalid(f"handler failed: {type(exc).__name__}: {exc}")
        except asyncio.CancelledError:
            raise
        except kafka_errors() as exc:  # the broker's; a bug ends the loop (its supervisor logs it)
            log.warning("consumer of %s failed (%s); reconnecting", topic, exc)
            await asyncio.sleep(1.0)
        finally:
            await consumer.stop()


async def _seek_start(consumer: Any, positions: dict[int, int], replay_s: float | None) -> None:
    """Seek each assigned partition to where this replica left off, else `replay_s` back."""
    assigned = consumer.assignment()
    fresh = [tp for tp in assigned if tp.partition not in positions]
    for tp in assigned:
        if tp.partition in positions:
            consumer.seek(tp, positions[tp.partition])
    if fresh and replay_s is not None:
        since_ms = int((time.time() - replay_s) * 1000)
        found = await consumer.offsets_for_times({tp: since_ms for tp in fresh})
        ends = await consumer.end_offsets(fresh)
        for tp in fresh:
            hit = found.get(tp)
            consumer.seek(tp, hit.offset if hit is not None else ends[tp])


def _merge_counts(into: dict[Any, dict[str, Any]], counts: dict[Any, dict[str, Any]]) -> None:
    """Add nested counters `counts` into `into` (key → {name: count})."""
    for key, inner in counts.items():
        target = into.setdefault(key, {})
        for name, n in inner.items():
            target[name] = target.get(name, 0) + n
