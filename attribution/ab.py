"""Per-arm business metrics of the live A/B (learning, correction-only, control), with intervals.

Users are the unit of randomisation (the arm is a stable hash of the user), so every interval
treats users as the independent draws: the input is one row per user of an arm, with that
user's requests, impressions (served), shown impressions (`schemas.billing`: a client-rendered
one with its render beacon, a server-rendered one when served), clicks and revenue (what the
impressions were billed: `attribution.ab_rollups`) over the range. Each metric is a ratio of sums
over the arm's users:

- CTR = Σ clicks / Σ shown, clicks per request = Σ clicks / Σ requests, revenue per request =
  Σ revenue / Σ requests; impressions are the arm's served total. Data without a shown count
  (rolled up before migration 010, or built without one) takes its impressions as shown.

Intervals (95 % by default) come from either
- `bootstrap` (default): the arm's users resampled with replacement (vectorised over `n_boot`
  resamples, seeded), percentile interval; a resample whose denominator is 0 is left out; or
- `delta`: the linearised ratio, var(R) ≈ var(y − R·x) / (n · x̄²), normal interval.

A relative lift of arm A over arm B is R_A / R_B − 1 with arms resampled independently
(bootstrap) or the delta method on log R (var = var(R_A)/R_A² + var(R_B)/R_B²), so the interval
stays above −1 and is asymmetric as a ratio's is. An arm without users or a zero denominator
(no shown impressions, no requests, a baseline whose metric is 0) is an `EstimationError` naming the
arm and the metric, never a division by zero.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from attribution.ope import Estimate, EstimationError, z_value

Array = NDArray[np.float64]
Method = Literal["bootstrap", "delta"]

# ratio metrics: (numerator column, denominator column)
RATIOS: dict[str, tuple[str, str]] = {
    "ctr": ("clicks", "shown"),
    "clicks_per_request": ("clicks", "requests"),
    "revenue_per_request": ("revenue", "requests"),
}
METRICS = ("impressions", *RATIOS)
COLUMNS = ("requests", "impressions", "clicks", "revenue", "shown")
DEFAULT_PAIRS = (("learning", "control"), ("learning", "correction"))
# bound on the elements of one resample block (users × resamples): keeps memory flat
_BLOCK = 2_000_000


@dataclass(frozen=True)
class ArmData:
    """One arm's per-user aggregates over a range: arrays with one entry per user."""

    arm: str
    requests: Array
    impressions: Array
    clicks: Array
    revenue: Array
    shown: Array  # served impressions that were shown (CTR's denominator)

    @classmethod
    def of(
        cls,
        arm: str,
        requests: ArrayLike,
        impressions: ArrayLike,
        clicks: ArrayLike,
        revenue: ArrayLike,
        shown: ArrayLike | None = None,
    ) -> ArmData:
        """Checked arrays: one-dimensional, equal lengths, finite, non-negative, clicks ≤ impressions,
        shown ≤ impressions (None: every impression shown). A user may have more clicks than shown
        impressions (a click whose render beacon was lost)."""
        cols = {}
        shown_in = impressions if shown is None else shown
        for name, values in zip(COLUMNS, (requests, impressions, clicks, revenue, shown_in), strict=True):
            arr = np.asarray(values, dtype=np.float64)
            if arr.ndim != 1:
                raise EstimationError(f"arm {arm!r}: {name} must be one-dimensional, got shape {arr.shape}")
            bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0))
            if bad.size:
                raise EstimationError(
                    f"arm {arm!r}: {name}[{bad[0]}] = {float(arr[bad[0]])!r} is not a finite count ≥ 0"
                )
            cols[name] = arr
        lengths = {name: a.shape[0] for name, a in cols.items()}
        if len(set(lengths.values())) != 1:
            raise EstimationError(f"arm {arm!r}: columns differ in length {lengths}")
        over = np.flatnonzero(cols["clicks"] > cols["impressions"])
        if over.size:
            raise EstimationError(f"arm {arm!r}: user {over[0]} has more clicks than impressions")
        over = np.flatnonzero(cols["shown"] > cols["impressions"])
        if over.size:
            raise EstimationError(f"arm {arm!r}: user {over[0]} has more shown than served impressions")
        return cls(arm, cols["requests"], cols["impressions"], cols["clicks"], cols["revenue"], cols["shown"])

    @property
    def users(self) -> int:
        return int(self.requests.shape[0])

    def column(self, name: str) -> Array:
        arr: Array = getattr(self, name)
        return arr

    def matrix(self) -> Array:
        """Users × (requests, impressions, clicks, revenue, shown)."""
        return np.column_stack([self.column(c) for c in COLUMNS])


