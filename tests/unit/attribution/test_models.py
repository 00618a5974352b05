"""Every model against hand-computed cases, the Shapley axioms, efficiency and determinism."""

from __future__ import annotations

import numpy as np
import pytest

from attribution.models import MODELS, ModelConfig, attribute
from attribution.models.markov import choose_order, conversion_probability, transitions
from attribution.models.shapley import CoalitionValue, _exact_group, _sampled, channel_masks
from attribution.paths import AttributionInputError, paths_from_lists
from schemas.errors import AdstreamError

VIEW, CLICK = 0, 1


def credit(model: str, paths, **cfg) -> dict[str, float]:  # type: ignore[no-untyped-def]
    r = attribute(model, paths, ModelConfig(**cfg))
    return {c: round(float(v), 6) for c, v in zip(r.channels, r.conversions, strict=True)}


@pytest.fixture
def three() -> object:
    # path 1: a(view) b(click) c(click), 2 conversions worth 20; path 2: c(view) a(view), 1 worth 4
    return paths_from_lists(
        [["a", "b", "c"], ["c", "a"]], [2, 1], value=[20.0, 4.0],
        kinds=[[VIEW, CLICK, CLICK], [VIEW, VIEW]], ages_h=[[48, 24, 0], [1, 0]],
    )  # fmt: skip


def test_heuristics_by_hand(three: object) -> None:
    assert credit("first_click", three) == {"a": 2.0, "b": 0.0, "c": 1.0}
    assert credit("last_click", three) == {"a": 1.0, "b": 0.0, "c": 2.0}
    # path 2 has no click: its last view takes the credit
    assert credit("last_non_view", three) == {"a": 1.0, "b": 0.0, "c": 2.0}
    assert credit("linear", three) == pytest.approx({"a": 2 / 3 + 0.5, "b": 2 / 3, "c": 2 / 3 + 0.5})
    # 40/20/40 over three touches; two touches split 0.4 : 0.4 → halves
    assert credit("position_based", three) == pytest.approx({"a": 0.8 + 0.5, "b": 0.4, "c": 0.8 + 0.5})


def test_time_decay_uses_real_ages_and_kind_weights(three: object) -> None:
    day = 86400.0
    got = credit("time_decay", three, half_life_s=day, view_weight=0.5, click_weight=1.0)
    w1 = np.array([0.5 * 0.25, 1.0 * 0.5, 1.0])  # a view 2 d old, b click 1 d, c click now
    w2 = np.array([0.5 * 2 ** (-1 / 24), 0.5])  # c view 1 h old, a view now
    p1, p2 = 2 * w1 / w1.sum(), w2 / w2.sum()
    assert got == pytest.approx({"a": p1[0] + p2[1], "b": p1[1], "c": p1[2] + p2[0]})


def test_simplified_shapley_is_linear_over_distinct_channels() -> None:
    p = paths_from_lists([["a", "a", "a", "b"]], [1])
    assert credit("simplified_shapley", p) == {"a": 0.5, "b": 0.5}
    assert credit("linear", p) == {"a": 0.75, "b": 0.25}


def test_markov_first_order_by_hand() -> None:
    # START→A 2/3, →B 1/3; A→B 1/2, A→NULL 1/2; B→CONV 1: p = 2/3; without A 1/3, without B 0
    p = paths_from_lists([["A", "B"], ["A"], ["B"]], [1, 0, 1], nulls=[0, 1, 0])
    t = transitions(p, 1, p.conversions, p.nulls)
    assert conversion_probability(t) == pytest.approx(2 / 3)
    assert conversion_probability(t, removed=0) == pytest.approx(1 / 3)
    assert conversion_probability(t, removed=1) == pytest.approx(0.0)
    # removal effects 1/2 and 1 → shares 1/3, 2/3 of the 2 conversions
    assert credit("markov", p, markov_order=1, markov_removal="null") == pytest.approx(
        {"A": 2 / 3, "B": 4 / 3}
    )
    # redistributed: without A every journey starts at B and converts (p 1 > 2/3: no effect);
    # without B, A's journeys have only NULL left (p 0: effect 1)
    assert conversion_probability(t, removed=0, removal="redistribute") == pytest.approx(1.0)
    assert conversion_probability(t, removed=1, removal="redistribute") == pytest.approx(0.0)
    assert credit("markov", p, markov_order=1) == pytest.approx({"A": 0.0, "B": 2.0})


