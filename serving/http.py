"""Request-edge checks of `/v1/ads` that run before anything is parsed: media type and a body
read with a hard byte limit (a chunked body has no Content-Length to trust)."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import ClientDisconnect, Request


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


__all__ = ["BodyTooLarge", "ClientDisconnect", "duplicate_keys", "is_json", "read_body"]
