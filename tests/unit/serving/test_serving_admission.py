"""A request still reading its body holds an admission slot (issue 14: M3, second half)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from schemas.api import AdRequest
from serving.http import BodyAdmission


def _slow_request(first: bytes, rest: bytes, go_on: asyncio.Event) -> Request:
    """A request whose body's second chunk arrives only once `go_on` is set (a slow client)."""
    sent = [0]

    async def receive() -> dict[str, object]:
        sent[0] += 1
        if sent[0] == 1:
            return {"type": "http.request", "body": first, "more_body": True}
        if sent[0] == 2:
            await go_on.wait()
            return {"type": "http.request", "body": rest, "more_body": False}
        return {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/ads",
        "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
        "query_string": b"",
    }
    return Request(scope, receive)


def test_slow_bodies_hold_their_slots_until_read() -> None:
    """In-flight was counted only after the body was read: any number of slow clients could sit
    in the body phase unseen by the admission limit. A slot is held from the first byte."""

    async def run() -> None:
        gate = BodyAdmission(limit=2)
        go_on = asyncio.Event()
        bodies = [_slow_request(b'{"user_id": "u', b'", "slot": "feed"}', go_on) for _ in range(2)]
        slow = [asyncio.create_task(gate.parse(body, 65536)) for body in bodies]
        await asyncio.sleep(0.05)  # both have read their first chunk and wait for the rest
        assert gate.reading == 2 and gate.full()
        go_on.set()
        got = await asyncio.gather(*slow)
        assert all(isinstance(r, AdRequest) and r.user_id == "u" for r in got)
        assert gate.reading == 0 and not gate.full()

    asyncio.run(run())


def test_a_refused_or_broken_body_gives_its_slot_back() -> None:
    async def run() -> None:
        gate = BodyAdmission(limit=1)
        go_on = asyncio.Event()
        go_on.set()
        r = await gate.parse(_slow_request(b"x" * 70_000, b"", go_on), 65536)  # over the limit
        assert not isinstance(r, AdRequest) and r.status_code == 413
        r = await gate.parse(_slow_request(b'{"user_id": 3', b"}", go_on), 65536)
        assert not isinstance(r, AdRequest) and r.status_code == 422
        assert gate.reading == 0 and not gate.full()

    asyncio.run(run())