@dataclass(frozen=True)
class ArmMetrics:
    """One arm's metrics, each an `Estimate` (n = the arm's users)."""

    arm: str
    users: int
    requests: int
    impressions: Estimate
    ctr: Estimate
    clicks_per_request: Estimate
    revenue_per_request: Estimate

    def metric(self, name: str) -> Estimate:
        est: Estimate = getattr(self, name)
        return est

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"arm": self.arm, "users": self.users, "requests": self.requests}
        out.update({m: self.metric(m).as_dict() for m in METRICS})
        return out


@dataclass(frozen=True)
class Lift:
    """The relative lift of `arm` over `baseline` in one metric (0.05 = 5 % higher)."""

    arm: str
    baseline: str
    metric: str
    estimate: Estimate

    def as_dict(self) -> dict[str, object]:
        return {"arm": self.arm, "baseline": self.baseline, "metric": self.metric, **self.estimate.as_dict()}


@dataclass(frozen=True)
class ABReport:
    """Every arm's metrics and the lifts asked for, with how the intervals were made."""

    arms: dict[str, ArmMetrics]
    lifts: list[Lift]
    method: Method
    alpha: float
    n_boot: int = 0
    seed: int = 0
    skipped_pairs: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {
            "method": self.method, "alpha": self.alpha, "n_boot": self.n_boot, "seed": self.seed,
            "arms": {name: m.as_dict() for name, m in self.arms.items()},
            "lifts": [lift.as_dict() for lift in self.lifts],
            "skipped_pairs": self.skipped_pairs,
        }  # fmt: skip


def _require_users(data: ArmData) -> None:
    if data.users == 0:
        raise EstimationError(f"arm {data.arm!r} has no traffic (no users) in the range")


def ratio(data: ArmData, metric: str) -> float:
    """The point value of a ratio metric (Σ numerator / Σ denominator over the arm's users)."""
    _require_users(data)
    num, den = RATIOS[metric]
    total = float(data.column(den).sum())
    if total == 0.0:
        what = "shown impressions" if den == "shown" else den
        raise EstimationError(f"arm {data.arm!r}: {metric} is undefined, the arm has no {what}")
    return float(data.column(num).sum()) / total


def _delta_var(data: ArmData, metric: str) -> float:
    """Delta-method variance of a ratio of sums over i.i.d. users (0 with a single user)."""
    num, den = RATIOS[metric]
    r = ratio(data, metric)
    x, y = data.column(den), data.column(num)
    n = data.users
    if n < 2:
        return math.inf
    return float((y - r * x).var(ddof=1)) / (n * float(x.mean()) ** 2)


