"""Admin-route access: which tokens may turn the admin routes on, and the check of a request's token.

Replicas never receive the token itself (Ray keeps actor arguments in its control store and
shows them in its dashboard): only its SHA-256 (`token_digest`), which is all the check needs.
A default, empty or short token turns the admin routes off (every call answers 403 saying so)
instead of letting anyone who knows the default in.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re

from pydantic import SecretStr

log = logging.getLogger(__name__)
MIN_TOKEN_CHARS = 16
WEAK_TOKENS = frozenset({"change-me", "changeme", "admin", "secret", "password", "token"})
_TOKEN = re.compile(r"[\x21-\x7e]+")  # printable ASCII without spaces (RFC 6750 b64token is narrower)


def weak_token_reason(token: str) -> str | None:
    """Why `token` may not guard the admin routes (None when it may).

    >>> weak_token_reason("change-me")
    'admin_token is a well-known default'
    >>> weak_token_reason("s3cret-but-long-enough") is None
    True
    """
    if not token:
        return "admin_token is empty"
    if token.lower() in WEAK_TOKENS:
        return "admin_token is a well-known default"
    if len(token) < MIN_TOKEN_CHARS:
        return f"admin_token has {len(token)} characters; at least {MIN_TOKEN_CHARS} are needed"
    if not _TOKEN.fullmatch(token):
        return "admin_token must be printable ASCII without spaces"
    return None


def token_digest(token: SecretStr) -> str | None:
    """The SHA-256 (hex) replicas check admin tokens against; None (admin routes off, logged)
    when the token is weak."""
    value = token.get_secret_value()
    reason = weak_token_reason(value)
    if reason is not None:
        log.warning("admin routes are disabled: %s (set ADSTREAM_SERVING__ADMIN_TOKEN)", reason)
        return None
    return hashlib.sha256(value.encode()).hexdigest()


def presented_token(authorization: str | None, x_admin_token: str | None) -> str | None:
    """The token a request presents: `Authorization: Bearer <token>` or `X-Admin-Token: <token>`,
    taken literally (no Unicode whitespace stripping: `\\xa0` is not an empty token)."""
    if authorization is not None:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        value = value.strip(" \t")
    elif x_admin_token is not None:
        value = x_admin_token.strip(" \t")
    else:
        return None
    return value if _TOKEN.fullmatch(value) else None


def check_admin(
    authorization: str | None, x_admin_token: str | None, digest: str | None
) -> tuple[int, str] | None:
    """None when the request may use the admin routes, else `(status, why)`: 403 when the routes
    are off, 401 without a usable token, 403 for a wrong one."""
    if digest is None:
        return 403, "admin routes are disabled on this server: no strong admin token is configured"
    if authorization is None and x_admin_token is None:
        return 401, "admin token required (Authorization: Bearer <token>)"
    token = presented_token(authorization, x_admin_token)
    if token is None:
        return 401, "admin token malformed: expected `Authorization: Bearer <token>` in printable ASCII"
    given = hashlib.sha256(token.encode()).hexdigest()
    if not hmac.compare_digest(given, digest):
        return 403, "wrong admin token"
    return None


def api_key_digests(keys: SecretStr) -> frozenset[str]:
    """SHA-256 digests of the comma-separated `serving.api_keys` (empty: /v1/ads is open).

    >>> len(api_key_digests(SecretStr("pub-a, pub-b"))), api_key_digests(SecretStr(""))
    (2, frozenset())
    """
    return frozenset(
        hashlib.sha256(k.strip().encode()).hexdigest()
        for k in keys.get_secret_value().split(",")
        if k.strip()
    )


def check_api_key(presented: str | None, digests: frozenset[str]) -> str | None:
    """None when `/v1/ads` may be served: no keys are configured, or `presented` (the X-Api-Key
    header) is one of them (compared by digest, in constant time per key); else why not (401)."""
    if not digests:
        return None
    if not presented:
        return "missing X-Api-Key"
    given = hashlib.sha256(presented.encode()).hexdigest()
    if not any(hmac.compare_digest(given, d) for d in digests):
        return "unknown X-Api-Key"
    return None
