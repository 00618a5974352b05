"""Shared by the serving integration tests: the admin token of the test server and deltas signed
with the stack's key (what the trainer does), since replicas refuse unsigned ones."""

from __future__ import annotations

from pathlib import Path

from schemas.settings import Settings

ADMIN_TOKEN = "test-admin-token-0123456789"  # ≥ 16 characters: shorter ones disable the admin routes
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
STATE_DIR = Path(__file__).resolve().parents[3] / ".adstream" / "test"  # tests/conftest.py's state dir


def delta_key() -> bytes:
    """The delta signing key the test server reads (the stack key file in the tests' state dir)."""
    from schemas.delta import resolve_signing_key

    key = resolve_signing_key(Settings(state_dir=STATE_DIR, delta_signing_key=""))
    assert key is not None
    return key


def make_delta(*args, **kwargs):  # type: ignore[no-untyped-def]
    """`schemas.delta.make_delta`, signed like the trainer signs (replicas refuse unsigned deltas)."""
    from schemas import delta

    return delta.make_delta(*args, key=delta_key(), **kwargs)


def sign(d):  # type: ignore[no-untyped-def]
    """A hand-made (e.g. poisoned) delta signed with the stack key: only its content is bad."""
    from schemas.delta import sign_delta

    return sign_delta(d, delta_key())


def adapter_infos(client):  # type: ignore[no-untyped-def]
    """`GET /v1/adapters` with the admin token (adapter ids name advertisers: admin only)."""
    return client.get("/v1/adapters", headers=ADMIN).json()
