"""The replica's I/O at the edges: Redis (user state, frequency caps, spend, adapter snapshots)
and Kafka (impressions out; catalog, adapter deltas and clicks in). Thin async shells.

Redis keys written/read by serving (under `settings.redis_prefix`):
- `fcap:{yyyymmdd}:{user_id}` hash ad_id → impressions today (TTL 2 days)
- `spend:{yyyymmdd}` hash campaign_id → expected spend today (pCTR × price, TTL 2 days)
- the user record (key and layout owned by streams, decoded through a `UserCodec` given at start)
- adapter snapshots (`adapter:{adapter_id}`: an `AdapterDelta` JSON with `snapshot=true`)
- `adapter-pins` hash adapter_id → seq: adapters an admin rolled back (shared by all replicas)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, Protocol

from schemas import codec, topics
from schemas.clients import kafka_args, redis_args
from schemas.errors import SchemaError
from schemas.events import AdapterDelta, Impression, Message
from schemas.settings import Settings
from serving.pipeline import UserView

log = logging.getLogger(__name__)
DAY_TTL_S = 2 * 24 * 3600


class UserCodec(Protocol):
    """How serving finds and reads a user's state record (provided by the deployer: streams' format)."""

    def key(self, prefix: str, user_id: str) -> str: ...

    def view(self, user_id: str, data: bytes, now_ts: float) -> UserView: ...


def day_of(now: datetime) -> str:
    return now.strftime("%Y%m%d")


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
        self.cap = settings.frequency_cap
        self._fcap: dict[tuple[str, str], dict[str, int]] = {}
        self._fcap_inflight: dict[tuple[str, str], dict[str, int]] = {}
        self._spend: dict[str, dict[str, float]] = {}
        self.errors = 0

    async def read(self, user_id: str, now: datetime) -> tuple[UserView | None, list[str]]:
        """The user's view (None when unknown/cold or unreadable) and the ads capped for them."""
        pipe = self.client.pipeline(transaction=False)
        if self.codec is not None:
            pipe.get(self.codec.key(self.prefix, user_id))
        pipe.hgetall(f"{self.prefix}fcap:{day_of(now)}:{user_id}")
        res = await pipe.execute()
        view = None
        if self.codec is not None and res[0] is not None:
            try:
                view = self.codec.view(user_id, res[0], now.timestamp())
            except Exception as exc:  # a bad record makes the user cold, never fails the request
                self.errors += 1
                log.warning("unreadable state record of a user: %s", exc)
        counts = {k.decode(): int(v) for k, v in res[-1].items()}
        for source in (self._fcap, self._fcap_inflight):  # not yet in Redis, or being written now
            for ad, n in source.get((day_of(now), user_id), {}).items():
                counts[ad] = counts.get(ad, 0) + n
        return view, [ad for ad, n in counts.items() if n >= self.cap]

    def record(self, user_id: str, now: datetime, imps: list[Impression], spend: list[float]) -> None:
        """Count impressions per user/ad (frequency cap) and expected spend per campaign, in memory
        until the next `flush` (the cap check adds what is pending, so it holds in between)."""
        day = day_of(now)
        fcap = self._fcap.setdefault((day, user_id), {})
        camp = self._spend.setdefault(day, {})
        for imp, cost in zip(imps, spend, strict=True):
            fcap[imp.ad_id] = fcap.get(imp.ad_id, 0) + 1
            camp[imp.campaign_id] = camp.get(imp.campaign_id, 0.0) + float(cost)

    async def flush(self) -> int:
        """Write the pending counters in one pipeline; returns the number of commands sent."""
        if not self._fcap and not self._spend:
            return 0
        fcap, spend = self._fcap, self._spend
        self._fcap, self._spend = {}, {}
        self._fcap_inflight = fcap
        # MULTI/EXEC: all or nothing, so a failed write can be retried without double counting
        pipe = self.client.pipeline(transaction=True)
        n = 0
        for (day, user_id), ads in fcap.items():
            key = f"{self.prefix}fcap:{day}:{user_id}"
            for ad, count in ads.items():
                pipe.hincrby(key, ad, count)
            pipe.expire(key, DAY_TTL_S)
            n += len(ads) + 1
        for day, camps in spend.items():
            key = f"{self.prefix}spend:{day}"
            for camp, cost in camps.items():
                pipe.hincrbyfloat(key, camp, cost)
            pipe.expire(key, DAY_TTL_S)
            n += len(camps) + 1
        try:
            await pipe.execute()
        except Exception:
            # keep the counts for the next flush: a lost count would let a capped ad through
            _merge_counts(self._fcap, fcap)
            _merge_counts(self._spend, spend)
            raise
        finally:
            self._fcap_inflight = {}
        return n

    async def spend(self, now: datetime) -> dict[str, float]:
        raw = await self.client.hgetall(f"{self.prefix}spend:{day_of(now)}")
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

    async def set_pin(self, adapter_id: str, seq: int) -> None:
        await self.client.hset(f"{self.prefix}adapter-pins", adapter_id, seq)

    async def clear_pin(self, adapter_id: str) -> bool:
        return bool(await self.client.hdel(f"{self.prefix}adapter-pins", adapter_id))

    async def close(self) -> None:
        await self.client.aclose()


