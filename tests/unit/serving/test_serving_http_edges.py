"""Admin tokens and request edges of the ad server (issue 14: H1, L6, M3, L7), without a cluster:
the checks run on real Starlette requests fed through an ASGI receive channel."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest
from pydantic import SecretStr
from starlette.requests import Request

from schemas.settings import Settings
from serving.admin import check_admin, presented_token, token_digest, weak_token_reason
from serving.http import BodyTooLarge, duplicate_keys, is_json, read_body

STRONG = "a-strong-admin-token-0123"


# -- H1: admin tokens ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "token", ["", "change-me", "CHANGE-ME", "short-token", "with space in it ok?", "tökén-tökén-tökén"]
)
def test_weak_admin_tokens_disable_the_admin_routes(token: str) -> None:
    assert weak_token_reason(token) is not None
    digest = token_digest(SecretStr(token))
    assert digest is None
    # nothing opens a disabled route: not the token itself, not an empty or a \xa0 header
    for header in (f"Bearer {token}", "Bearer ", "Bearer \xa0", "\xa0", ""):
        status, why = check_admin(header, None, digest)  # type: ignore[misc]
        assert status == 403 and "disabled" in why


def test_default_settings_have_the_admin_routes_off() -> None:
    assert token_digest(Settings().serving.admin_token) is None


def test_strong_token_opens_and_nothing_else_does() -> None:
    digest = token_digest(SecretStr(STRONG))
    assert digest == hashlib.sha256(STRONG.encode()).hexdigest()
    assert check_admin(f"Bearer {STRONG}", None, digest) is None
    assert check_admin(None, STRONG, digest) is None
    assert check_admin(None, None, digest) == (401, "admin token required (Authorization: Bearer <token>)")
    for header in (
        "Bearer \xa0",  # .strip() used to make this the empty token
        f"Bearer \xa0{STRONG}",
        f"Bearer {STRONG}\xa0",
        f"Basic {STRONG}",
        STRONG,
        f"Bearer {STRONG[:-1]}",
        f"Bearer {STRONG}x",
    ):
        denied = check_admin(header, None, digest)
        assert denied is not None and denied[0] in (401, 403), header


def test_presented_token_is_taken_literally() -> None:
    assert presented_token("Bearer  tok", None) == "tok"  # ASCII spaces only
    assert presented_token("bearer tok", None) == "tok"
    assert presented_token("Bearer \u2003tok", None) is None
    assert presented_token(None, "\xa0") is None


def test_replicas_get_a_digest_not_the_token() -> None:
    """L6: Ray keeps actor init args in its control store; the settings payload holds no secret."""
    from serving.app import settings_payload

    s = Settings(serving={"admin_token": STRONG}, delta_signing_key="k" * 40)
    payload = settings_payload(s)
    assert STRONG not in payload and "k" * 40 not in payload
    data = json.loads(payload)
    assert "admin_token" not in data and "delta_signing_key" not in data
    assert Settings(**data).serving.admin_token.get_secret_value() == ""


# -- M3: bodies ------------------------------------------------------------------------------
def _request(chunks: list[bytes], headers: dict[str, str]) -> tuple[Request, list[int]]:
    """A Starlette request whose body arrives as `chunks`; `sent[0]` counts chunks handed out."""
    sent = [0]

    async def receive() -> dict[str, object]:
        if sent[0] < len(chunks):
            sent[0] += 1
            return {"type": "http.request", "body": chunks[sent[0] - 1], "more_body": sent[0] < len(chunks)}
        return {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/ads",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "query_string": b"",
    }
    return Request(scope, receive), sent


def test_chunked_body_over_the_limit_is_refused_without_reading_it_all() -> None:
    chunks = [b"x" * 16_384] * 10_000  # a 160 MB chunked body
    req, sent = _request(chunks, {"transfer-encoding": "chunked"})
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(req, 64 * 1024))
    assert sent[0] == 5  # 4 chunks fit 64 KiB; the fifth passes it and reading stops


def test_declared_length_over_the_limit_is_refused_before_reading() -> None:
    req, sent = _request([b"{}"], {"content-length": str(10**9)})
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(req, 64 * 1024))
    assert sent[0] == 0
    req, sent = _request([b"{}"], {"content-length": "12abc"})
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(req, 64 * 1024))


def test_body_under_the_limit_is_read_whole() -> None:
    req, _ = _request([b'{"user_id":', b' "u", "slot": "feed"}'], {"transfer-encoding": "chunked"})
    assert asyncio.run(read_body(req, 64 * 1024)) == b'{"user_id": "u", "slot": "feed"}'


# -- L7: media type ------------------------------------------------------------------------
def test_only_json_bodies_are_ads_requests() -> None:
    assert is_json("application/json") and is_json("Application/JSON; charset=utf-8")
    for ct in (
        None,
        "",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; b=x",
        "application/jsonx",
    ):
        assert not is_json(ct)


# -- L4: duplicate keys ----------------------------------------------------------------------
def test_duplicate_json_keys_are_found() -> None:
    assert duplicate_keys(b'{"user_id": "a", "slot": "feed", "user_id": "b"}') == ["user_id"]
    assert duplicate_keys(b'{"user_id": "a", "context": {"x": 1, "x": 2}}') == ["x"]
    assert duplicate_keys(b'{"user_id": "a", "context": {"user_id": 1}}') == []  # other objects
    assert duplicate_keys(b"not json") == [] and duplicate_keys(b"[" * 100_000) == []


# -- H8: /v1/ads can require a publisher API key (serve_api_keys)
def test_api_keys_gate_v1_ads_only_when_configured() -> None:
    from pydantic import SecretStr

    from serving.admin import api_key_digests, check_api_key

    assert check_api_key(None, api_key_digests(SecretStr(""))) is None  # none configured: open
    keys = api_key_digests(SecretStr(" pub-alpha-123 ,pub-beta-456,"))
    assert len(keys) == 2 and "pub-alpha-123" not in keys  # digests only, spaces and empties dropped
    assert check_api_key("pub-alpha-123", keys) is None
    assert check_api_key("pub-beta-456", keys) is None
    assert check_api_key(None, keys) == "missing X-Api-Key"
    assert check_api_key("", keys) == "missing X-Api-Key"
    assert check_api_key("pub-alpha-1234", keys) == "unknown X-Api-Key"


def test_api_keys_reach_replicas_as_digests_not_in_the_settings_payload() -> None:
    from pydantic import SecretStr

    from schemas.settings import Settings
    from serving.app import settings_payload

    s = Settings(serving={"api_keys": SecretStr("pub-alpha-123")})
    assert "pub-alpha-123" not in settings_payload(s) and "serve_api_keys" not in settings_payload(s)
