"""`AdstreamClient` / `AsyncAdstreamClient`: the HTTP API as typed calls.

Retried (tenacity, exponential backoff with full jitter, at least the server's Retry-After):
connection errors and timeouts, 429 (the key's rate limit), 502/503/504 (overload, broker not
acknowledging). Sending a batch again is safe: the collector produces a batch only when it
answers 2xx, and every event keeps its `event_id`, on which the stores deduplicate. Any other
answer is final: 200/207/422 of `/v1/events` come back as an `EventsResult` (422 when no event
was accepted, each refusal named), every other status raises `AdstreamHTTPError`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import httpx
from pydantic import ValidationError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)

from adstream_client.events import view_for
from schemas.api import AdRequest, AdResponse, RankRequest, RankResponse
from schemas.collect import EventsResult
from schemas.errors import AdstreamError
from schemas.events import Message

RETRY_STATUSES: Final = frozenset({429, 502, 503, 504})
EVENT_STATUSES: Final = frozenset({200, 207, 422})


class AdstreamHTTPError(AdstreamError):
    """The server answered with a status the call cannot use (the message has its `detail`)."""

    def __init__(self, status: int, detail: Any, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail
        self.retry_after = retry_after


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a call is retried (`attempts` 1: never)."""

    attempts: int = 4
    initial_s: float = 0.1
    max_s: float = 5.0
    jitter_s: float = 0.1

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1 (got {self.attempts})")
        if not 0 <= self.initial_s <= self.max_s:
            raise ValueError(
                f"RetryPolicy needs 0 <= initial_s <= max_s (got {self.initial_s}, {self.max_s})"
            )

    def tenacity_args(self) -> dict[str, Any]:
        backoff = wait_exponential_jitter(multiplier=self.initial_s, max=self.max_s, jitter=self.jitter_s)

        def wait(state: RetryCallState) -> float:
            exc = state.outcome.exception() if state.outcome is not None else None
            after = getattr(exc, "retry_after", None) or 0.0
            return float(min(max(backoff(state), after), max(self.max_s, after)))

        return {
            "stop": stop_after_attempt(self.attempts),
            "wait": wait,
            "retry": retry_if_exception(_retryable),
            "reraise": True,
        }


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, AdstreamHTTPError):
        return exc.status in RETRY_STATUSES
    return isinstance(exc, httpx.TransportError)  # connect, read, write errors and timeouts


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _detail(resp: httpx.Response) -> Any:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    return body.get("detail", body) if isinstance(body, dict) else body


def _checked(resp: httpx.Response, ok: frozenset[int]) -> httpx.Response:
    if resp.status_code not in ok:
        raise AdstreamHTTPError(resp.status_code, _detail(resp), _retry_after(resp))
    return resp


def _result(resp: httpx.Response) -> EventsResult:
    """The EventsResult of a 200/207/422; a 422 of the body as a whole (`{"detail": …}`) raises."""
    try:
        return EventsResult.model_validate_json(resp.content)
    except ValidationError:
        raise AdstreamHTTPError(resp.status_code, _detail(resp)) from None


def _batch(events: Sequence[Message]) -> bytes:
    return ('{"events":[' + ",".join(e.model_dump_json(exclude_none=True) for e in events) + "]}").encode()


def _ad_request(user_id: str | AdRequest, fields: dict[str, Any]) -> AdRequest:
    if isinstance(user_id, AdRequest):
        return user_id
    return AdRequest.model_validate_json(json.dumps({"user_id": user_id, **fields}))


def _rank_request(
    user_id: str | RankRequest, candidates: Sequence[str], fields: dict[str, Any]
) -> RankRequest:
    if isinstance(user_id, RankRequest):
        return user_id
    return RankRequest.model_validate_json(
        json.dumps({"user_id": user_id, "candidates": list(candidates), **fields})
    )


class _Base:
    def __init__(self, api_key: str | None, retry: RetryPolicy | None) -> None:
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["X-Api-Key"] = api_key
        self.retry = retry or RetryPolicy()


