"""The variant bandit's pure core: selection probabilities (closed form, floor, exact propensity),
seeded determinism, a pure update that learns, and the replica's shell."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.errors import SchemaError
from serving.variants import (
    VariantPolicy,
    VariantSelector,
    context,
    empty_state,
    probabilities,
    select,
    set_row,
    update,
    win_probabilities,
)

POLICY = VariantPolicy(noise=0.5, floor=0.1, nodes=48)


def state_with(ids: list[list[str]], dim: int = 4):  # type: ignore[no-untyped-def]
    st = empty_state(dim)
    for row, vids in enumerate(ids):
        st = set_row(st, row, vids, POLICY.prior)
    return st


def test_win_probabilities_match_monte_carlo_draws() -> None:
    rng = np.random.default_rng(0)
    m = rng.normal(0, 0.5, (3, 5))
    s = np.exp(rng.normal(-0.5, 0.7, (3, 5)))
    mask = np.ones((3, 5), dtype=bool)
    mask[2, 3:] = False
    p = win_probabilities(m, s, mask, 96)
    draws = rng.standard_normal((200_000, 3, 5)) * s + m
    draws[:, ~mask] = -np.inf
    mc = np.stack([np.bincount(draws[:, i].argmax(axis=1), minlength=5) for i in range(3)]) / 200_000
    # 5 binomial standard errors at p = 0.5 plus the quadrature's error
    assert np.abs(p - mc).max() < 5 * 0.5 / np.sqrt(200_000) + 0.005
    assert np.allclose(p.sum(axis=1), 1.0) and (p[2, 3:] == 0).all()


def test_probabilities_keep_the_floor_and_sum_to_one() -> None:
    st = state_with([["a", "b", "c"], ["x", "y"]])
    x = context(np.random.default_rng(1).normal(size=(2, 3)), 4)
    st = update(st, np.array([0, 0]), x, np.array([2, 2]), np.array([1.0, 1.0]))  # c gets clicks
    p = probabilities(st, np.array([0, 1]), x, POLICY)
    assert np.allclose(p.sum(axis=1), 1.0)
    assert p[0, :3].min() >= POLICY.floor / 3 - 1e-12 and p[1, 2] == 0.0
    assert p[0].argmax() == 2


def test_the_logged_propensity_is_the_choice_frequency() -> None:
    st = state_with([["a", "b", "c"]])
    x = context(np.array([[0.3, -0.2, 0.5]]), 4)
    st = update(
        st, np.zeros(20, dtype=np.int64), np.repeat(x, 20, axis=0), np.arange(20) % 3, np.arange(20) % 2.0
    )
    rows, xs = np.zeros(40_000, dtype=np.int64), np.repeat(x, 40_000, axis=0)
    chosen, prop = select(st, rows, xs, POLICY, np.random.default_rng(5))
    p = probabilities(st, rows[:1], x, POLICY)[0]
    freq = np.bincount(chosen, minlength=3) / 40_000
    assert np.abs(freq - p).max() < 5 * np.sqrt(0.25 / 40_000)  # 5 standard errors
    assert np.allclose(prop, p[chosen])


def test_select_is_deterministic_under_a_seed() -> None:
    st = state_with([["a", "b", "c", "d"]])
    x = context(np.random.default_rng(2).normal(size=(50, 3)), 4)
    rows = np.zeros(50, dtype=np.int64)
    a = select(st, rows, x, POLICY, np.random.default_rng(7))
    b = select(st, rows, x, POLICY, np.random.default_rng(7))
    assert (a[0] == b[0]).all() and (a[1] == b[1]).all()


def test_update_is_pure_and_learns_who_clicks_what() -> None:
    rng = np.random.default_rng(3)
    st = state_with([["a", "b"]], dim=3)
    before = st.precision.copy()
    # users with a positive first feature click a, the others b
    for _ in range(40):
        v = rng.choice([-1.0, 1.0], size=100)
        x = context(np.stack([v, rng.normal(0, 0.1, 100)], axis=1), 3)
        chosen = rng.integers(2, size=100)
        clicks = ((chosen == 0) == (v > 0)).astype(float)
        new = update(st, np.zeros(100, dtype=np.int64), x, chosen, clicks)
        assert (st.precision == before).all() or st is not new  # the input is never changed
        st, before = new, new.precision.copy()
    pos, neg = context(np.array([[1.0, 0.0], [-1.0, 0.0]]), 3), np.zeros(2, dtype=np.int64)
    p = probabilities(st, neg, pos, VariantPolicy(floor=0.0))
    assert p[0, 0] > 0.99 and p[1, 1] > 0.99


def test_bad_labels_are_refused() -> None:
    st = state_with([["a", "b"]], dim=3)
    x = context(np.zeros((1, 2)), 3)
    with pytest.raises(SchemaError, match="labels"):
        update(st, np.array([0]), x, np.array([0]), np.array([2.0]))
    with pytest.raises(SchemaError, match="row or variant"):
        update(st, np.array([0]), x, np.array([2]), np.array([1.0]))
    with pytest.raises(SchemaError, match="distinct"):
        set_row(st, 1, ["a", "a"], 1.0)


def test_the_selector_shell_registers_chooses_and_learns() -> None:
    sel = VariantSelector(dim=2, policy=POLICY, seed=0)
    sel.register("ad1", ["v0", "v1"])
    sel.register("ad2", ["v0", "v1", "v2"])
    got = sel.choose(["ad2", "plain", "ad1"], np.array([0.5, -0.5]))  # one user for every ad
    assert got[1] == (None, None) and got[0][0] in {"v0", "v1", "v2"} and got[2][0] in {"v0", "v1"}
    assert all(0 < p <= 1 for _, p in (got[0], got[2]))  # type: ignore[operator]
    n = sel.learn(["ad1", "ad1", "gone"], np.zeros((3, 2)), ["v1", "v9", "v0"], [True, False, True])
    assert n == 1
    sel.register("ad1", ["w0"])  # new variants: a fresh posterior
    assert sel.choose(["ad1"], np.zeros((1, 2))) == [("w0", 1.0)]


def test_a_click_correcting_a_learned_non_click_equals_learning_the_click_once() -> None:
    """Fake-negative labels: a non-click learned at once, then its click as a correction
    (`new=False`), end at the posterior of the final label learned once."""
    st = state_with([["a", "b"]])
    x = context(np.array([[0.4, -0.1, 0.2], [0.1, 0.3, -0.5]]), 4)
    rows, chosen = np.array([0, 0]), np.array([1, 1])
    once = update(st, rows, x, chosen, np.array([1.0, 0.0]))
    fake = update(st, rows, x, chosen, np.array([0.0, 0.0]))
    fixed = update(fake, rows[:1], x[:1], chosen[:1], np.array([1.0]), np.array([False]))
    for name in ("precision", "target", "cov", "mean"):
        assert np.allclose(getattr(fixed, name), getattr(once, name)), name


def test_an_in_place_update_equals_the_pure_one() -> None:
    st = state_with([["a", "b", "c"], ["x", "y"]])
    x = context(np.random.default_rng(3).normal(size=(5, 3)), 4)
    rows, chosen, y = np.array([0, 1, 0, 1, 0]), np.array([2, 0, 2, 1, 0]), np.array([1.0, 0, 0, 1, 1])
    pure = update(st, rows, x, chosen, y)
    copy = state_with([["a", "b", "c"], ["x", "y"]])
    inplace = update(copy, rows, x, chosen, y, inplace=True)
    assert inplace.precision is copy.precision  # written, not copied
    for name in ("precision", "target", "cov", "mean"):
        assert np.array_equal(getattr(inplace, name), getattr(pure, name)), name


def test_settings_configure_the_selector() -> None:
    from schemas.settings import Settings

    s = Settings(state_dim=8, variants={"prior": 2.0, "noise": 0.3, "floor": 0.2})
    sel = VariantSelector.from_settings(s)
    assert sel.policy == VariantPolicy(prior=2.0, noise=0.3, floor=0.2) and sel.state.dim == 9
    sel.register("ad1", ["a", "b"])
    assert sel.shares("ad1", np.zeros(8)) == pytest.approx({"a": 0.5, "b": 0.5})
    off = VariantSelector.from_settings(Settings(state_dim=8, variants={"enabled": False}))
    off.register("ad1", ["a", "b"])  # off: no ad gets a variant
    assert off.choose(["ad1"], np.zeros((1, 8))) == [(None, None)] and off.shares("ad1", np.zeros(8)) == {}