class ImpressionSink:
    """Produces served impressions to `ad.impressions` without making the request wait."""

    def __init__(self, settings: Settings, on_outcome: Callable[[str, int], None]) -> None:
        self.settings = settings
        self.topic = topics.topic_name(topics.IMPRESSIONS, settings.topic_prefix)
        self.producer: Any = None
        self.on_outcome = on_outcome
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        from aiokafka import AIOKafkaProducer

        producer = AIOKafkaProducer(**kafka_args(self.settings), linger_ms=5, acks=1)
        try:
            await asyncio.wait_for(producer.start(), 10)
        except Exception as exc:
            log.error("impression producer could not start (%s); impressions will be dropped", exc)
            await producer.stop()
            return
        self.producer = producer

    def emit(self, imps: list[Impression]) -> None:
        if not imps:
            return
        if self.producer is None:
            self.on_outcome("dropped", len(imps))
            return
        task = asyncio.get_running_loop().create_task(self._send(imps))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, imps: list[Impression]) -> None:
        try:
            for imp in imps:
                await self.producer.send(self.topic, codec.encode(imp), key=imp.user_id.encode())
            self.on_outcome("sent", len(imps))
        except Exception as exc:
            log.warning("impressions not produced: %s", exc)
            self.on_outcome("failed", len(imps))

    async def stop(self) -> None:
        if self.producer is not None:
            await self.producer.stop()


async def follow(
    settings: Settings,
    base_topic: str,
    handle: Callable[[Message], Awaitable[None] | None],
    from_beginning: bool,
    on_invalid: Callable[[str], None],
) -> None:
    """Consume a contract topic forever (no consumer group: every replica sees everything)."""
    from aiokafka import AIOKafkaConsumer

    topic = topics.topic_name(base_topic, settings.topic_prefix)
    model = codec.MODEL_BY_TOPIC[base_topic]
    while True:
        consumer = AIOKafkaConsumer(
            topic,
            **kafka_args(settings),
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest" if from_beginning else "latest",
            metadata_max_age_ms=2000,
        )
        try:
            await consumer.start()
            async for rec in consumer:
                try:
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
                except Exception as exc:
                    # one message the handler cannot use must not stall the topic: re-reading
                    # from the start would hit it again forever. Count it and go on.
                    log.exception("handler of %s failed on offset %d", topic, rec.offset)
                    on_invalid(f"handler failed: {type(exc).__name__}: {exc}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("consumer of %s failed (%s); reconnecting", topic, exc)
            await asyncio.sleep(1.0)
        finally:
            await consumer.stop()


def _merge_counts(into: dict[Any, dict[str, Any]], counts: dict[Any, dict[str, Any]]) -> None:
    """Add nested counters `counts` into `into` (key → {name: count})."""
    for key, inner in counts.items():
        target = into.setdefault(key, {})
        for name, n in inner.items():
            target[name] = target.get(name, 0) + n
