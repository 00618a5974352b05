"""The HTTP shell of the event collector: `POST /v1/events` on the ad server and on the
collector's own deployment (`serving.collector_app`).

A request goes: publisher key (401) → media type (415) → the key's token bucket (429 +
Retry-After, before the body is read when the bucket is empty) → the body within
`collector.max_body_bytes` (413) → the batch read (422 for the body as a whole) → one token per
event → each event judged (`serving.collector`) → the accepted ones produced to their topics
with acks=all, every acknowledgement awaited before the answer (503 + Retry-After when the
broker does not take them in `collector.produce_timeout_s`: the client sends the same batch
again; events keep their `event_id`, which the stores deduplicate on). 200: all produced; 207:
some refused, the others produced; 422: none accepted (each refusal by index, field, reason).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from schemas.clients import kafka_args
from schemas.collect import EventBatch, EventsResult, RejectedEvent
from schemas.errors import BrokerError
from schemas.retry import kafka_errors
from schemas.settings import Settings
from schemas.signing import event_key
from schemas.topics import topic_name
from serving.admin import check_api_key
from serving.collector import (
    Accepted,
    BatchRefused,
    Limits,
    TokenBucket,
    Verdict,
    judge_events,
    parse_batch,
    retry_after,
)
from serving.http import BodyTooLarge, error, is_json, read_body, unsupported_media

log = logging.getLogger(__name__)
SNIPPET: Final = Path(__file__).with_name("static") / "adstream.js"
# batches larger than this are judged in a worker thread: at 22-90 us per event (measured on the
# 2-core VM, idle to loaded) a 500-event batch would hold the replica's loop, and the /v1/ads
# requests on it, for 11-44 ms
OFF_LOOP_EVENTS: Final = 32


def _detail(description: str) -> dict[str, Any]:
    schema = {"type": "object", "properties": {"detail": {"type": "string"}}, "required": ["detail"]}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _result(description: str) -> dict[str, Any]:
    # EventsResult is the route's response_model: FastAPI puts it in components
    ref = {"$ref": "#/components/schemas/EventsResult"}
    return {"description": description, "content": {"application/json": {"schema": ref}}}


def inline_defs(schema: dict[str, Any]) -> dict[str, Any]:
    """A model's JSON Schema with its `$defs` written in place of their references: a schema
    embedded in an OpenAPI document cannot point at `#/$defs` (that `#` is the document's root).
    The contract's event models are not recursive."""
    defs = schema.get("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return walk(defs[ref.removeprefix("#/$defs/")])
            # a discriminator's mapping names `#/$defs/…` too; `kind` is a const in each branch
            return {k: walk(v) for k, v in node.items() if k not in ("$defs", "discriminator")}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    out: dict[str, Any] = walk(schema)
    return out


_FIELD_ERRORS: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "detail": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "loc": {"type": "array"},
                    "msg": {"type": "string"},
                    "type": {"type": "string"},
                },
                "required": ["loc", "msg", "type"],
            },
        }
    },
    "required": ["detail"],
}

# the OpenAPI of `POST /v1/events` (keyword arguments of the FastAPI route decorator)
EVENTS_ROUTE: Final[dict[str, Any]] = {
    "response_model": EventsResult,
    "openapi_extra": {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": inline_defs(EventBatch.model_json_schema())}},
        },
        "security": [{"ApiKey": []}, {}],
    },
    "responses": {
        200: _result("every event validated and acknowledged by the broker (acks=all)"),
        207: _result("some events refused (listed by index, field, reason); the others produced"),
        400: _detail("client disconnected before the body ended"),
        401: _detail("`serving.api_keys` are set and X-Api-Key is missing or unknown"),
        413: _detail("body over collector.max_body_bytes"),
        415: _detail("Content-Type is not application/json"),
        422: {
            "description": "no event accepted: `rejected` lists each (index, field, reason), or the body "
            "as a whole is unreadable (`detail`: [{loc, msg, type}]: not JSON, no `events` list, over "
            "collector.max_events)",
            "content": {
                "application/json": {
                    "schema": {"anyOf": [{"$ref": "#/components/schemas/EventsResult"}, _FIELD_ERRORS]}
                }
            },
        },
        429: _detail(
            "the key's rate limit (collector.rate_per_s, burst collector.burst); retry after Retry-After"
        ),
        503: _detail("the broker did not acknowledge in time; nothing is claimed, send the batch again"),
    },
}


