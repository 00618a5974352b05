"""Off-policy estimators against the market's truth: log with one policy, score another, compare.

The market's requests (users by activity, slots by share) each get `candidates` ads drawn at
random from the catalog (a recall stage's stand-in) for the top position. Two rankers score
them: the market's true click logit plus Gaussian error (`logging_noise`, `target_noise`).

- The **logging** policy is ε-greedy on the noisier ranker: its top ad with probability 1 − ε,
  otherwise a uniformly random candidate (possibly the same ad). The propensity of the shown ad
  is known exactly: (1 − ε)·[ad is the top] + ε / candidates. The user clicks with the oracle's
  probability.
- The **target** policy is greedy on the better ranker: π_e(a | x) = [a is its top ad].
- Its **true CTR** is the mean over the same requests of the oracle click probability of the ad
  it would show (exact given the requests: no click noise).

`score(cfg)` logs the traffic, then estimates the target's CTR by IPS, SNIPS and DR (reward
model: the target ranker's own click probability, σ(its noisy logit)) with `attribution.ope`,
and returns each estimate's relative error against the truth.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from attribution.ope import Estimate, dr, ips, snips
from workloads import truth
from workloads.config import MarketConfig
from workloads.market import Market

Array = NDArray[np.float64]


@dataclass(frozen=True)
class OpeTruthConfig:
    """One logged run: the market, the traffic size and the two policies."""

    seed: int = 0
    rounds: int = 100_000
    candidates: int = 10
    epsilon: float = 0.3  # the logging policy's exploration rate
    logging_noise: float = 1.5  # sd of the logging ranker's logit error
    target_noise: float = 0.5  # sd of the target ranker's logit error
    market: dict[str, Any] = field(default_factory=lambda: {"n_users": 2000, "n_ads": 200})

    def __post_init__(self) -> None:
        if self.rounds < 2:
            raise ValueError(f"rounds {self.rounds!r} must be at least 2")
        if self.candidates < 2:
            raise ValueError(f"candidates {self.candidates!r} must be at least 2")
        if not 0.0 < self.epsilon <= 1.0:
            raise ValueError(
                f"epsilon {self.epsilon!r} must lie in (0, 1] (a policy that never explores has no overlap)"
            )
        if self.logging_noise < 0 or self.target_noise < 0:
            raise ValueError("ranker noise must be ≥ 0")


@dataclass(frozen=True)
class LoggedBandit:
    """Logged rounds with what every estimator needs, and the target policy's truth."""

    reward: Array
    pscore: Array
    target_prob: Array
    q_logged: Array
    q_target: Array
    true_value: float  # the target policy's CTR on these requests, from the oracle
    logging_value: float  # the logging policy's CTR on these requests, from the oracle


def true_logits(
    market: Market, users: NDArray[np.int64], slots: Sequence[str], ads: NDArray[np.int64]
) -> Array:
    """The oracle click logit at the top position of each (request, candidate): (rounds, k)."""
    cfg, a, w = market.config, market.world.ads, market.world
    slot_effect = np.array([cfg.slot_effect[s] for s in slots])[:, None]
    # the truth's own formula, on arrays (click_logit is plain arithmetic, typed for floats)
    click_logit: Any = truth.click_logit
    return np.asarray(
        click_logit(
            w.interests[users[:, None], a.category[ads]],
            interest_scale=cfg.interest_scale,
            ad_quality=a.quality[ads],
            advertiser_effect=w.advertiser_effect[a.advertiser[ads]],
            slot_effect=slot_effect,
            position_bias=float(cfg.position_bias[0]),
            bias=cfg.bias,
        ),
        dtype=np.float64,
    )


