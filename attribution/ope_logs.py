"""Scoring a known policy off-policy on the impressions serving logged with their propensities.

A round is one served impression (a slot position of a request) whose `propensity` is set: the
probability with which serving chose that ad there, its reward is whether it was clicked. Rounds
are treated as independent given their context, i.e. a click at one position does not depend on
the ads at the others (the simulator's click model; the usual assumption of per-position
off-policy evaluation, as in Open Bandit Pipeline's `position`).

Policies that the logs define exactly (`POLICIES`, plus the `explore:F` family):

- `logging` — the policy that served: π_e = propensity. IPS and SNIPS then equal the logged
  CTR exactly (a sanity check of the pipeline and of the propensities).
- `greedy` — serving without exploration: each position gets the ranker's own choice, i.e. the
  ad logged wherever `explored` is false; π_e = 1 there and 0 where an exploring draw put a
  different ad. (`serving.explore` logs `explored` as "not the greedy ad given the positions
  before it", which is what this needs.) Like serving's propensities, it is the policy at each
  position given the ads logged above it: a position below an explored one is scored with
  the remaining candidates that position really had, not those of a wholly greedy slate.
- `explore:F` (0 ≤ F ≤ 1) — with probability F follow the logging policy, otherwise the greedy
  one: π_e = F·propensity + (1 − F)·[not explored]. When serving explores ε-greedily this is
  exactly ε-greedy with ε' = F·ε, so it answers "what would half the exploration budget
  earn?"; `explore:1` is `logging`, `explore:0` is `greedy`.

A uniformly random policy over the candidates is not in the registry: the logs hold neither
the candidate set of a position nor the exploration rate, so its probabilities are not known.

Doubly robust uses an ad-independent reward model fitted on the same rounds: q̂(x, a) = the
CTR of the round's slot × position, so q̂(x, a_logged) = Σ_a π_e(a|x) q̂(x, a) and DR is IPS with
that CTR as a control variate (its interval is narrower where the weights' mean strays from 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from attribution.ope import Estimate, EstimationError, dr, ips, snips
from attribution.paths import AttributionInputError
from attribution.sql import Backend
from schemas.holdout import HOLDOUT_AD_ID

POLICIES = ("logging", "greedy")
EXPLORE_PREFIX = "explore:"

# One row per served impression with a propensity in the range (optionally one arm / slot), with
# whether it was clicked (at most once: ANY join on the distinct clicked impression ids).
LOGGED_SQL = """
SELECT slot, position, propensity, explored, clicked
FROM (
    SELECT event_id AS imp, slot, toUInt32(position) AS position,
           toFloat64(assumeNotNull(propensity)) AS propensity,
           toUInt8(ifNull(explored, 0)) AS explored
    FROM impressions FINAL
    WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
      AND isNotNull(propensity) AND ad_id != %(holdout)s
      AND (%(arm)s = '' OR toString(assumeNotNull(ab_arm)) = %(arm)s)
      AND (%(slot)s = '' OR slot = %(slot)s)
) AS i
ANY LEFT JOIN (
    SELECT impression_id AS imp, toUInt8(1) AS clicked FROM clicks FINAL
    WHERE ts >= toDateTime(%(since)s) GROUP BY impression_id
) AS c USING imp
"""


@dataclass(frozen=True)
class LoggedRounds:
    """The logged rounds of a range: one entry per impression with a propensity."""

    slot: NDArray[np.str_]
    position: NDArray[np.int64]
    pscore: NDArray[np.float64]
    explored: NDArray[np.bool_]
    reward: NDArray[np.float64]

    @property
    def n(self) -> int:
        return int(self.reward.shape[0])


@dataclass(frozen=True)
class PolicyValue:
    """A policy's estimated CTR by each estimator, beside the logged CTR and weight diagnostics."""

    policy: str
    estimates: dict[str, Estimate]
    logged_ctr: float
    rounds: int
    mean_weight: float  # ≈ 1 when the propensities are right and the policy is covered
    effective_rounds: float  # (Σw)² / Σw²: how many rounds the estimate is worth

    def as_dict(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "rounds": self.rounds,
            "logged_ctr": self.logged_ctr,
            "mean_weight": self.mean_weight,
            "effective_rounds": self.effective_rounds,
            "estimates": {name: e.as_dict() for name, e in self.estimates.items()},
        }