class CollectorMetrics:
    """The collector's Prometheus series, in the replica's registry (no id is ever a label)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter(
            "adstream_serving_collector_events_total",
            "Events received over HTTP by kind (unknown: no contract kind) and outcome (accepted, rejected)",
            ["kind", "outcome"],
            registry=registry,
        )
        self.refused = Counter(
            "adstream_serving_collector_refused_total",
            "Events refused over HTTP, by reason (schemas.collect.Reason)",
            ["reason"],
            registry=registry,
        )
        self.forged = Counter(
            "adstream_serving_forged_events_total",
            "Events over HTTP whose click token or impression signature does not verify",
            ["field"],
            registry=registry,
        )
        self.batches = Counter(
            "adstream_serving_collector_batches_total",
            "POST /v1/events answers by HTTP status",
            ["status"],
            registry=registry,
        )

    def count(self, verdict: Verdict) -> None:
        for acc in verdict.accepted:
            self.events.labels(acc.kind, "accepted").inc()
        for rej in verdict.rejected:
            self.events.labels(verdict.kinds.get(rej.index, "unknown"), "rejected").inc()
            self.refused.labels(rej.reason).inc()
        for rej in verdict.forged:
            self.forged.labels(rej.field).inc()


def _broker_trouble() -> tuple[type[BaseException], ...]:
    return (TimeoutError, *kafka_errors())


class EventProducer:
    """An acks=all producer, connected on first use (and again after a failed start)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.producer: Any = None
        self._lock = asyncio.Lock()

    async def _started(self) -> Any:
        async with self._lock:
            if self.producer is None:
                from aiokafka import AIOKafkaProducer

                producer = AIOKafkaProducer(**kafka_args(self.settings), linger_ms=2, acks="all")
                try:
                    await asyncio.wait_for(producer.start(), self.settings.collector.produce_timeout_s)
                except _broker_trouble() as exc:
                    await producer.stop()
                    raise BrokerError(
                        f"Kafka at {self.settings.kafka.bootstrap} did not answer ({exc})"
                    ) from exc
                self.producer = producer
            return self.producer

    async def send(self, accepted: list[Accepted]) -> None:
        """Produce every accepted event and wait for all acknowledgements (BrokerError when the
        broker refuses or does not answer within `collector.produce_timeout_s`)."""
        if not accepted:
            return
        producer = await self._started()
        prefix = self.settings.topic_prefix

        async def all_acked() -> None:
            futures = [await producer.send(topic_name(a.topic, prefix), a.value, key=a.key) for a in accepted]
            await asyncio.gather(*futures)

        try:
            await asyncio.wait_for(all_acked(), self.settings.collector.produce_timeout_s)
        except _broker_trouble() as exc:
            raise BrokerError(f"events not acknowledged by the broker ({exc!r})") from exc

    async def stop(self) -> None:
        if self.producer is not None:
            await self.producer.stop()
            self.producer = None


class EventCollector:
    """`POST /v1/events` of one replica: checks, rate limit, verdict, produce, answer."""

    def __init__(
        self,
        settings: Settings,
        api_keys: frozenset[str],
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        c = settings.collector
        self.settings = settings
        self.api_keys = api_keys  # digests (serving.admin.api_key_digests); empty: open
        self.limits = Limits(c.max_body_bytes, c.max_events)
        self.bucket = TokenBucket(c.rate_per_s, c.burst, clock, c.max_keys)
        self.key = event_key(settings)  # the replicas' key: tokens and signatures they made verify
        self.metrics = CollectorMetrics(registry)
        self.producer = EventProducer(settings)

    def _answer(self, status: int, resp: Response) -> Response:
        self.metrics.batches.labels(str(status)).inc()
        return resp

    def _limited(self, wait_s: float) -> Response:
        return self._answer(
            429,
            error(429, "rate limit of this key reached, retry later", {"Retry-After": retry_after(wait_s)}),
        )

    async def handle(self, request: Request) -> Response:
        """The whole route: one answer for every request, never a 5xx for what the client sent."""
        presented = request.headers.get("x-api-key")
        denied = check_api_key(presented, self.api_keys)
        if denied is not None:
            return self._answer(401, error(401, denied))
        if not is_json(request.headers.get("content-type")):
            return self._answer(415, unsupported_media())
        who = self._bucket_key(presented, request)
        if (wait := self.bucket.wait_s(who, 1)) > 0:
            return self._limited(wait)
        try:
            body = await read_body(request, self.limits.max_body_bytes)
            events = parse_batch(body, self.limits)
        except BodyTooLarge:
            return self._answer(413, error(413, f"request body over {self.limits.max_body_bytes} bytes"))
        except ClientDisconnect:
            return self._answer(400, error(400, "client disconnected before the body ended"))
        except BatchRefused as exc:  # a 422 locates its field, as every 422 of the API does
            why = (
                exc.message
                if exc.status != 422
                else [{"loc": [exc.field], "msg": exc.message, "type": "batch"}]
            )
            return self._answer(exc.status, error(exc.status, why))
        if (wait := self.bucket.take(who, len(events))) > 0:
            return self._limited(wait)
        if len(events) > OFF_LOOP_EVENTS:
            verdict = await asyncio.to_thread(judge_events, events, self.key)
        else:
            verdict = judge_events(events, self.key)
        try:
            await self.producer.send(verdict.accepted)
        except BrokerError as exc:
            log.warning("collector: %s", exc)
            self.metrics.batches.labels("503").inc()
            return error(503, "events could not be produced now; send the batch again", {"Retry-After": "1"})
        self.metrics.count(verdict)
        return self._answer(*self._result(verdict))

    @staticmethod
    def _result(verdict: Verdict) -> tuple[int, Response]:
        rejected: list[RejectedEvent] = verdict.rejected
        rejected.sort(key=lambda r: r.index)
        status = 200 if not rejected else (207 if verdict.accepted else 422)
        body = EventsResult(accepted=len(verdict.accepted), rejected=rejected).model_dump_json()
        return status, Response(body, status_code=status, media_type="application/json")

    @staticmethod
    def _bucket_key(presented: str | None, request: Request) -> str:
        """Whose bucket a request draws on: its API key (by digest), else its client address."""
        if presented:
            return "k:" + hashlib.sha256(presented.encode()).hexdigest()
        return "a:" + (request.client.host if request.client is not None else "?")

    async def stop(self) -> None:
        await self.producer.stop()


def snippet() -> Response:
    """`GET /adstream.js`: the dependency-free web snippet (`serving/static/adstream.js`)."""
    return Response(
        SNIPPET.read_bytes(),
        media_type="text/javascript; charset=utf-8",
        headers={"Cache-Control": "public, max-age=300"},
    )


SNIPPET_ROUTE: Final[dict[str, Any]] = {
    "response_class": Response,
    "responses": {200: {"description": "the web snippet", "content": {"text/javascript": {}}}},
}

__all__ = ["EVENTS_ROUTE", "SNIPPET_ROUTE", "CollectorMetrics", "EventCollector", "EventProducer", "snippet"]