def test_markov_loop_solved_exactly() -> None:
    # B→A→B loops: x_B = 2/3 + x_A/3, x_A = 2/3 x_B → x_B = 6/7; removing A: RE 2/3, B: 1
    p = paths_from_lists([["A", "B", "B"], ["A"], ["B", "A", "B"]], [1, 0, 1], nulls=[0, 1, 0])
    assert credit("markov", p, markov_order=1, markov_removal="null") == pytest.approx({"A": 0.8, "B": 1.2})
    # redistributed: without A, B converts with 2/3 ÷ 2/3 = 1 (p 1 > 2/3); without B, A → NULL
    assert credit("markov", p, markov_order=1) == pytest.approx({"A": 0.0, "B": 2.0})


def test_markov_redistribution_credits_what_converts_above_the_others() -> None:
    # journeys at A convert 3 in 4, at B 1 in 4, half start at each (p = 1/2). The null rule
    # credits A 0.75 : B 0.25 (as last-click would); redistributed, removing B raises p to 3/4
    # (no effect) and removing A lowers it to 1/4 (effect 1/2): all 4 conversions go to A
    p = paths_from_lists([["A"], ["B"]], [3, 1], nulls=[1, 3])
    assert credit("markov", p, markov_order=1, markov_removal="null") == pytest.approx({"A": 3.0, "B": 1.0})
    assert credit("markov", p, markov_order=1) == pytest.approx({"A": 4.0, "B": 0.0})
    # no channel's redistributed removal lowers p (A and B each: continuing leads to NULL as
    # often as converting does, p 1/2 with or without either): the null rule's effects credit
    p = paths_from_lists([["A"], ["A", "B"], ["B"], ["B", "A"]], [1, 0, 1, 0], nulls=[0, 1, 0, 1])
    r = attribute("markov", p, ModelConfig(markov_order=1))
    assert r.conversions.tolist() == pytest.approx([1.0, 1.0]) and r.meta["removal_used"] == "null"
    with pytest.raises(AttributionInputError, match="markov removal 'drop'"):
        attribute("markov", p, ModelConfig(markov_order=1, markov_removal="drop"))


def test_markov_order_chosen_on_heldout_likelihood() -> None:
    # whether a journey converts after m depends on the step before m: order 2 predicts it,
    # order 1 cannot, order 3 adds nothing (a tie goes to the lower order)
    p = paths_from_lists([["x", "m"], ["y", "m"]], [400, 0], nulls=[0, 400])
    order, scores = choose_order(p, seed=0)
    assert order == 2 and scores[2] > scores[1] + 0.1
    # and when it depends on the step two before m, order 3 wins
    p = paths_from_lists([["x", "a", "m"], ["y", "a", "m"]], [400, 0], nulls=[0, 400])
    order, scores = choose_order(p, seed=0)
    assert order == 3 and scores[3] > scores[2] + 0.1


def test_shapley_two_players_by_hand() -> None:
    # coalition values from the data (no shrinkage): v(a)=.1, v(b)=.3, v(ab)=.6, v(∅)=0
    masks = np.array([1, 2, 3], dtype=np.uint64)
    conv, nulls = np.array([10.0, 30.0, 60.0]), np.array([90.0, 70.0, 40.0])
    game = CoalitionValue(masks, conv, nulls, 2, prior_journeys=0.0)
    game.set_baseline(0.0)
    phi = _exact_group(np.array([3], dtype=np.uint64), 2, game)[0]
    # φa = ½(v(a) − 0) + ½(v(ab) − v(b)) = .05 + .15; φb = .15 + .25
    assert phi == pytest.approx([0.2, 0.4])


def _game(n: int, seed: int) -> CoalitionValue:
    rng = np.random.default_rng(seed)
    masks = np.arange(1, 2**n, dtype=np.uint64)
    journeys = rng.integers(50, 200, masks.shape[0]).astype(float)
    conv = np.round(journeys * rng.uniform(0, 0.5, masks.shape[0]))
    return CoalitionValue(masks, conv, journeys - conv, n, prior_journeys=0.0)


