"""Logging policies of the open loop: which ads a dumb ad server shows for a request."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class LoggingPolicy(Protocol):
    """Chooses k distinct ads among the active ones and learns from what it sees."""

    def choose(self, rng: np.random.Generator, active: np.ndarray, k: int) -> np.ndarray: ...

    def update(self, ad: int, clicked: bool) -> None: ...


class RandomPolicy:
    """Uniformly random ads: every active ad has the same propensity (clean for off-policy use)."""

    def choose(self, rng: np.random.Generator, active: np.ndarray, k: int) -> np.ndarray:
        return rng.choice(active, size=k, replace=False)

    def update(self, ad: int, clicked: bool) -> None:
        return None


class PopularityPolicy:
    """Highest smoothed observed CTR first; with probability epsilon a random set instead."""

    def __init__(self, n_ads: int, epsilon: float, prior_clicks: float = 1.0, prior_imps: float = 30.0):
        self.clicks = np.full(n_ads, prior_clicks)
        self.imps = np.full(n_ads, prior_imps)
        self.epsilon = epsilon

    def choose(self, rng: np.random.Generator, active: np.ndarray, k: int) -> np.ndarray:
        if rng.random() < self.epsilon:
            return rng.choice(active, size=k, replace=False)
        ctr = self.clicks[active] / self.imps[active]
        top = np.argsort(-ctr, kind="stable")[:k]
        return active[top]

    def update(self, ad: int, clicked: bool) -> None:
        self.imps[ad] += 1.0
        self.clicks[ad] += float(clicked)


def make_policy(name: str, n_ads: int, epsilon: float) -> LoggingPolicy:
    """The policy called `name`: random, popularity (greedy, ε=0) or epsilon (ε-greedy)."""
    if name == "random":
        return RandomPolicy()
    if name == "popularity":
        return PopularityPolicy(n_ads, 0.0)
    if name == "epsilon":
        return PopularityPolicy(n_ads, epsilon)
    raise ValueError(f"unknown logging policy {name!r} (random, popularity, epsilon)")
