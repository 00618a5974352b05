"""Request-edge checks of `/v1/ads` that run before anything is parsed: media type and a body
read with a hard byte limit (a chunked body has no Content-Length to trust)."""

from __future__ import annotations

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


__all__ = ["BodyTooLarge", "ClientDisconnect", "is_json", "read_body"]