def test_shapley_axioms_efficiency_symmetry_null_player() -> None:
    game = _game(4, 1)
    full = np.array([15], dtype=np.uint64)
    phi = _exact_group(full, 4, game)[0]
    assert phi.sum() == pytest.approx(game(full)[0] - game.v0)  # efficiency
    # symmetry and null player on a game built for them: c2 ≡ c0, c3 adds nothing
    masks = np.arange(1, 16, dtype=np.uint64)
    bit = lambda m, i: (m >> np.uint64(i)) & np.uint64(1)  # noqa: E731
    v = 0.1 * (bit(masks, 0) + bit(masks, 2)).astype(float) + 0.3 * bit(masks, 1) * bit(masks, 0)
    journeys = np.full(masks.shape[0], 1000.0)
    sym = CoalitionValue(masks, v * 1000, journeys - v * 1000, 4, prior_journeys=0.0)
    sym.set_baseline(0.0)
    phi = _exact_group(full, 4, sym)[0]
    assert phi[0] == pytest.approx(0.1 + 0.15) and phi[2] == pytest.approx(0.1)  # c0 shares c0·c1
    assert phi[3] == pytest.approx(0.0, abs=1e-12)  # null player
    assert phi.sum() == pytest.approx(0.2 + 0.3)


def test_shapley_symmetric_players_equal() -> None:
    masks = np.arange(1, 8, dtype=np.uint64)
    bit = lambda m, i: ((m >> np.uint64(i)) & np.uint64(1)).astype(float)  # noqa: E731
    v = 0.2 * bit(masks, 0) + 0.2 * bit(masks, 1) + 0.1 * bit(masks, 2) + 0.1 * bit(masks, 0) * bit(masks, 1)
    game = CoalitionValue(masks, v * 1000, 1000 - v * 1000, 3, prior_journeys=0.0)
    game.set_baseline(0.0)
    phi = _exact_group(np.array([7], dtype=np.uint64), 3, game)[0]
    assert phi[0] == pytest.approx(phi[1]) and phi[0] == pytest.approx(0.25)
    assert phi[2] == pytest.approx(0.1)


def test_sampled_shapley_matches_exact_within_its_standard_error() -> None:
    game = _game(6, 2)
    full = np.uint64(63)
    exact = _exact_group(np.array([full]), 6, game)[0]
    chans, est, se = _sampled(full, game, 4000, np.random.default_rng(0))
    assert list(chans) == list(range(6))
    assert np.all(np.abs(est - exact) <= 4 * se + 1e-9)
    assert est.sum() == pytest.approx(exact.sum())  # every permutation is efficient


def test_sampling_above_the_cap_is_seeded_and_reports_errors() -> None:
    names = [f"c{i}" for i in range(8)]
    rng = np.random.default_rng(3)
    paths = [list(rng.choice(names, size=rng.integers(1, 9), replace=False)) for _ in range(300)]
    conv = rng.integers(0, 3, 300).astype(float)
    nulls = rng.integers(0, 5, 300).astype(float)
    p = paths_from_lists(paths, conv, nulls=nulls)
    a = attribute("shapley", p, ModelConfig(shapley_exact_max=4, seed=5))
    b = attribute("shapley", p, ModelConfig(shapley_exact_max=4, seed=5))
    exact = attribute("shapley", p, ModelConfig(shapley_exact_max=12))
    assert a.meta["sampled_sets"] > 0 and np.array_equal(a.conversions, b.conversions)
    assert any(s > 0 for s in a.meta["se"])
    assert np.abs(a.conversions - exact.conversions).max() < 0.05 * conv.sum()


@pytest.mark.parametrize("model", list(MODELS))
def test_efficiency_determinism_and_input_untouched(model: str) -> None:
    rng = np.random.default_rng(7)
    names = ["a", "b", "c", "d", "e"]
    paths = [list(rng.choice(names, size=rng.integers(1, 6))) for _ in range(200)]
    conv = rng.integers(0, 4, 200).astype(float)
    value = conv * rng.uniform(5, 50, 200)
    nulls = rng.integers(0, 6, 200).astype(float)
    kinds = [list(rng.integers(0, 2, len(x))) for x in paths]
    ages = [sorted(rng.integers(0, 200, len(x)).tolist(), reverse=True) for x in paths]
    p = paths_from_lists(paths, conv, value=value, nulls=nulls, kinds=kinds, ages_h=ages)
    before = p.conversions.copy(), p.channel.copy()
    cfg = ModelConfig(seed=3, bootstrap=30)
    r1, r2 = attribute(model, p, cfg), attribute(model, p, cfg)
    assert r1.conversions.sum() == pytest.approx(conv.sum())
    assert r1.value.sum() == pytest.approx(value.sum())
    assert np.all(r1.conversions >= -1e-12)
    assert np.array_equal(r1.conversions, r2.conversions) and np.array_equal(r1.ci_low, r2.ci_low)
    assert np.all(r1.ci_low <= r1.ci_high + 1e-9)
    assert np.array_equal(before[0], p.conversions) and np.array_equal(before[1], p.channel)


