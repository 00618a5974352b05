"""Canary: which users see the candidate adapters, per-arm online metrics, and the decision rule.

Arms are `stable` (the last promoted adapters) and `candidate` (the live, delta-updated ones).
The candidate starts at `canary.share` of users (stable hash of the user id), is promoted to 50 %
and then to everyone (becoming the new stable) while, with `canary.min_samples` impressions per
arm, its online AUC is not worse than stable's beyond `canary.z` standard errors (`promote_when`
`not_worse`, the default: a canary that catches harm, as Kayenta-style canary judges do; or, with
`better`, beats it by `canary.auc_gain` beyond them) and its latency is not worse by
`canary.latency_slack`; it is rolled back (share 0) when its error rate stays above
`canary.max_error_rate` for `canary.error_window_s`, or its AUC is worse beyond the noise. A
rolled-back candidate comes back at `canary.share` with fresh stats after a cool-down.

Why `not_worse` (issue 32): the two arms are different users, so their AUCs differ by the noise of
two independent windows (~0.03 each at 1,000 impressions, 5 % CTR). Requiring a significant gain
promoted an equally good candidate in ~2 % of decisions and a live adapter 0.01 better about as
rarely, so the learning reached only the canary's 5 % of users (in the live loop, none: its stable
arm had nothing promoted). The adapters' quality is judged where it can be, by the trainer's
paired online-vs-frozen guard on the same impressions; the canary guards against harm.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Final, Literal, TypeAlias

import numpy as np

from schemas import stats
from schemas.settings import CanarySettings

Action: TypeAlias = Literal["hold", "promote", "rollback"]
Arm: TypeAlias = Literal["stable", "candidate"]
STAGES: Final[tuple[str, ...]] = ("canary", "half", "full")


def user_bucket(user_id: str) -> float:
    """A stable number in [0, 1) per user, the same on every replica and every restart.

    >>> user_bucket("u1") == user_bucket("u1"), 0 <= user_bucket("u1") < 1
    (True, True)
    """
    digest = hashlib.blake2b(user_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def arm_for(user_id: str, candidate_share: float) -> Arm:
    """The arm that serves this user at the current candidate share."""
    return "candidate" if user_bucket(user_id) < candidate_share else "stable"


def auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """ROC AUC of an arm's window (schemas.stats.auc, the one definition); None when one class is missing.

    >>> auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1]))
    0.75
    """
    value = stats.auc(scores, labels)
    return None if math.isnan(value) else value


@dataclass(frozen=True)
class ArmStats:
    """What the decision needs to know of one arm over the evaluation window."""

    auc: float | None
    samples: int
    latency_p50_ms: float | None
    error_rate: float
    error_high_for_s: float
    positives: int | None = None  # clicked impressions in the window (the AUC's standard error)

    def auc_se(self) -> float | None:
        """Standard error of `auc` (Hanley & McNeil 1982); None without the class counts."""
        if self.auc is None or self.positives is None:
            return None
        return auc_standard_error(self.auc, self.positives, self.samples - self.positives)


def auc_standard_error(a: float, positives: int, negatives: int) -> float:
    """Hanley–McNeil standard error of an AUC `a` measured on `positives` and `negatives`.

    >>> round(auc_standard_error(0.7, 50, 950), 4), round(auc_standard_error(0.7, 1000, 19000), 4)
    (0.0422, 0.0094)
    """
    if positives < 1 or negatives < 1:
        return math.inf
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    var = (a * (1 - a) + (positives - 1) * (q1 - a * a) + (negatives - 1) * (q2 - a * a)) / (
        positives * negatives
    )
    return math.sqrt(max(var, 0.0))


def decide(stable: ArmStats, candidate: ArmStats, rule: CanarySettings) -> Action:
    """Promote, roll back or hold the candidate.

    The AUC rules act on the difference of the two windows only where it exceeds `rule.z`
    standard errors (Hanley–McNeil per arm, arms independent): with 1,000 impressions at 5 %
    CTR one window's AUC has an SE of ~0.03, so comparing point estimates rolled back half of
    all healthy candidates (and promoted a quarter of them).

    >>> r = CanarySettings(min_samples=10)
    >>> s = ArmStats(0.70, 20_000, 10.0, 0.0, 0.0, positives=1000)
    >>> decide(s, ArmStats(0.74, 20_000, 10.2, 0.0, 0.0, positives=1000), r)
    'promote'
    >>> decide(s, ArmStats(0.69, 20_000, 10.0, 0.0, 0.0, positives=1000), r)  # within the noise
    'promote'
    >>> better = CanarySettings(min_samples=10, promote_when="better")
    >>> decide(s, ArmStats(0.69, 20_000, 10.0, 0.0, 0.0, positives=1000), better)
    'hold'
    >>> decide(s, ArmStats(0.66, 20_000, 10.0, 0.0, 0.0, positives=1000), r)
    'rollback'
    >>> decide(s, ArmStats(0.74, 100, 10.0, 0.01, 301.0), r)
    'rollback'
    """
    if candidate.error_rate > rule.max_error_rate and candidate.error_high_for_s >= rule.error_window_s:
        return "rollback"
    if candidate.samples < rule.min_samples or stable.samples < rule.min_samples:
        return "hold"
    se_c, se_s = candidate.auc_se(), stable.auc_se()
    if candidate.auc is None or stable.auc is None or se_c is None or se_s is None:
        return "hold"
    diff, noise = candidate.auc - stable.auc, rule.z * math.hypot(se_c, se_s)
    if diff < -noise:
        return "rollback"
    latency_ok = (
        candidate.latency_p50_ms is None
        or stable.latency_p50_ms is None
        or candidate.latency_p50_ms <= stable.latency_p50_ms * (1.0 + rule.latency_slack)
    )
    gained = rule.promote_when == "not_worse" or (diff >= rule.auc_gain and diff > noise)
    return "promote" if gained and latency_ok else "hold"


def next_share(stage: str, base_share: float) -> float:
    """Candidate share of users at a stage."""
    return {"canary": base_share, "half": 0.5, "full": 1.0}.get(stage, 0.0)


@dataclass
class ArmWindow:
    """A bounded window of one arm's served impressions (pCTR, clicked), latencies and errors."""

    size: int = 20_000  # settings.canary.window_impressions
    latency_size: int = 2000  # settings.canary.latency_window
    pctr: deque[float] = field(default_factory=deque)
    clicked: deque[bool] = field(default_factory=deque)
    latency_ms: deque[float] = field(default_factory=deque)
    requests: int = 0
    errors: int = 0
    error_high_since: float | None = None
    total: int = 0
    # [second, requests, errors] of the last `rate_window_s`: the error rate is a recent one, so a
    # burst of failures after hours of healthy traffic shows at once (a lifetime rate hides it)
    rate_window_s: float = 60.0  # settings.canary.error_rate_window_s
    recent: deque[list[int]] = field(default_factory=deque)

    def served(self, pctr: float) -> int:
        """Record one served impression; returns its sequence number for a later click."""
        if len(self.pctr) >= self.size:
            self.pctr.popleft()
            self.clicked.popleft()
        self.pctr.append(pctr)
        self.clicked.append(False)
        self.total += 1
        return self.total - 1

    def click(self, seq: int) -> bool:
        """Mark the impression with this sequence number clicked; False if it left the window or
        was clicked already (a re-delivered click joins once)."""
        idx = seq - (self.total - len(self.pctr))
        if 0 <= idx < len(self.clicked) and not self.clicked[idx]:
            self.clicked[idx] = True
            return True
        return False

    def request(self, latency_ms: float, error: bool, now: float, max_error_rate: float) -> None:
        self.requests += 1
        self.errors += int(error)
        second = int(now)
        if self.recent and self.recent[-1][0] == second:
            self.recent[-1][1] += 1
            self.recent[-1][2] += int(error)
        else:
            self.recent.append([second, 1, int(error)])
        while self.recent and self.recent[0][0] <= now - self.rate_window_s:
            self.recent.popleft()
        if len(self.latency_ms) >= self.latency_size:
            self.latency_ms.popleft()
        self.latency_ms.append(latency_ms)
        if self.error_rate() > max_error_rate:
            if self.error_high_since is None:
                self.error_high_since = now
        else:
            self.error_high_since = None

    def error_rate(self) -> float:
        """Errors per request over the last `rate_window_s` before the latest request."""
        requests = sum(b[1] for b in self.recent)
        return sum(b[2] for b in self.recent) / requests if requests else 0.0

    def stats(self, now: float) -> ArmStats:
        scores = np.fromiter(self.pctr, dtype=np.float64, count=len(self.pctr))
        labels = np.fromiter(self.clicked, dtype=bool, count=len(self.clicked))
        lat = float(np.median(np.fromiter(self.latency_ms, dtype=np.float64))) if self.latency_ms else None
        high = 0.0 if self.error_high_since is None else now - self.error_high_since
        return ArmStats(auc(scores, labels), len(scores), lat, self.error_rate(), high, int(labels.sum()))


