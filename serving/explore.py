"""Exploration in rerank with logged propensities: epsilon-greedy per served position.

Rerank ranks the candidates into a list L (best first, its caps, pacing and diversity applied).
Positions are filled in turn: with probability 1 − ε the best remaining ad of L (the greedy
choice), with probability ε one drawn uniformly from the best `top_m` remaining. The probability
with which the ad at a position was chosen, given the positions before it, is exact:

    P(greedy ad) = (1 − ε) + ε / m,    P(another of the m) = ε / m,    m = min(top_m, |remaining|)

and is logged on the impression (`Impression.propensity`), with `explored` = the ad is not the
greedy one. That is what IPS / SNIPS / DR need to score another policy on logged traffic
(`attribution.ope`). At most a share ε of positions (in expectation) leaves the greedy order:
the exploration budget, whose cost `benchmarks/live_loop.py` measures.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Explored:
    """The positions' picks as indices into L, each pick's probability and whether it was explored."""

    picks: np.ndarray  # int64, indices into the ranked list
    propensity: np.ndarray  # float64, in (0, 1]
    explored: np.ndarray  # bool


def explore(n: int, k: int, epsilon: float, top_m: int, rng: np.random.Generator) -> Explored:
    """Fill `min(k, n)` positions from a ranked list of `n` candidates.

    >>> e = explore(5, 3, 0.0, 4, np.random.default_rng(0))
    >>> e.picks.tolist(), e.propensity.tolist(), e.explored.tolist()
    ([0, 1, 2], [1.0, 1.0, 1.0], [False, False, False])
    >>> e = explore(5, 2, 0.5, 4, np.random.default_rng(3))
    >>> bool(np.all((e.propensity == 0.5 + 0.5 / 4) | (e.propensity == 0.5 / 4)))
    True
    """
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"explore.epsilon must be in [0, 1), got {epsilon}")
    slots = min(k, n)
    if epsilon == 0:
        return Explored(np.arange(slots, dtype=np.int64), np.ones(slots), np.zeros(slots, dtype=bool))
    draws = rng.random(slots)
    if not (draws < epsilon).any():  # no position explores (most requests at a small epsilon)
        ms = np.minimum(top_m, n - np.arange(slots))  # each position's m
        prop = np.where(ms > 1, (1.0 - epsilon) + epsilon / ms, (1.0 - epsilon) + epsilon)
        return Explored(np.arange(slots, dtype=np.int64), prop, np.zeros(slots, dtype=bool))
    picks: list[int] = []
    prop_list: list[float] = []
    remaining = list(range(n))
    for pos in range(slots):
        m = min(top_m, len(remaining))
        j = int(rng.integers(m)) if draws[pos] < epsilon and m > 1 else 0
        picks.append(remaining.pop(j))
        prop_list.append((1.0 - epsilon) * (j == 0) + (epsilon / m if m > 1 else epsilon))
    return Explored(
        np.asarray(picks, dtype=np.int64),
        np.asarray(prop_list, dtype=np.float64),
        np.asarray([p != g for p, g in zip(picks, _greedy(picks, n), strict=True)], dtype=bool),
    )


def _greedy(picks: list[int], n: int) -> list[int]:
    """The greedy ad at each position given the picks before it (the best one not yet taken)."""
    taken = [False] * n
    out, first = [], 0
    for p in picks:
        while taken[first]:
            first += 1
        out.append(first)
        taken[p] = True
    return out