def test_bad_input_names_the_value() -> None:
    p = paths_from_lists([["a"]], [1])
    with pytest.raises(AttributionInputError, match="'nope'"):
        attribute("nope", p)
    with pytest.raises(AdstreamError, match="no conversion paths"):
        attribute("linear", paths_from_lists([["a"]], [0], nulls=[3]))


def test_shapley_refuses_more_channels_than_a_mask_holds() -> None:
    p = paths_from_lists([[f"c{i}" for i in range(64)]], [1])
    with pytest.raises(AttributionInputError, match="64"):
        channel_masks(p)


def test_dividend_shapley_equals_subset_enumeration(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    shapley_mod = sys.modules["attribution.models.shapley"]
    rng = np.random.default_rng(11)
    names = [f"c{i}" for i in range(9)]
    paths = [list(rng.choice(names, size=rng.integers(1, 8), replace=False)) for _ in range(2000)]
    p = paths_from_lists(paths, rng.integers(0, 3, 2000), nulls=rng.integers(0, 6, 2000))
    dense, _, _ = shapley_mod.shapley(p, 12, 50, 0)
    monkeypatch.setattr(shapley_mod, "DENSE_MAX", 0)  # no table: enumerate each set's subsets
    enumerated, _, _ = shapley_mod.shapley(p, 12, 50, 0)
    assert dense == pytest.approx(enumerated, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("at", [0, 2, 5])
def test_a_conversion_without_touchpoint_is_not_credited_to_any_channel(model: str, at: int) -> None:
    # an empty path (a conversion no touch preceded) shifted its conversions onto the next path,
    # was dropped by the rules but scaled into Markov's total, and made Shapley's reduceat read
    # past the end (IndexError) when last. It is reported, as the path build reports direct
    # conversions, and every channel's credit is that of the same paths without it
    rng = np.random.default_rng(5)
    names = ["a", "b", "c", "d"]
    paths = [list(rng.choice(names, size=rng.integers(1, 4))) for _ in range(5)]
    conv, value, nulls = [2.0, 1.0, 0.0, 3.0, 1.0], [20.0, 5.0, 0.0, 9.0, 4.0], [1.0, 2.0, 3.0, 0.0, 1.0]
    cfg = ModelConfig(seed=1, markov_order=1, bootstrap=10)
    want = attribute(model, paths_from_lists(paths, conv, value=value, nulls=nulls), cfg)
    with_empty = paths_from_lists(
        [*paths[:at], [], *paths[at:]], [*conv[:at], 4.0, *conv[at:]],
        value=[*value[:at], 40.0, *value[at:]], nulls=[*nulls[:at], 2.0, *nulls[at:]],
    )  # fmt: skip
    got = attribute(model, with_empty, cfg)
    assert got.channels == want.channels
    assert got.conversions == pytest.approx(want.conversions)
    assert got.value == pytest.approx(want.value)
    assert got.meta["unattributed_conversions"] == 4.0 and got.meta["unattributed_value"] == 40.0


def test_only_empty_paths_are_refused_by_name() -> None:
    with pytest.raises(AttributionInputError, match="no touchpoint"):
        attribute("linear", paths_from_lists([[], []], [1, 2]))


def test_shapley_masks_skip_empty_segments() -> None:
    p = paths_from_lists([["a"], [], ["b", "a"], []], [1, 1, 1, 1])
    assert channel_masks(p).tolist() == [1, 0, 3, 0]


def test_markov_and_shapley_called_directly_leave_empty_paths_out() -> None:
    from attribution.models.markov import markov
    from attribution.models.shapley import shapley

    p = paths_from_lists([["a", "b"], [], ["b"]], [1, 5, 2], nulls=[1, 1, 1])
    q = paths_from_lists([["a", "b"], ["b"]], [1, 2], nulls=[1, 1])
    assert markov(p, 1)[0] == pytest.approx(markov(q, 1)[0]) and markov(p, 1)[0].sum() == pytest.approx(3)
    assert shapley(p, 12, 10, 0)[0] == pytest.approx(shapley(q, 12, 10, 0)[0])
