"""Request-edge checks of `/v1/ads` that run before anything is parsed: media type and a body
read with a hard byte limit (a chunked body has no Content-Length to trust)."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from schemas.api import AdRequest
from schemas.codec import describe_validation_error


class BodyTooLarge(Exception):
    """The request body passed the byte limit (answered 413; the rest is never read)."""


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type names JSON (`application/json`, any parameters). Browsers send
    cross-site "simple" POSTs only as text/plain, form or multipart: those are refused.

    >>> is_json("application/json; charset=utf-8"), is_json("text/plain"), is_json(None)
    (True, False, False)
    """
    if not content_type:
        return False
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


async def read_body(request: Request, limit: int) -> bytes:
    """The body, read chunk by chunk and abandoned as soon as it passes `limit` bytes
    (BodyTooLarge); a declared Content-Length over the limit is refused before reading.
    ClientDisconnect when the client goes away mid-body."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise BodyTooLarge(declared)
        except ValueError:
            raise BodyTooLarge(declared) from None  # not a length: never read what it frames
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(size)
        chunks.append(chunk)
    return b"".join(chunks)


def duplicate_keys(body: bytes) -> list[str]:
    """Keys that appear twice in one JSON object of `body` (JSON parsers keep the last one, so
    `{"user_id": "a", "user_id": "b"}` would be read as "b" by us and as "a" by something else).
    Empty for bodies without duplicates and for bodies that are not JSON (the model says why).

    >>> duplicate_keys(b'{"user_id": "a", "slot": "feed", "user_id": "b"}')
    ['user_id']
    """
    found: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in items:
            if key in seen and key not in found:
                found.append(key)
            seen.add(key)
        return dict(items)

    try:
        json.loads(body, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return []
    return found


def error(status: int, detail: Any, headers: dict[str, str] | None = None) -> JSONResponse:
    """The `{"detail": …}` answer of every refused request."""
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


SHED_WHY = {"queue_full": "queue full", "timeout": "waited too long", "evicted": "gave way to a higher class"}


def overloaded(qos: str, outcome: str, retry_after: str) -> JSONResponse:
    """The 503 of a request the QoS gate refused (`serving.qos`), with its class's Retry-After.

    >>> r = overloaded("besteffort", "queue_full", "2")
    >>> r.status_code, r.headers["retry-after"], r.body
    (503, '2', b'{"detail":"overloaded (besteffort: queue full), retry later"}')
    """
    why = SHED_WHY.get(outcome, outcome)
    return error(503, f"overloaded ({qos}: {why}), retry later", {"Retry-After": retry_after})


def unsupported_media() -> JSONResponse:
    return error(415, "Content-Type must be application/json")


async def parse_ad_request(
    request: Request,
    limit: int,
    model: type[AdRequest] = AdRequest,
    slots: Collection[str] | None = None,
) -> AdRequest | JSONResponse:
    """The request edge of `POST /v1/ads` (and `/v1/rank`, `model` = `RankRequest`) after the
    media type was checked: the body read within `limit` bytes (413; 400 when the client left
    mid-body), duplicate keys refused (422) and the request validated (422, each field located;
    a slot not among `slots`, the configured ones, is refused there too).
    The ad server and the benchmark's framework floor (`benchmarks.lib.floor`) both answer through this,
    so the floor pays what the server pays."""
    try:
        body = await read_body(request, limit)
    except BodyTooLarge:
        return error(413, f"request body over {limit} bytes")
    except ClientDisconnect:
        return error(400, "client disconnected before the body ended")
    if dupes := duplicate_keys(body):
        twice: list[dict[str, Any]] = [
            {"loc": [k], "msg": "key given twice in one object", "type": "duplicate_key"} for k in dupes
        ]
        return JSONResponse({"detail": twice, "error": f"duplicate JSON key(s) {dupes}"}, status_code=422)
    try:
        return model.model_validate_json(body, context=None if slots is None else {"slots": slots})
    except ValidationError as exc:
        # an error of the whole body (not JSON, not an object) is located at `body`
        detail = [
            {"loc": list(e["loc"]) or ["body"], "msg": e["msg"], "type": e["type"]} for e in exc.errors()
        ]
        return JSONResponse({"detail": detail, "error": describe_validation_error(exc)}, status_code=422)


class BodyAdmission:
    """The admission limit of requests still reading their body (`serving.admission_limit`): a
    request holds its slot from its first byte until its body is parsed, so slow clients cannot
    sit in the body phase uncounted; past the limit the ingress answers 503 at once."""

    def __init__(self, limit: int, slots: Collection[str] | None = None) -> None:
        self.limit = limit
        self.slots = None if slots is None else frozenset(slots)  # the configured slots
        self.reading = 0  # requests inside `parse`

    def full(self) -> bool:
        return self.reading >= self.limit

    async def parse(
        self, request: Request, max_bytes: int, model: type[AdRequest] = AdRequest
    ) -> AdRequest | JSONResponse:
        """`parse_ad_request` holding a slot for as long as the body takes to arrive."""
        self.reading += 1
        try:
            return await parse_ad_request(request, max_bytes, model, self.slots)
        finally:
            self.reading -= 1


__all__ = [
    "BodyAdmission",
    "BodyTooLarge",
    "ClientDisconnect",
    "duplicate_keys",
    "error",
    "is_json",
    "overloaded",
    "parse_ad_request",
    "read_body",
    "unsupported_media",
]
