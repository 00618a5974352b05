"""Shared by the serving integration tests: the admin token of the test server, deltas signed
with the stack's key (what the trainer does), since replicas refuse unsigned ones, and a
request path (`serving.request.RequestPath`) over a small catalog with a slot adapter."""

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


def add_ads(pipe, ts, n=40):  # type: ignore[no-untyped-def]
    """`n` ads over three categories, four campaigns and six advertisers, budgets out of reach."""
    from schemas.events import AdCreative

    for i in range(n):
        cat = ["shoes", "tech", "food"][i % 3]
        pipe.add_ad(
            AdCreative(event_id=f"e{i}", ts=ts, ad_id=f"a{i}", campaign_id=f"c{i % 4}",
                       advertiser_id=f"v{i % 6}", category=cat, title=f"{cat} item {i}", bid=1.0 + i % 3,
                       daily_budget=1e6, active=True)
        )  # fmt: skip


def put_slot_adapter(pipe, slot, version="seq-1"):  # type: ignore[no-untyped-def]
    """A slot adapter for `slot`, in both arms, with weights large enough to move the scores."""
    import torch

    from serving.adapters import CANDIDATE, STABLE

    bank = pipe.rank.bank
    g = torch.Generator().manual_seed(1)
    weights = {
        name: (
            torch.randn(bank.rank, s.fan_in, generator=g) * 0.3,
            torch.randn(s.fan_out, bank.rank, generator=g) * 0.3,
        )
        for name, s in bank.shapes.items()
    }
    bank.put(slot, weights, version=version, seq=1, base_version="v0", arms=(STABLE, CANDIDATE))
