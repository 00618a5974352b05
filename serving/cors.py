"""CORS for the publisher routes (`/v1/ads`, `/v1/events`), so the web snippet works on pages of
other origins: `collector.cors_origins` lists the pages' origins (`*`: any); empty, nothing is
answered or added. The admin routes never get CORS (a browser may not call them cross-origin).

A pure ASGI middleware added to the app at import (`PublisherCors`), configured by the replica
at start (`configure`): the app's middleware stack may be built before the replica's constructor
runs, and a request without an `Origin` header costs one check."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, ClassVar, Final

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PATHS: Final = frozenset({"/v1/ads", "/v1/events"})
ALLOW_HEADERS: Final = b"Content-Type, X-Api-Key"
MAX_AGE_S: Final = b"600"


class PublisherCors:
    """Answers CORS preflights of the publisher routes and marks their answers readable by
    the allowed origins (Retry-After exposed: the snippet and clients back off by it)."""

    origins: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    @classmethod
    def configure(cls, origins: list[str]) -> None:
        cls.origins = frozenset(origins)

    def allowed(self, scope: Scope) -> bytes | None:
        """The request's Origin when CORS applies to it and the origin is allowed, else None."""
        if scope["type"] != "http" or not self.origins or scope.get("path") not in PATHS:
            return None
        for name, value in scope.get("headers", ()):
            if name == b"origin":
                text = value.decode("latin-1")
                return value if text in self.origins or "*" in self.origins else None
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        origin = self.allowed(scope)
        if origin is None:
            await self.app(scope, receive, send)
            return
        common = [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]
        if scope["method"] == "OPTIONS":
            headers = [
                *common,
                (b"access-control-allow-methods", b"POST"),
                (b"access-control-allow-headers", ALLOW_HEADERS),
                (b"access-control-max-age", MAX_AGE_S),
            ]
            await send({"type": "http.response.start", "status": 204, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return

        async def marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *message.get("headers", []),
                    *common,
                    (b"access-control-expose-headers", b"Retry-After"),
                ]
            await send(message)

        await self.app(scope, receive, marked)
