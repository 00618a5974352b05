"""Declared interests of simulated users: their true top categories, some declared wrongly."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.api import AdRequest
from schemas.errors import ConfigError
from workloads import Market, MarketConfig


def top_categories(market: Market, user: int, k: int) -> set[str]:
    taste = market.world.interests[user]
    return {market.world.categories[int(c)] for c in np.argsort(-taste)[:k]}


def test_declared_interests_are_the_true_top_categories_with_some_wrong() -> None:
    market = Market(MarketConfig(seed=3, n_users=2000, declared_interests=2, declared_error=0.25))
    right = total = 0
    for u in range(2000):
        declared = market.declared_interests(market.user_id(u))
        assert len(declared) == 2 and len(set(declared)) == 2
        assert set(declared) <= set(market.world.categories)
        top = top_categories(market, u, 2)
        right += len(set(declared) & top)
        total += 2
    assert 0.70 < right / total < 0.80  # 1 - declared_error of them are right


def test_no_error_declares_exactly_the_top_and_zero_declares_nothing() -> None:
    exact = Market(MarketConfig(seed=1, declared_error=0.0, declared_interests=3))
    for u in range(50):
        assert set(exact.declared_interests(exact.user_id(u))) == top_categories(exact, u, 3)
    none = Market(MarketConfig(seed=1, declared_interests=0))
    assert none.declared_interests(none.user_id(0)) == ()


def test_interests_leave_the_rest_of_the_world_and_the_stream_as_they_were() -> None:
    a = Market(MarketConfig(seed=5, declared_error=0.0))
    b = Market(MarketConfig(seed=5, declared_error=0.5))
    assert np.array_equal(a.world.interests, b.world.interests)
    assert [m.model_dump_json() for m in a.open_loop(300)] == [m.model_dump_json() for m in b.open_loop(300)]
    assert a.declared_interests("u000001") == Market(
        MarketConfig(seed=5, declared_error=0.0)
    ).declared_interests("u000001")


def test_requests_carry_the_users_declared_interests_and_fit_the_contract() -> None:
    market = Market(MarketConfig(seed=2))
    for _ in range(20):
        req = market.next_request()
        assert req.interests == market.declared_interests(req.user_id)
        AdRequest(user_id=req.user_id, slot=req.slot, k=req.k, interests=list(req.interests))


@pytest.mark.parametrize(("field", "value"), [("declared_interests", -1), ("declared_error", 1.5)])
def test_bad_interest_knobs_are_refused(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        MarketConfig(**{field: value})
