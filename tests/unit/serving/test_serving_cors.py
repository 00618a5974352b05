"""CORS of the publisher routes: preflights answered for allowed origins only, answers marked,
admin routes and unconfigured servers untouched."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from serving.cors import PublisherCors

PAGE = "http://news.example"


async def ok(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok", headers={"Retry-After": "1"})


@pytest.fixture
def client() -> Iterator[TestClient]:
    app = Starlette(routes=[Route("/v1/events", ok, methods=["POST"]), Route("/v1/adapters", ok)])
    app.add_middleware(PublisherCors)
    PublisherCors.configure([PAGE])
    try:
        yield TestClient(app)
    finally:
        PublisherCors.configure([])


def preflight(client: TestClient, path: str, origin: str) -> httpx.Response:
    return client.options(
        path,
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "x-api-key",
        },
    )


def test_preflight_of_an_allowed_origin(client: TestClient) -> None:
    r = preflight(client, "/v1/events", PAGE)
    assert r.status_code == 204
    h = r.headers
    assert h["access-control-allow-origin"] == PAGE and "X-Api-Key" in h["access-control-allow-headers"]


@pytest.mark.parametrize(("path", "origin"), [("/v1/events", "http://evil.example"), ("/v1/adapters", PAGE)])
def test_no_cors_for_other_origins_or_admin_routes(client: TestClient, path: str, origin: str) -> None:
    r = preflight(client, path, origin)
    assert "access-control-allow-origin" not in r.headers
    r = client.post(path, headers={"Origin": origin})
    assert "access-control-allow-origin" not in r.headers


def test_answers_to_allowed_origins_are_readable_with_retry_after(client: TestClient) -> None:
    r = client.post("/v1/events", headers={"Origin": PAGE})
    assert r.text == "ok" and r.headers["access-control-allow-origin"] == PAGE
    assert r.headers["access-control-expose-headers"] == "Retry-After"
    assert "access-control-allow-origin" not in client.post("/v1/events").headers  # no Origin: no CORS


def test_nothing_when_unconfigured(client: TestClient) -> None:
    PublisherCors.configure([])
    assert "access-control-allow-origin" not in client.post("/v1/events", headers={"Origin": PAGE}).headers
    PublisherCors.configure(["*"])
    assert (
        client.post("/v1/events", headers={"Origin": "http://any.example"}).headers[
            "access-control-allow-origin"
        ]
        == "http://any.example"
    )