def log_bandit(cfg: OpeTruthConfig) -> LoggedBandit:
    """Log `cfg.rounds` requests with the ε-greedy logging policy (see the module docstring)."""
    market = Market(MarketConfig(seed=cfg.seed, drift_at=None, new_ads_at=None, **cfg.market))
    requests = [market.next_request() for _ in range(cfg.rounds)]
    users = np.array([r.user for r in requests], dtype=np.int64)
    slots = [r.slot for r in requests]
    rng = np.random.default_rng([cfg.seed, 7])
    n, k = cfg.rounds, cfg.candidates
    n_ads = market.config.n_ads
    ads = np.argsort(rng.random((n, n_ads)), axis=1)[:, :k]  # k distinct random candidates
    z = true_logits(market, users, slots, ads)
    p_true = 1.0 / (1.0 + np.exp(-z))
    rows = np.arange(n)
    top_b = np.argmax(z + rng.normal(0.0, cfg.logging_noise, z.shape), axis=1)
    z_e = z + rng.normal(0.0, cfg.target_noise, z.shape)
    top_e = np.argmax(z_e, axis=1)
    explore = rng.random(n) < cfg.epsilon
    action = np.where(explore, rng.integers(0, k, n), top_b)
    pscore = (1.0 - cfg.epsilon) * (action == top_b) + cfg.epsilon / k
    reward = (rng.random(n) < p_true[rows, action]).astype(np.float64)
    q_hat = 1.0 / (1.0 + np.exp(-z_e))
    pi_b_value = (1.0 - cfg.epsilon) * p_true[rows, top_b] + cfg.epsilon * p_true.mean(axis=1)
    return LoggedBandit(
        reward=reward,
        pscore=pscore,
        target_prob=(action == top_e).astype(np.float64),
        q_logged=q_hat[rows, action],
        q_target=q_hat[rows, top_e],
        true_value=float(p_true[rows, top_e].mean()),
        logging_value=float(pi_b_value.mean()),
    )


@dataclass(frozen=True)
class OpeTruth:
    """Each estimator's estimate of the target policy's CTR and its error against the truth."""

    true_value: float
    logging_value: float
    estimates: dict[str, Estimate]

    def relative_error(self, name: str) -> float:
        return (self.estimates[name].value - self.true_value) / self.true_value

    def covered(self, name: str) -> bool:
        e = self.estimates[name]
        return e.ci_low <= self.true_value <= e.ci_high

    def as_dict(self) -> dict[str, Any]:
        return {
            "true_ctr": self.true_value,
            "logging_ctr": self.logging_value,
            "estimates": {
                name: {
                    **e.as_dict(),
                    "relative_error": self.relative_error(name),
                    "covers_truth": self.covered(name),
                }
                for name, e in self.estimates.items()
            },
        }


def score(cfg: OpeTruthConfig) -> OpeTruth:
    """Log with the logging policy, estimate the target's CTR by IPS, SNIPS and DR, compare."""
    b = log_bandit(cfg)
    return OpeTruth(
        true_value=b.true_value,
        logging_value=b.logging_value,
        estimates={
            "ips": ips(b.reward, b.pscore, b.target_prob),
            "snips": snips(b.reward, b.pscore, b.target_prob),
            "dr": dr(b.reward, b.pscore, b.target_prob, b.q_logged, b.q_target),
        },
    )


def summarize(runs: Sequence[OpeTruth], alpha: float = 0.05) -> dict[str, Any]:
    """Per estimator over the runs (seeds): the relative error's mean with a t interval over
    seeds, its mean absolute value, the worst seed, and how many runs' intervals held the truth."""
    if len(runs) < 2:
        raise ValueError(f"summarize needs at least 2 runs (seeds), got {len(runs)}")
    k = len(runs)
    t = _t_quantile(1.0 - alpha / 2.0, k - 1)
    out: dict[str, Any] = {}
    for name in runs[0].estimates:
        errs = np.array([r.relative_error(name) for r in runs])
        half = t * float(errs.std(ddof=1)) / math.sqrt(k)
        mean = float(errs.mean())
        out[name] = {
            "mean": mean,
            "ci_low": mean - half,
            "ci_high": mean + half,
            "mean_abs": float(np.abs(errs).mean()),
            "max_abs": float(np.abs(errs).max()),
            "per_seed": errs.tolist(),
            "intervals_covering_truth": sum(r.covered(name) for r in runs),
            "runs": k,
        }
    return out


def _t_quantile(q: float, df: int) -> float:
    from scipy.stats import t as student

    return float(student.ppf(q, df))
