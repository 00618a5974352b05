"""The Markov chain's structure against a slow, obviously right reference built from tuples.

The reference keeps every state as a tuple of channel names and solves the absorbing chain
with a dense direct solve; the model's chain (numpy, vectorised) must give the same transitions,
conversion probability and removal effects at any channel count the settings allow.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from itertools import pairwise

import numpy as np
import pytest
import scipy.sparse as sp
from scipy.sparse.linalg import spsolve

from attribution.models import ModelConfig, attribute
from attribution.models.markov import _pair, chain, removal_effects, state_ids, transitions
from attribution.paths import AttributionInputError, paths_from_lists

START, CONV, NULL = ("START",), ("CONV",), ("NULL",)
Key = tuple[str, ...]


def _reference(
    paths: list[list[str]], conv: np.ndarray, nulls: np.ndarray, order: int
) -> dict[tuple[Key, Key], float]:
    """(src state, dst state) → weight; a state is the tuple of the last `order` channels."""
    out: dict[tuple[Key, Key], float] = defaultdict(float)
    for p, c, n in zip(paths, conv, nulls, strict=True):
        merged = [ch for i, ch in enumerate(p) if i == 0 or ch != p[i - 1]]
        states = [tuple(merged[max(0, i - order + 1) : i + 1]) for i in range(len(merged))]
        out[(START, states[0])] += c + n
        for a, b in pairwise(states):
            out[(a, b)] += c + n
        out[(states[-1], CONV)] += c
        out[(states[-1], NULL)] += n
    return {k: v for k, v in out.items() if v > 0}


def _reference_p(t: dict[tuple[Key, Key], float], removed: str | None = None) -> float:
    """P(CONV | START), `removed` never entered (its transitions dropped, the rest renormalised)."""
    kept = {(a, b): w for (a, b), w in t.items() if removed is None or b[-1] != removed}
    # a state from which no journey ends (it only loops among such states) never converts
    into: dict[Key, list[Key]] = defaultdict(list)
    for a, b in kept:
        into[b].append(a)
    ends = {a for (a, b) in kept if b in (CONV, NULL)}
    todo = list(ends)
    while todo:
        for a in into[todo.pop()]:
            if a not in ends and a != START:
                ends.add(a)
                todo.append(a)
    kept = {(a, b): w for (a, b), w in kept.items() if a in ends or a == START}
    states = sorted(ends)
    index = {s: i for i, s in enumerate(states)}
    out: dict[Key, float] = defaultdict(float)
    for (a, _), w in kept.items():
        out[a] += w
    q = sp.lil_matrix((len(states), len(states)))
    r = np.zeros(len(states))
    for (a, b), w in kept.items():
        if a == START:
            continue
        if b == CONV:
            r[index[a]] += w / out[a]
        elif b in index:
            q[index[a], index[b]] += w / out[a]
    x = spsolve(sp.identity(len(states), format="csc") - sp.csc_matrix(q), r)
    total = sum(w for (a, _), w in kept.items() if a == START)
    return sum(w * x[index[b]] for (a, b), w in kept.items() if a == START and b in index) / total


def _market(n_channels: int, n_paths: int, seed: int) -> tuple[list[list[str]], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    names = [f"ch{i:05d}" for i in range(n_channels)]
    # every channel appears (the channel count is what overflowed), then random draws
    flat = np.concatenate([rng.permutation(n_channels), rng.integers(0, n_channels, 2 * n_paths)])
    ends = np.cumsum(rng.integers(1, 6, n_paths))
    ends = ends[ends < flat.shape[0]]
    paths = [[names[j] for j in seg] for seg in np.split(flat, ends) if seg.size]
    n_paths = len(paths)
    conv = rng.integers(0, 3, n_paths).astype(float)
    nulls = rng.integers(0, 4, n_paths).astype(float)
    nulls[(conv + nulls) == 0] = 1.0
    return paths, conv, nulls


@pytest.mark.parametrize("order", [1, 2, 3])
def test_chain_matches_the_tuple_reference_with_1500_channels(order: int) -> None:
    # order 3 keyed (src, dst) as (src+3)·(base³+8)+(dst+3): from 1,448 channels that overflows
    # int64 and numpy wraps silently, merging unrelated transitions
    raw, conv, nulls = _market(1500, 500, seed=order)
    p = paths_from_lists(raw, conv, nulls=nulls)
    ref = _reference(raw, conv, nulls, order)
    t = transitions(p, order, p.conversions, p.nulls)
    base, effects = removal_effects(t, len(p.channels), "redistribute")
    assert base == pytest.approx(_reference_p(ref), rel=1e-9)
    names = p.channels

    def key(code: int) -> Key:
        if code == -3:
            return START
        if code == -1:
            return CONV
        if code == -2:
            return NULL
        return tuple(names[c] for c in t.state_channels[code] if c >= 0)

    got = defaultdict(float)
    for s, d, w in zip(t.src.tolist(), t.dst.tolist(), t.weight.tolist(), strict=True):
        got[(key(s), key(d))] += w
    assert dict(got) == pytest.approx(ref)

    rng = np.random.default_rng(0)
    # channels of every index range (the overflow hit the high codes), 25 of them
    for c in sorted({*rng.choice(len(names), 22, replace=False).tolist(), 0, 1447, len(names) - 1}):
        want = max(0.0, 1.0 - _reference_p(ref, names[c]) / base)
        assert effects[c] == pytest.approx(want, abs=1e-9), names[c]


def test_every_channel_of_a_converting_journey_is_credited_at_order_3() -> None:
    # the textbook (null) removal loses every conversion through the channel: each channel on a
    # converting path has a positive effect (109 of 1,500 got none while keys overflowed)
    raw, conv, nulls = _market(1500, 500, seed=9)
    p = paths_from_lists(raw, conv, nulls=nulls)
    r = attribute("markov", p, ModelConfig(markov_order=3, markov_removal="null"))
    on_converting = {ch for path, c in zip(raw, conv, strict=True) if c > 0 for ch in path}
    credited = {ch for ch, v in zip(r.channels, r.conversions, strict=True) if v > 0}
    assert credited == on_converting
    assert r.conversions.sum() == pytest.approx(conv.sum())


def test_a_key_that_would_not_fit_64_bits_is_refused_not_wrapped() -> None:
    # the one limit left: pairs of dense ids whose count exceeds int64 (beyond any real chain)
    ids = np.zeros(1, dtype=np.int64)
    with pytest.raises(AttributionInputError, match="4,294,967,296 × 4,294,967,296 states"):
        _pair(ids, 2**32, ids, 2**32, "states")
    with pytest.raises(AttributionInputError, match="markov order 0"):
        chain(paths_from_lists([["a"]], [1]), 0)


def test_a_removal_that_leaves_a_loop_without_exit_is_solved_not_singular() -> None:
    # feed and search lead only to each other or to splash, and every journey ends after splash:
    # without splash, feed ⇄ search never ends (a closed class: I − Q singular, the solve warned
    # "Matrix is exactly singular" and the model fell back to the null rule). Those journeys
    # never convert: p₋splash = 0 (effect 1); without feed (or search) the journeys go on to
    # splash as before, p stays 1/2 (effect 0): all credit to splash
    p = paths_from_lists([["feed", "search", "feed", "splash"], ["search", "splash"]], [1, 0], nulls=[0, 1])
    t = transitions(p, 1, p.conversions, p.nulls)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        base, effects = removal_effects(t, 3, "redistribute")
        r = attribute("markov", p, ModelConfig(markov_order=1, bootstrap=20))
    assert base == pytest.approx(0.5)
    assert dict(zip(p.channels, effects.tolist(), strict=True)) == pytest.approx(
        {"feed": 0.0, "search": 0.0, "splash": 1.0}
    )
    assert r.meta["removal_used"] == "redistribute"
    assert dict(zip(r.channels, r.conversions.tolist(), strict=True)) == pytest.approx(
        {"feed": 0.0, "search": 0.0, "splash": 1.0}
    )


@pytest.mark.parametrize(("seed", "order"), [(14, 2), (21, 2), (24, 2), (14, 1), (14, 3)])
def test_no_removal_leaves_a_singular_chain_on_a_small_random_market(seed: int, order: int) -> None:
    # 30 channels over 10 sparse journeys: at order 2 some removals leave such loops (these
    # seeds did: the solve warned and its NaN sent the model to the null rule)
    raw, conv, nulls = _market(30, 10, seed=seed)
    p = paths_from_lists(raw, conv, nulls=nulls)
    t = transitions(p, order, p.conversions, p.nulls)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        base, effects = removal_effects(t, len(p.channels), "redistribute")
    ref = _reference(raw, conv, nulls, order)
    assert base == pytest.approx(_reference_p(ref), rel=1e-9)
    for c, name in enumerate(p.channels):
        want = max(0.0, 1.0 - _reference_p(ref, name) / base)
        assert effects[c] == pytest.approx(want, abs=1e-9), name


def test_states_beyond_a_64_bit_code_are_numbered_a_channel_at_a_time() -> None:
    # channel indices past 2^21 at order 3: (channels+1)^3 no longer fits int64, the other path
    big = 3_000_000
    ch = np.array([big, 7, big, big, 7, big, 7], dtype=np.int64)
    pos = np.array([0, 1, 2, 0, 1, 2, 3])
    ids, table = state_ids(ch, pos, 3)
    tuples = [tuple(int(c) for c in table[i] if c >= 0) for i in ids]
    assert tuples == [(big,), (big, 7), (big, 7, big), (big,), (big, 7), (big, 7, big), (7, big, 7)]
    assert len(set(ids.tolist())) == table.shape[0] == 4


def test_rounding_noise_is_no_removal_effect() -> None:
    # every journey converts, and each channel's journeys go on through the others: without any
    # one channel the rest still convert (p₋c = p = 1 in the reference), so no redistributed
    # removal has an effect and the null rule's effects credit. The solve's last-bit noise
    # (p₋splash read 2.2e-16 below p) counted as splash's effect and gave splash every
    # conversion (on the dashboard test's market, 26 of 26)
    raw = [
        ["feed", "search", "search", "search", "splash"],
        ["splash", "feed", "feed", "feed", "feed"],
        ["feed", "search", "splash", "search", "feed"],
        ["feed", "search", "feed", "search", "splash"],
        ["splash", "search", "splash", "search"],
    ]
    conv, nulls = np.ones(len(raw)), np.zeros(len(raw))
    p = paths_from_lists(raw, conv, nulls=nulls)
    ref = _reference(raw, conv, nulls, 1)
    assert {name: 1.0 - _reference_p(ref, name) / _reference_p(ref) for name in p.channels} == pytest.approx(
        {"feed": 0.0, "search": 0.0, "splash": 0.0}, abs=1e-12
    )
    t = transitions(p, 1, p.conversions, p.nulls)
    _, effects = removal_effects(t, len(p.channels), "redistribute")
    assert effects.tolist() == [0.0, 0.0, 0.0]
    r = attribute("markov", p, ModelConfig(markov_order=1, bootstrap=0))
    _, null_effects = removal_effects(t, len(p.channels), "null")
    assert r.meta["removal_used"] == "null"
    assert r.conversions == pytest.approx(5 * null_effects / null_effects.sum())
    assert min(r.conversions) > 0