class AdstreamClient(_Base):
    """Blocking client. `ads("u1", slot="feed", k=3)` → `AdResponse`; `events([...])` →
    `EventsResult`. Use as a context manager, or `close()` it."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 5.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(api_key, retry)
        self.http = httpx.Client(base_url=base_url, timeout=timeout_s, transport=transport)

    def _post(self, path: str, body: bytes, ok: frozenset[int]) -> httpx.Response:
        for attempt in Retrying(**self.retry.tenacity_args()):
            with attempt:
                return _checked(self.http.post(path, content=body, headers=self.headers), ok)
        raise AssertionError("unreachable: tenacity re-raises the last error")

    def ads(self, user_id: str | AdRequest, **fields: Any) -> AdResponse:
        """Ranked ads for a user and slot (`AdRequest` fields as keywords, or an `AdRequest`)."""
        body = _ad_request(user_id, fields).model_dump_json(exclude_none=True).encode()
        return AdResponse.model_validate_json(self._post("/v1/ads", body, frozenset({200})).content)

    def rank(self, user_id: str | RankRequest, candidates: Sequence[str] = (), **fields: Any) -> RankResponse:
        """Your own candidate ad ids ranked for a user and slot (`RankRequest`): the best `k`,
        and the ids that were unknown or ineligible."""
        body = _rank_request(user_id, candidates, fields).model_dump_json(exclude_none=True).encode()
        return RankResponse.model_validate_json(self._post("/v1/rank", body, frozenset({200})).content)

    def events(self, events: Sequence[Message]) -> EventsResult:
        """Send a batch; the answer counts what was produced and names each refused event."""
        return _result(self._post("/v1/events", _batch(events), EVENT_STATUSES))

    def view(self, response: AdResponse, position: int, user_id: str) -> EventsResult:
        """The render beacon of the ad at `position` of `response`, served to `user_id`: call it
        when the ad is in view; until then the served ad is no impression (`view_for`)."""
        return self.events([view_for(response, position, user_id)])

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> AdstreamClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncAdstreamClient(_Base):
    """The same calls for asyncio (`await client.ads(...)`); `async with` or `await aclose()`."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 5.0,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(api_key, retry)
        self.http = httpx.AsyncClient(base_url=base_url, timeout=timeout_s, transport=transport)

    async def _post(self, path: str, body: bytes, ok: frozenset[int]) -> httpx.Response:
        async for attempt in AsyncRetrying(**self.retry.tenacity_args()):
            with attempt:
                return _checked(await self.http.post(path, content=body, headers=self.headers), ok)
        raise AssertionError("unreachable: tenacity re-raises the last error")

    async def ads(self, user_id: str | AdRequest, **fields: Any) -> AdResponse:
        """Ranked ads for a user and slot (`AdRequest` fields as keywords, or an `AdRequest`)."""
        body = _ad_request(user_id, fields).model_dump_json(exclude_none=True).encode()
        resp = await self._post("/v1/ads", body, frozenset({200}))
        return AdResponse.model_validate_json(resp.content)

    async def rank(
        self, user_id: str | RankRequest, candidates: Sequence[str] = (), **fields: Any
    ) -> RankResponse:
        """Your own candidate ad ids ranked for a user and slot (`RankRequest`)."""
        body = _rank_request(user_id, candidates, fields).model_dump_json(exclude_none=True).encode()
        resp = await self._post("/v1/rank", body, frozenset({200}))
        return RankResponse.model_validate_json(resp.content)

    async def events(self, events: Sequence[Message]) -> EventsResult:
        """Send a batch; the answer counts what was produced and names each refused event."""
        return _result(await self._post("/v1/events", _batch(events), EVENT_STATUSES))

    async def view(self, response: AdResponse, position: int, user_id: str) -> EventsResult:
        """The render beacon of the ad at `position` of `response` (`AdstreamClient.view`)."""
        return await self.events([view_for(response, position, user_id)])

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncAdstreamClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