def check_policy(name: str) -> str:
    """The policy name if the registry knows it; an `EstimationError` naming it otherwise."""
    if name in POLICIES:
        return name
    if name.startswith(EXPLORE_PREFIX):
        explore_share(name)
        return name
    raise EstimationError(
        f"unknown policy {name!r} (known: {', '.join(POLICIES)}, {EXPLORE_PREFIX}F with 0 ≤ F ≤ 1)"
    )


def explore_share(name: str) -> float:
    """F of an `explore:F` policy name."""
    text = name[len(EXPLORE_PREFIX) :]
    try:
        share = float(text)
    except ValueError:
        share = float("nan")
    if not 0.0 <= share <= 1.0:
        raise EstimationError(f"policy {name!r}: {text!r} is not an exploration share F in [0, 1]")
    return share


def target_probs(policy: str, rounds: LoggedRounds) -> NDArray[np.float64]:
    """π_e(logged ad | context) of each round under `policy` (see the module docstring)."""
    greedy = (~rounds.explored).astype(np.float64)
    name = check_policy(policy)
    if name == "logging":
        return rounds.pscore.copy()
    if name == "greedy":
        return greedy
    share = explore_share(name)
    out: NDArray[np.float64] = share * rounds.pscore + (1.0 - share) * greedy
    return out


def position_ctr(rounds: LoggedRounds) -> NDArray[np.float64]:
    """Each round's q̂: the CTR of its slot × position over the rounds."""
    keys = np.char.add(np.char.add(rounds.slot.astype(str), "|"), rounds.position.astype(str))
    _, inverse = np.unique(keys, return_inverse=True)
    clicks = np.bincount(inverse, weights=rounds.reward)
    shown = np.bincount(inverse)
    q: NDArray[np.float64] = (clicks / shown)[inverse]
    return q


def evaluate(rounds: LoggedRounds, policy: str, alpha: float = 0.05) -> PolicyValue:
    """IPS, SNIPS and DR estimates of `policy`'s CTR on the logged rounds."""
    pi = target_probs(policy, rounds)
    r, p = rounds.reward, rounds.pscore
    q = position_ctr(rounds)
    w = pi / p
    estimates = {
        "ips": ips(r, p, pi, alpha),
        "snips": snips(r, p, pi, alpha),
        "dr": dr(r, p, pi, q, q, alpha),
    }
    sum_w2 = float((w * w).sum())
    return PolicyValue(
        policy=policy,
        estimates=estimates,
        logged_ctr=float(r.mean()),
        rounds=rounds.n,
        mean_weight=float(w.mean()),
        effective_rounds=float(w.sum()) ** 2 / sum_w2 if sum_w2 > 0 else 0.0,
    )


def read_logged(
    backend: Backend, since: int, until: int, arm: str | None = None, slot: str | None = None
) -> LoggedRounds:
    """The logged rounds of [since, until) (one arm / slot, or all); an `AttributionInputError`
    naming the range when none has a propensity."""
    params = {
        "since": since, "until": until, "holdout": HOLDOUT_AD_ID, "arm": arm or "", "slot": slot or "",
    }  # fmt: skip
    cols = backend.execute_columns(LOGGED_SQL, params)
    if not cols or len(cols[0]) == 0:
        what = "".join(f" {k} {v!r}" for k, v in (("arm", arm), ("slot", slot)) if v)
        raise AttributionInputError(
            f"no logged impressions with a propensity{what} in [{since}, {until}) "
            "(is exploration on and was traffic served then?)"
        )
    slot_c, position, pscore, explored, clicked = cols
    return LoggedRounds(
        slot=np.asarray(slot_c).astype(str),
        position=np.asarray(position, dtype=np.int64),
        pscore=np.asarray(pscore, dtype=np.float64),
        explored=np.asarray(explored).astype(bool),
        reward=np.asarray(clicked, dtype=np.float64),
    )