@dataclass
class Canary:
    """One replica's canary state: stage, candidate share, the two arms' windows, and the join of
    clicks to served impressions (bounded)."""

    base_share: float
    rule: CanarySettings
    cooldown_s: float = 300.0
    stage: str = "canary"
    rolled_back_at: float | None = None
    arms: dict[str, ArmWindow] = field(default_factory=dict)
    joins: dict[str, tuple[str, int]] = field(default_factory=dict)
    max_joins: int = 100_000
    promotions: int = 0
    rollbacks: int = 0

    def __post_init__(self) -> None:
        self.arms = self.arms or {arm: self._window() for arm in ("stable", "candidate")}

    def _window(self) -> ArmWindow:
        r = self.rule
        return ArmWindow(
            size=r.window_impressions, latency_size=r.latency_window, rate_window_s=r.error_rate_window_s
        )

    def share(self, now: float) -> float:
        if self.rolled_back_at is not None:
            if now - self.rolled_back_at < self.cooldown_s:
                return 0.0
            self.rolled_back_at = None
            self.stage = "canary"
            self._reset()
        return next_share(self.stage, self.base_share)

    def served(self, arm: str, impression_id: str, pctr: float) -> None:
        seq = self.arms[arm].served(pctr)
        if len(self.joins) >= self.max_joins:
            self.joins.pop(next(iter(self.joins)))
        self.joins[impression_id] = (arm, seq)

    def clicked(self, impression_id: str) -> bool:
        hit = self.joins.get(impression_id)
        return hit is not None and self.arms[hit[0]].click(hit[1])

    def request(self, arm: str, latency_ms: float, error: bool, now: float) -> None:
        self.arms[arm].request(latency_ms, error, now, self.rule.max_error_rate)

    def evaluate(self, now: float) -> Action:
        """Apply the decision rule; returns the action taken (the caller swaps weights on promote)."""
        if self.rolled_back_at is not None:
            return "hold"
        action = decide(self.arms["stable"].stats(now), self.arms["candidate"].stats(now), self.rule)
        if action == "promote":
            self.promotions += 1
            self.stage = STAGES[min(STAGES.index(self.stage) + 1, len(STAGES) - 1)]
            self._reset()
        elif action == "rollback":
            self.rollbacks += 1
            self.rolled_back_at = now
            self._reset()
        return action

    def _reset(self) -> None:
        self.arms = {arm: self._window() for arm in ("stable", "candidate")}
        self.joins.clear()