def _resample_sums(matrix: Array, n_boot: int, rng: np.random.Generator) -> Array:
    """n_boot × columns: column sums of resamples of the rows with replacement (in blocks).

    Each resample's draw counts come from one `bincount` over the block's indices, then one
    matrix product gives every column's sum (no per-resample gather of the rows)."""
    n = matrix.shape[0]
    out = np.empty((n_boot, matrix.shape[1]))
    step = max(1, _BLOCK // max(n, 1))
    for start in range(0, n_boot, step):
        rows = min(n_boot, start + step) - start
        idx = rng.integers(0, n, size=(rows, n)) + (np.arange(rows) * n)[:, None]
        counts = np.bincount(idx.ravel(), minlength=rows * n).reshape(rows, n)
        out[start : start + rows] = counts @ matrix
    return out


def _cached(data: ArmData, n_boot: int, seed: int, cache: dict[int, Array] | None) -> Array:
    """`boot_sums`, kept in `cache` (by the data's identity) when one is given."""
    if cache is None:
        return boot_sums(data, n_boot, seed)
    if id(data) not in cache:
        cache[id(data)] = boot_sums(data, n_boot, seed)
    return cache[id(data)]


def boot_sums(data: ArmData, n_boot: int, seed: int) -> Array:
    """The arm's resampled column sums: seeded by (seed, arm name), so an arm's resamples are the
    same in its metrics and in every lift it takes part in, and independent of other arms'."""
    rng = np.random.default_rng([seed, zlib.crc32(data.arm.encode())])
    return _resample_sums(data.matrix(), n_boot, rng)


def _boot_values(sums: Array, metric: str) -> Array:
    """Per-resample value of a metric from resampled column sums (NaN where a denominator is 0)."""
    if metric == "impressions":
        return sums[:, COLUMNS.index("impressions")]
    num, den = RATIOS[metric]
    d = sums[:, COLUMNS.index(den)]
    out = np.full(d.shape, np.nan)
    np.divide(sums[:, COLUMNS.index(num)], d, out=out, where=d > 0)
    return out


def _percentiles(values: Array, point: float, n: int, alpha: float, what: str) -> Estimate:
    ok = values[np.isfinite(values)]
    if ok.size == 0:
        raise EstimationError(f"{what}: no bootstrap resample has a defined value")
    lo, hi = np.quantile(ok, [alpha / 2.0, 1.0 - alpha / 2.0])
    return Estimate(point, float(lo), float(hi), n)


def arm_metrics(
    data: ArmData,
    method: Method = "bootstrap",
    *,
    alpha: float = 0.05,
    n_boot: int = 2000,
    seed: int = 0,
    cache: dict[int, Array] | None = None,
) -> ArmMetrics:
    """Impressions, CTR, clicks and revenue per request of one arm, each with its interval.

    >>> d = ArmData.of("control", requests=[2, 2], impressions=[4, 6], clicks=[1, 0], revenue=[0.5, 0])
    >>> m = arm_metrics(d, "delta")
    >>> m.ctr.value, m.clicks_per_request.value, m.revenue_per_request.value, m.impressions.value
    (0.1, 0.25, 0.125, 10.0)
    """
    _require_users(data)
    points = {metric: ratio(data, metric) for metric in RATIOS}
    n = data.users
    total_imps = float(data.impressions.sum())
    out: dict[str, Estimate] = {}
    if method == "delta":
        z = z_value(alpha)
        sd = float(data.impressions.std(ddof=1)) * math.sqrt(n) if n > 1 else math.inf
        out["impressions"] = Estimate(total_imps, total_imps - z * sd, total_imps + z * sd, n)
        for metric, value in points.items():
            half = z * math.sqrt(_delta_var(data, metric))
            out[metric] = Estimate(value, value - half, value + half, n)
    elif method == "bootstrap":
        sums = _cached(data, n_boot, seed, cache)
        for metric, value in {"impressions": total_imps, **points}.items():
            what = f"arm {data.arm!r}: {metric}"
            out[metric] = _percentiles(_boot_values(sums, metric), value, n, alpha, what)
    else:
        raise EstimationError(f"interval method {method!r} is not one of bootstrap, delta")
    return ArmMetrics(data.arm, n, int(data.requests.sum()), **out)


def lift(
    arm: ArmData,
    baseline: ArmData,
    metric: str,
    method: Method = "bootstrap",
    *,
    alpha: float = 0.05,
    n_boot: int = 2000,
    seed: int = 0,
    cache: dict[int, Array] | None = None,
) -> Lift:
    """The relative lift of `arm` over `baseline` in a ratio metric, with its interval.

    >>> a = ArmData.of("learning", [1, 1], [10, 10], [2, 2], [1, 1])
    >>> b = ArmData.of("control", [1, 1], [10, 10], [1, 1], [1, 1])
    >>> round(lift(a, b, "ctr", "delta").estimate.value, 12)
    1.0
    """
    if metric not in RATIOS:
        raise EstimationError(f"lift of {metric!r}: choose a ratio metric ({', '.join(RATIOS)})")
    r_a, r_b = ratio(arm, metric), ratio(baseline, metric)
    if r_b == 0.0:
        raise EstimationError(
            f"lift over arm {baseline.arm!r} is undefined: its {metric} is 0 (no clicks or revenue)"
        )
    point = r_a / r_b - 1.0
    n = arm.users + baseline.users
    if method == "delta":
        if r_a == 0.0:  # no log scale: the linear delta method, var(R_A) / R_B²
            half = z_value(alpha) * math.sqrt(_delta_var(arm, metric)) / r_b
            return Lift(arm.arm, baseline.arm, metric, Estimate(point, point - half, point + half, n))
        se = math.sqrt(_delta_var(arm, metric) / r_a**2 + _delta_var(baseline, metric) / r_b**2)
        half = z_value(alpha) * se
        log_ratio = math.log(r_a / r_b)
        est = Estimate(point, math.exp(log_ratio - half) - 1.0, math.exp(log_ratio + half) - 1.0, n)
        return Lift(arm.arm, baseline.arm, metric, est)
    if method != "bootstrap":
        raise EstimationError(f"interval method {method!r} is not one of bootstrap, delta")
    va = _boot_values(_cached(arm, n_boot, seed, cache), metric)
    vb = _boot_values(_cached(baseline, n_boot, seed, cache), metric)
    rel = np.full(va.shape, np.nan)
    np.divide(va, vb, out=rel, where=np.isfinite(vb) & (vb > 0))
    what = f"lift of arm {arm.arm!r} over {baseline.arm!r} in {metric}"
    return Lift(arm.arm, baseline.arm, metric, _percentiles(rel - 1.0, point, n, alpha, what))


def paired_lift(
    treated: ArrayLike, counterfactual: ArrayLike, *, alpha: float = 0.05, n_boot: int = 2000, seed: int = 0
) -> Estimate:
    """Σ treated / Σ counterfactual − 1 of paired per-unit totals (each unit, e.g. a user, measured
    both ways: what it was served and what it would have been served), with a bootstrap interval
    over the units resampled with both totals together, so what the units share cancels.

    >>> paired_lift([2.0, 4.0], [1.0, 2.0], n_boot=200).value
    1.0
    >>> e = paired_lift([1.1, 2.2, 3.3], [1.0, 2.0, 3.0], n_boot=200)
    >>> round(e.ci_low, 12), round(e.ci_high, 12)  # the same ratio in every unit: no spread
    (0.1, 0.1)
    """
    a, b = np.asarray(treated, dtype=np.float64), np.asarray(counterfactual, dtype=np.float64)
    if a.ndim != 1 or a.shape != b.shape:
        raise EstimationError(f"paired lift needs two equal 1-d arrays, got shapes {a.shape} and {b.shape}")
    if a.size == 0:
        raise EstimationError("paired lift: no units")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise EstimationError("paired lift: a unit's total is not finite")
    total_b = float(b.sum())
    if total_b <= 0.0:
        raise EstimationError("paired lift is undefined: the counterfactual totals sum to 0")
    point = float(a.sum()) / total_b - 1.0
    sums = _resample_sums(np.column_stack([a, b]), n_boot, np.random.default_rng(seed))
    rel = np.full(n_boot, np.nan)
    np.divide(sums[:, 0], sums[:, 1], out=rel, where=sums[:, 1] > 0)
    return _percentiles(rel - 1.0, point, int(a.size), alpha, "paired lift")


def compare(
    arms: Mapping[str, ArmData],
    pairs: Sequence[tuple[str, str]] = DEFAULT_PAIRS,
    method: Method = "bootstrap",
    *,
    alpha: float = 0.05,
    n_boot: int = 2000,
    seed: int = 0,
    strict: bool = False,
) -> ABReport:
    """Every arm's metrics and each pair's lifts in every ratio metric.

    Every arm given must have traffic (the error names the one that has none). A pair whose arm
    is not given at all (an arm switched off), or whose lift is undefined (a baseline without
    clicks), is skipped and listed in `skipped_pairs` with the reason; with `strict` (pairs the
    user asked for by name) it is an `EstimationError` instead.
    """
    cache: dict[int, Array] = {}  # each arm resampled once, for its metrics and its lifts
    metrics = {
        name: arm_metrics(data, method, alpha=alpha, n_boot=n_boot, seed=seed, cache=cache)
        for name, data in arms.items()
    }
    lifts: list[Lift] = []
    skipped: list[str] = []
    for a, b in pairs:
        try:
            if a not in arms or b not in arms:
                raise EstimationError(f"arm {(b if a in arms else a)!r} has no traffic in the range")
            lifts.extend(
                lift(arms[a], arms[b], metric, method, alpha=alpha, n_boot=n_boot, seed=seed, cache=cache)
                for metric in RATIOS
            )
        except EstimationError as exc:
            if strict:
                raise EstimationError(f"{a} vs {b}: {exc}") from None
            skipped.append(f"{a} vs {b}: {exc}")
    return ABReport(metrics, lifts, method, alpha, n_boot if method == "bootstrap" else 0, seed, skipped)


# CUPED (Deng, Xu, Kohavi, Walker, WSDM 2013) on ratio metrics, through their linearisation (Deng,
# Knoblich, Lu, KDD 2018): per user of arm a, l = (y − R_a·x) / x̄_a (R_a's influence: R_a minus its
# expectation ≈ mean l) and the covariate m = (y0 − R0·x0) / x̄0 from the same user's pre-period
# (R0, x̄0 pooled over both arms, so m averages 0 over all users); θ = the within-arm pooled
# regression of l on m; the adjusted ratio R̃_a = R_a − θ·m̄_a, var(R̃_a) ≈ var(l − θ·m) / n_a.
# Every quantity is a function of per-arm column sums of the products below, so the bootstrap
# resamples users (post and pre row together) and recomputes R0, θ and R̃ in each resample.
_CUPED = ("y", "x", "y0", "x0", "yy", "xy", "xx", "yy0", "yx0", "xy0", "xx0", "y0y0", "y0x0", "x0x0")


def _cuped_matrix(post: ArmData, pre: ArmData, metric: str) -> Array:
    num, den = RATIOS[metric]
    y, x = post.column(num), post.column(den)
    y0, x0 = pre.column(num), pre.column(den)
    cols = {"y": y, "x": x, "y0": y0, "x0": x0}
    cols |= {a + b: cols[a] * cols[b] for a, b in (("y", "y"), ("x", "y"), ("x", "x"), ("y", "y0"),
             ("y", "x0"), ("x", "y0"), ("x", "x0"), ("y0", "y0"), ("y0", "x0"), ("x0", "x0"))}  # fmt: skip
    return np.column_stack([cols[c] for c in _CUPED])


def _cuped_from_sums(sa: Array, sb: Array, na: int, nb: int) -> tuple[Array, Array, Array, Array, Array]:
    """From the two arms' column sums (rows: resamples): θ, R̃_A, R̃_B, var(R̃_A), var(R̃_B) (NaN
    where a denominator is 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        c = {name: (sa[:, k], sb[:, k]) for k, name in enumerate(_CUPED)}
        r0 = (c["y0"][0] + c["y0"][1]) / (c["x0"][0] + c["x0"][1])
        x0bar = (c["x0"][0] + c["x0"][1]) / (na + nb)
        x0bar = np.where(x0bar > 0, x0bar, np.nan)
        parts = []
        for k, n in ((0, na), (1, nb)):
            s = {name: v[k] for name, v in c.items()}
            r = s["y"] / s["x"]
            xbar = s["x"] / n
            sum_m = np.nan_to_num((s["y0"] - r0 * s["x0"]) / x0bar)
            sum_lm = np.nan_to_num(
                (s["yy0"] - r0 * s["yx0"] - r * s["xy0"] + r * r0 * s["xx0"]) / (xbar * x0bar)
            )
            sum_mm = np.nan_to_num((s["y0y0"] - 2 * r0 * s["y0x0"] + r0**2 * s["x0x0"]) / x0bar**2)
            sum_ll = (s["yy"] - 2 * r * s["xy"] + r**2 * s["xx"]) / xbar**2
            parts.append((n, r, sum_m, sum_lm, sum_mm, sum_ll))
        den = sum(p[4] - p[2] ** 2 / p[0] for p in parts)
        theta = np.where(den > 1e-15 * np.maximum(1.0, sum(p[4] for p in parts)),
                         sum(p[3] for p in parts) / np.where(den > 0, den, 1.0), 0.0)  # fmt: skip
        adj, var = [], []
        for n, r, sum_m, sum_lm, sum_mm, sum_ll in parts:
            mbar = sum_m / n
            adj.append(r - theta * mbar)
            # Σ(res − mean)² with res = l − θm, Σl = 0: Σl² − 2θΣlm + θ²Σm² − n·(θ·m̄)²
            ss = sum_ll - 2 * theta * sum_lm + theta**2 * sum_mm - n * (theta * mbar) ** 2
            var.append(np.maximum(ss, 0.0) / (n - 1) / n if n > 1 else np.full_like(r, np.inf))
    return theta, adj[0], adj[1], var[0], var[1]


@dataclass(frozen=True)
class CupedLift:
    """A CUPED-adjusted relative lift, the regression coefficient θ, and the variance of the
    lift's log relative to the unadjusted one (delta method: 1 − that is what CUPED saved)."""

    lift: Lift
    theta: float
    variance_ratio: float

    def as_dict(self) -> dict[str, object]:
        return {**self.lift.as_dict(), "theta": self.theta, "variance_ratio": self.variance_ratio}


def cuped_lift(
    arm: ArmData,
    baseline: ArmData,
    pre: tuple[ArmData, ArmData],
    metric: str = "ctr",
    method: Method = "bootstrap",
    *,
    alpha: float = 0.05,
    n_boot: int = 2000,
    seed: int = 0,
) -> CupedLift:
    """The relative lift of `arm` over `baseline` in a ratio metric, CUPED-adjusted by each user's
    same metric over a pre-period (`pre`: the arm's and the baseline's, one row per user in the
    order of `arm` / `baseline`; a user without pre-period data has zeros). The covariate must not be
    affected by the arms (a period before they were served): then the adjusted lift is unbiased
    and its variance is that of the raw lift times about 1 − ρ² (ρ: the users' post/pre
    correlation of the linearised metric).

    >>> a = ArmData.of("learning", [1, 1, 1], [10, 10, 10], [3, 5, 4], [0, 0, 0])
    >>> b = ArmData.of("control", [1, 1, 1], [10, 10, 10], [1, 3, 3], [0, 0, 0])
    >>> pa = ArmData.of("learning", [1, 1, 1], [10, 10, 10], [2, 4, 2], [0, 0, 0])
    >>> pb = ArmData.of("control", [1, 1, 1], [10, 10, 10], [0, 2, 1], [0, 0, 0])
    >>> c = cuped_lift(a, b, (pa, pb), "ctr", "delta")
    >>> round(c.lift.estimate.value, 12), round(c.theta, 12)  # 5/64 (raw: 5/7), θ = 6/7
    (0.078125, 0.857142857143)
    """
    if metric not in RATIOS:
        raise EstimationError(f"lift of {metric!r}: choose a ratio metric ({', '.join(RATIOS)})")
    pre_arm, pre_baseline = pre
    for post, before in ((arm, pre_arm), (baseline, pre_baseline)):
        _require_users(post)
        if before.users != post.users:
            raise EstimationError(
                f"arm {post.arm!r}: the pre-period has {before.users} user rows, the period {post.users}"
            )
    ratio(arm, metric)
    if ratio(baseline, metric) == 0.0:
        raise EstimationError(
            f"lift over arm {baseline.arm!r} is undefined: its {metric} is 0 (no clicks or revenue)"
        )
    ma, mb = _cuped_matrix(arm, pre_arm, metric), _cuped_matrix(baseline, pre_baseline, metric)
    na, nb = arm.users, baseline.users
    theta, ra, rb, va, vb = (float(v[0]) for v in _cuped_from_sums(ma.sum(0)[None], mb.sum(0)[None], na, nb))
    if not (ra > 0 and rb > 0):
        raise EstimationError(
            f"CUPED lift of arm {arm.arm!r} over {baseline.arm!r} in {metric}: an adjusted {metric} "
            f"is not positive ({ra:.4g}, {rb:.4g}); the covariate does not fit this metric"
        )
    point = ra / rb - 1.0
    raw_var = (
        _delta_var(arm, metric) / ratio(arm, metric) ** 2
        + _delta_var(baseline, metric) / ratio(baseline, metric) ** 2
    )
    log_var = va / ra**2 + vb / rb**2
    vr = log_var / raw_var if raw_var > 0 and math.isfinite(raw_var) else math.nan
    n = na + nb
    if method == "delta":
        half = z_value(alpha) * math.sqrt(log_var)
        est = Estimate(
            point, math.exp(math.log1p(point) - half) - 1.0, math.exp(math.log1p(point) + half) - 1.0, n
        )
    elif method == "bootstrap":
        sa = _resample_sums(ma, n_boot, np.random.default_rng([seed, zlib.crc32(arm.arm.encode()), 1]))
        sb = _resample_sums(mb, n_boot, np.random.default_rng([seed, zlib.crc32(baseline.arm.encode()), 1]))
        _, ba, bb, _, _ = _cuped_from_sums(sa, sb, na, nb)
        rel = np.full(ba.shape, np.nan)
        np.divide(ba, bb, out=rel, where=np.isfinite(bb) & (bb > 0))
        what = f"CUPED lift of arm {arm.arm!r} over {baseline.arm!r} in {metric}"
        est = _percentiles(rel - 1.0, point, n, alpha, what)
    else:
        raise EstimationError(f"interval method {method!r} is not one of bootstrap, delta")
    return CupedLift(Lift(arm.arm, baseline.arm, metric, est), theta, vr)
