"""Writes that can fail, and what to do about it: retry what may succeed later, split out what never will.

A transient failure (a broker, Redis or ClickHouse that is down, slow or busy) pauses the worker:
the step is retried with capped exponential backoff and nothing is lost or acked meanwhile. A
failure that can never succeed on retry (a record larger than the producer allows, a row the
server refuses for its content: a type or constraint error, "too many partitions for a single
INSERT block") must not be retried for ever with every partition stalled behind it: the batch is
split until the refused rows are alone, they are dead-lettered, and the rest is written.
Both lists are `schemas.retry`'s (`is_transient`, `permanent`); an error on neither (a bug, an
unknown table) is raised at once instead of being retried as if the store were down.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from schemas import topics
from schemas.codec import encode
from schemas.events import DeadLetter
from schemas.retry import Backoff, Classifier, is_transient, permanent, retry
from streams import metrics as m
from streams.ingest import capped, dead_letter

log = logging.getLogger(__name__)

Send = Callable[[str, bytes, bytes], Awaitable[Any]]
# many messages at once → per message None (delivered) or the exception that stopped it
SendMany = Callable[[Sequence[tuple[str, bytes, bytes]]], Awaitable[list[BaseException | None]]]
Rows = dict[str, list[tuple[Any, ...]]]
# the worker's default (`settings.streams.retry_backoff` is what the pipeline passes)
WORKER_BACKOFF = Backoff(0.5, 30.0, None)

# the table a sink row goes to → the contract topic it was read from
TABLE_TOPIC = {
    "impressions": topics.IMPRESSIONS,
    "clicks": topics.CLICKS,
    "dwell": topics.DWELL,
    "conversions": topics.CONVERSIONS,
    "touches": topics.TOUCHES,
    "views": topics.VIEWS,
    "ads": topics.CATALOG,
}


async def retrying(
    step: Callable[[], Awaitable[None]],
    what: str,
    backoff: Backoff = WORKER_BACKOFF,
    transient: Classifier = is_transient,
) -> None:
    """Run `step` until it succeeds, backing off while it fails with a transient error (the
    worker pauses instead of losing a batch); any other error is raised at once (a bug, a
    refused write: `schemas.retry`). Every retry is counted in adstream_streams_retries_total."""
    await retry(
        step, what, backoff=backoff, transient=transient, on_retry=lambda *_: m.RETRIES.labels(what).inc()
    )


async def write_rows(
    write: Callable[[Rows], Awaitable[None]], rows: Rows, what: str, backoff: Backoff = WORKER_BACKOFF
) -> list[tuple[str, int, str]]:
    """Write `rows` (idempotent per event_id); return (table, index, error) of the rows refused
    for good (`permanent`), after halving the failing blocks until each refused row is alone.
    Transient errors are retried; any other error (a bug, an unknown table) is raised."""
    if not any(rows.values()):
        return []
    try:
        await retrying(lambda: write(rows), what, backoff)
        return []
    except Exception as exc:  # only a content error is handled here; anything else is re-raised
        if not permanent(exc):
            raise
        log.warning("%s refused a batch for good (%s): splitting it", what, exc)
    refused: list[tuple[str, int, str]] = []
    for table, batch in rows.items():
        stack: list[range] = [range(len(batch))]
        while stack:
            part = stack.pop()
            if not part:
                continue
            block = {table: [batch[i] for i in part]}
            try:
                await retrying(functools.partial(write, block), what, backoff)
            except Exception as exc:  # as above: only content errors split
                if not permanent(exc):
                    raise
                if len(part) == 1:
                    refused.append((table, part[0], str(exc)))
                    continue
                mid = len(part) // 2
                stack += [part[mid:], part[:mid]]
    return refused


def refused_letter(
    prefix: str, table: str, row: tuple[Any, ...], raw: bytes | None, error: str
) -> DeadLetter:
    """The dead letter of a sink row the store refused (its topic, partition, offset, bytes)."""
    topic = topics.topic_name(TABLE_TOPIC[table], prefix)
    partition, offset = int(row[-2]), int(row[-1])
    reason = f"refused by the event store: {error}"
    return dead_letter(topic, partition, offset, raw or b"", int(row[2]), reason, "refused").dead_letter


def unsendable_letter(topic: str, value: bytes, error: str) -> bytes:
    """A dead letter standing in for a message the broker can never take (it is too large)."""
    digest = hashlib.blake2b(topic.encode() + b"\0" + value, digest_size=16).hexdigest()
    dl = DeadLetter(
        event_id=f"dlq-{digest}",
        ts=datetime.now(UTC),
        source_topic=topic[:249],
        partition=-1,
        offset=-1,
        **capped(value, f"could not be produced to {topic}: {error}"),
    )
    return encode(dl)


async def produce_all(
    send: Send,
    messages: Sequence[tuple[str, bytes, bytes]],
    what: str,
    dlq_topic: str,
    backoff: Backoff = WORKER_BACKOFF,
    send_many: SendMany | None = None,
) -> int:
    """Produce every message (retrying only those that failed with a transient error); a message
    the broker can never take is replaced by its dead letter on `dlq_topic`; any other error (a
    bug) is raised. Returns how many were replaced.

    `send_many`, when given, sends a whole round at once (in batches: far less work per message
    than one `send` each); `send` is used otherwise."""
    todo: Sequence[tuple[str, bytes, bytes]] = messages
    stand_ins: Sequence[bool] = [False] * len(todo)  # … whether each is a stand-in already
    replaced = 0
    waits = backoff.delays()  # never gives up: the worker pauses rather than lose a batch
    while todo:
        results: Sequence[Any]
        if send_many is not None:
            results = await send_many(todo)
        else:
            results = await asyncio.gather(*(send(t, k, v) for t, k, v in todo), return_exceptions=True)
        if not any(results):  # every one delivered (the common case)
            break
        again: list[tuple[str, bytes, bytes]] = []
        again_stand_ins: list[bool] = []
        transient: BaseException | None = None
        for (topic, key, value), stand_in, res in zip(todo, stand_ins, results, strict=True):
            if isinstance(res, asyncio.CancelledError):
                raise res
            if not isinstance(res, BaseException):
                continue
            if is_transient(res):
                again.append((topic, key, value))
                again_stand_ins.append(stand_in)
                transient = res
            elif not permanent(res):
                raise res  # neither the broker's weather nor the message's content: a bug
            elif stand_in:  # cannot happen with the producer's default limits (capped raw)
                log.error("dead letter of an unsendable message not produced either: %s", res)
                m.RETRIES.labels(f"{what} (dropped)").inc()
            else:
                replaced += 1
                log.warning("message to %s can never be produced (%s): dead-lettered", topic, res)
                letter = unsendable_letter(topic, value, f"{type(res).__name__}: {res}")
                again.append((dlq_topic, topic.encode(), letter))
                again_stand_ins.append(True)
        if transient is not None:
            wait = next(waits)
            m.RETRIES.labels(what).inc()
            log.warning("%s failed (%s); retrying %d message(s) in %.1fs", what, transient, len(again), wait)
            await asyncio.sleep(wait)
        todo, stand_ins = again, again_stand_ins
    return replaced
