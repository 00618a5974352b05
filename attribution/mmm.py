"""A media-mix model of every channel the advertiser pays for, on PyMC-Marketing, calibrated by
adstream's holdouts.

Daily spend per channel (what own impressions were billed, `attribution.roi.BILLED_SQL`; imported
outside spend) and daily conversions come from ClickHouse (`daily_data`). PyMC-Marketing's `MMM`
fits conversions as an intercept plus, per channel, a geometric adstock (carry-over, normalised: a
constant spend s adstocks to s) followed by a logistic saturation β·(1 − e^(−λx))/(1 + e^(−λx))
(`fit_mmm`). The lift that a campaign's holdout measured (`attribution.incrementality.measure_lift`)
enters as PyMC-Marketing's lift-test calibration (`add_lift_test_measurements`): at daily spend x
the campaign's curve from 0 to x must give the incremental conversions a day that the experiment
saw, within its standard error. Experiments run outside adstream (a geo test, a platform's
conversion-lift study of an outside channel) enter the same way from a lift file
(`parse_lift_csv`, `adstream attribution mmm --lift-file FILE.csv`): the channels adstream does not
serve have no holdout, and their curves are otherwise set by the priors.

From the posterior: each channel's contribution (credit shares), its response curve (expected
conversions a day at a steady daily spend, with an interval), and budget moves: the fixed total
daily budget split to maximise the posterior-mean total response within per-channel bounds
(`plan_mmm_budget`, the fitted curves in place of `attribution.roi`'s fixed elasticity), with
the interval of the expected gain over the posterior. `meridian_export` writes the same data and
lift-based ROI priors as Google Meridian's `CsvDataLoader` reads them.

`quick=True` fits by mean-field ADVI (seconds to a minute, an approximate posterior: for tests
and previews); the full fit is NUTS. A fit whose loss or draws are not finite, or whose NUTS
chains disagree (r-hat > 1.1), is an `MmmFitError`, never a silent result.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from attribution.csv_rows import CsvRows
from attribution.incrementality import Lift
from attribution.paths import AttributionInputError, channel_sql, check_range, outside_sql
from attribution.roi import billed_sql, spend_params
from attribution.sql import Backend

DAY = 86400
L_MAX = 7  # adstock carry-over window, days
QUICK_ITERATIONS = 6000  # ADVI steps of a quick fit
QUICK_DRAWS = 300  # approximate-posterior draws of a quick fit
# Adam at this rate: PyMC's default (adagrad) had not converged after the same steps (loss 4,442
# vs 4.7 on a 42-day, 4-channel test market)
QUICK_LEARNING_RATE = 0.03
FULL = {"draws": 500, "tune": 1000, "chains": 2, "target_accept": 0.95}
RHAT_MAX = 1.1

# one row per (UTC day number, channel): spend and impressions (own) / touches (outside)
DAILY_SQL = """
SELECT dn, channel, sum(spend) AS spend, sum(n) AS n
FROM (
    SELECT intDiv(toUInt32(ts), 86400) AS dn, {ch} AS channel, sum(spend) AS spend, count() AS n
    FROM ({billed}) AS b
    GROUP BY dn, channel
    UNION ALL
    SELECT toUInt32(toRelativeDayNum(day)) AS dn, {outside} AS channel, sum(spend) AS spend,
           toUInt64(0) AS n
    FROM outside_spend FINAL
    WHERE day >= toDate(%(since_day)s) AND day < toDate(%(until_day)s) {adv}
    GROUP BY dn, channel
    UNION ALL
    SELECT intDiv(toUInt32(ts), 86400) AS dn, {outside} AS channel, toFloat64(0) AS spend, count() AS n
    FROM touches FINAL
    WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s) {adv}
    GROUP BY dn, channel
)
GROUP BY dn, channel
ORDER BY dn, channel
"""
CONVERSIONS_SQL = """
SELECT intDiv(toUInt32(ts), 86400) AS dn, count() AS conversions, sum(value) AS value
FROM conversions FINAL
WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s) {adv}
GROUP BY dn
ORDER BY dn
"""


class MmmFitError(AttributionInputError):
    """The media-mix model did not converge (or could not be fitted) on this data."""


@dataclass(frozen=True)
class MmmData:
    """Whole UTC days [first_day, first_day + days) × channels."""

    first_day: int  # days since 1970-01-01
    channels: tuple[str, ...]
    spend: np.ndarray  # (days, channels)
    impressions: np.ndarray  # (days, channels): impressions (own) or touches (outside)
    conversions: np.ndarray  # (days,)
    value: np.ndarray  # (days,)

    @property
    def days(self) -> int:
        return int(self.conversions.shape[0])

    def dates(self) -> list[str]:
        from datetime import UTC, datetime

        return [
            datetime.fromtimestamp((self.first_day + d) * DAY, UTC).date().isoformat()
            for d in range(self.days)
        ]


def daily_data(backend: Backend, by: str, since: int, until: int, advertiser: str | None = None) -> MmmData:
    """Daily spend per channel and daily conversions of the whole UTC days in [since, until)."""
    check_range(since, until)
    first, last = -(-since // DAY), until // DAY  # whole days only
    if last - first < 1:
        raise AttributionInputError(f"range {since}..{until} holds no whole UTC day for a media-mix model")
    params = {**spend_params(first * DAY, last * DAY), "advertiser": advertiser or ""}
    adv = "AND advertiser_id = %(advertiser)s" if advertiser else ""
    daily = DAILY_SQL.format(ch=channel_sql(by), outside=outside_sql(by), adv=adv, billed=billed_sql(adv))
    rows = backend.execute(daily, params)
    conv_rows = backend.execute(CONVERSIONS_SQL.format(adv=adv), params)
    channels = tuple(sorted({str(r[1]) for r in rows}))
    n = last - first
    spend, imps = np.zeros((n, len(channels))), np.zeros((n, len(channels)))
    idx = {c: i for i, c in enumerate(channels)}
    for day, ch, s, k in rows:
        if first <= int(day) < last:
            spend[int(day) - first, idx[str(ch)]] += float(s)
            imps[int(day) - first, idx[str(ch)]] += float(k)
    conv, value = np.zeros(n), np.zeros(n)
    for day, c, v in conv_rows:
        if first <= int(day) < last:
            conv[int(day) - first], value[int(day) - first] = float(c), float(v)
    paid = spend.sum(axis=0) > 0
    if not paid.any() or conv.sum() <= 0:
        raise AttributionInputError(
            f"no spend and conversions in {first * DAY}..{last * DAY} (whole UTC days): "
            "nothing for a media-mix model"
        )
    return MmmData(
        first,
        tuple(c for c, p in zip(channels, paid, strict=True) if p),
        spend[:, paid],
        imps[:, paid],
        conv,
        value,
    )


def lift_tests(data: MmmData, lifts: dict[str, Lift], by: str) -> list[dict[str, Any]]:
    """PyMC-Marketing lift-test rows (channel, x, delta_x, delta_y, sigma) from holdout lifts: the
    campaign's curve from no spend to its mean daily spend must give its incremental conversions
    a day (a negative estimate counts as no lift: the saturation curves cannot go down)."""
    if by != "campaign":
        raise AttributionInputError(
            f"holdout calibration of the media-mix model needs --by campaign, not {by!r}"
        )
    rows = []
    for c, name in enumerate(data.channels):
        lift = lifts.get(name)
        if lift is None:
            continue
        daily = float(data.spend[:, c].mean())
        if daily <= 0:
            continue
        rows.append(
            {
                "channel": name,
                "x": 0.0,
                "delta_x": daily,
                "delta_y": max(lift.incremental_conversions, 0.0) / data.days,
                "sigma": max(lift.se / data.days, 1e-6),
            }
        )
    return rows


class LiftFileError(AttributionInputError):
    """A lift file with bad rows: each named by its line number; nothing was fitted."""


LIFT_COLUMNS = ("channel", "x", "delta_x", "delta_y", "sigma")
LIFT_REQUIRED = ("channel", "delta_x", "delta_y", "sigma")


def parse_lift_csv(
    text: str, channels: tuple[str, ...], name: str = "lift file"
) -> tuple[list[dict[str, Any]], list[str]]:
    """Lift experiments run outside adstream (a geo test, a platform's conversion-lift study) as
    PyMC-Marketing lift-test rows, and notes on rows that were adjusted.

    The file has a header `channel,x,delta_x,delta_y,sigma` (any order; `x` may be left out: 0),
    one experiment a row, in the media-mix model's daily units: at daily spend `x` a change of
    `delta_x` a day changed conversions by `delta_y` a day, with standard error `sigma`. `channel`
    is one of the fitted channels as `adstream attribution mmm` names them (an outside channel as
    `source/medium[/campaign]`). The whole file is checked first; every bad row is named by its
    line. A measured lift whose sign is opposite to the spend change (noise around no effect) is
    counted as 0, as a holdout's negative lift is (the response curves cannot go down), and said in
    the notes.
    """
    reader = CsvRows(text, name, LIFT_COLUMNS, LIFT_REQUIRED, LiftFileError)
    known = set(channels)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for line, record in reader:
        try:
            row = _lift_row(record, known)
        except ValueError as exc:
            reader.bad(line, str(exc))
            continue
        if row["delta_x"] * row["delta_y"] < 0:
            notes.append(
                f"line {line}: {row['channel']}'s lift {row['delta_y']:+g} has the opposite sign of "
                f"its spend change {row['delta_x']:+g}; counted as 0"
            )
            row["delta_y"] = 0.0
        rows.append(row)
    reader.check("nothing fitted")
    if not rows:
        raise LiftFileError(f"{name}: no lift rows")
    return rows, notes


def _lift_row(record: dict[str, str], known: set[str]) -> dict[str, Any]:
    """One lift-file row's cells → a lift-test row; ValueError naming the cell otherwise."""
    channel = record["channel"].strip()
    if channel not in known:
        shown = ", ".join(sorted(known)[:12]) + (", …" if len(known) > 12 else "")
        raise ValueError(f"channel {channel!r} is not in the data (channels: {shown})")
    row: dict[str, Any] = {"channel": channel}
    for col in ("x", "delta_x", "delta_y", "sigma"):
        raw = (record.get(col) or "").strip() or ("0" if col == "x" else "")
        try:
            v = float(raw)
        except ValueError:
            raise ValueError(f"{col} {raw!r} is not a number") from None
        if not math.isfinite(v):
            raise ValueError(f"{col} {raw!r} is not finite")
        row[col] = v
    x, dx = row["x"], row["delta_x"]
    if x < 0:
        raise ValueError(f"x {x:g} is below 0 (a daily spend)")
    if dx == 0:
        raise ValueError("delta_x is 0: an experiment changes the spend")
    if x + dx < 0:
        raise ValueError(f"x + delta_x = {x + dx:g} is below 0 (a daily spend)")
    if row["sigma"] <= 0:
        raise ValueError(f"sigma {row['sigma']:g} is not above 0 (the lift's standard error)")
    return row


@dataclass
class MmmFit:
    """Posterior draws of the fitted model, in the data's units (spend a day → conversions a day)."""

    data: MmmData
    alpha: np.ndarray  # (draws, channels) adstock decay
    lam: np.ndarray  # (draws, channels) saturation rate, per scaled spend
    beta: np.ndarray  # (draws, channels) saturation ceiling, scaled conversions
    channel_scale: np.ndarray  # (channels,)
    target_scale: float
    contribution: np.ndarray  # (draws, channels): conversions contributed over the data's days
    meta: dict[str, Any] = field(default_factory=dict)

    def response(self, daily_spend: np.ndarray) -> np.ndarray:
        """Expected conversions a day per channel at a steady daily spend: (draws, ..., channels)."""
        x = np.asarray(daily_spend, dtype=float) / self.channel_scale
        u = self.lam.reshape(self.lam.shape[0], *([1] * (x.ndim - 1)), -1) * x
        b = self.beta.reshape(self.beta.shape[0], *([1] * (x.ndim - 1)), -1)
        return np.asarray(self.target_scale * b * (1 - np.exp(-u)) / (1 + np.exp(-u)))

    def shares(self) -> np.ndarray:
        """Posterior-mean share of the channels' contributions."""
        mean: np.ndarray = self.contribution.mean(axis=0)
        total = float(mean.sum())
        return mean / total if total > 0 else mean

    def curves(self, points: int = 11, top: float = 2.0) -> dict[str, Any]:
        """Response curves per channel on 0..top × the mean daily spend: mean and 90 % interval."""
        mean_spend = self.data.spend.mean(axis=0)
        grid = np.linspace(0.0, top, points)[:, None] * mean_spend[None, :]
        r = self.response(grid)  # (draws, points, channels)
        lo, mid, hi = np.percentile(r, [5, 50, 95], axis=0)
        return {
            ch: {
                "spend": grid[:, c].round(4).tolist(),
                "conversions": r.mean(axis=0)[:, c].round(4).tolist(),
                "median": mid[:, c].round(4).tolist(),
                "low": lo[:, c].round(4).tolist(),
                "high": hi[:, c].round(4).tolist(),
            }
            for c, ch in enumerate(self.data.channels)
        }


def _frame(data: MmmData) -> Any:
    import pandas as pd

    cols = [f"x{i}" for i in range(len(data.channels))]
    x = pd.DataFrame(data.spend, columns=cols)
    x["date"] = pd.to_datetime(data.dates())
    return x, pd.Series(data.conversions, name="y"), cols


def fit_mmm(
    data: MmmData, lifts: list[dict[str, Any]] | None = None, *, quick: bool = True, seed: int = 0
) -> MmmFit:
    """Fit PyMC-Marketing's MMM (geometric adstock, logistic saturation) to `data`, calibrated by
    lift tests when given (rows of `lift_tests`)."""
    import logging
    import warnings

    if data.days < 2 * L_MAX:
        raise AttributionInputError(
            f"a media-mix model needs at least {2 * L_MAX} days of data, the range holds {data.days}"
        )
    import pandas as pd
    import pymc as pm
    from pymc_marketing.mmm import MMM, GeometricAdstock, LogisticSaturation

    for name in ("pymc", "pytensor", "pymc_marketing", "pymc.stats.convergence", "arviz"):
        logging.getLogger(name).setLevel(logging.ERROR)
    x, y, cols = _frame(data)
    mmm = MMM(
        date_column="date",
        channel_columns=cols,
        adstock=GeometricAdstock(l_max=L_MAX),
        saturation=LogisticSaturation(),
    )
    t0 = time.perf_counter()
    meta: dict[str, Any] = {"library": "pymc-marketing", "quick": quick, "seed": seed}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mmm.build_model(x, y)
        if lifts:
            by_col = {ch: col for ch, col in zip(data.channels, cols, strict=True)}
            df = pd.DataFrame([{**r, "channel": by_col[r["channel"]]} for r in lifts])
            mmm.add_lift_test_measurements(df, dist=_normal())
            meta["lift_tests"] = [r["channel"] for r in lifts]
        with mmm.model:
            if quick:
                approx = pm.fit(
                    n=QUICK_ITERATIONS,
                    method="advi",
                    obj_optimizer=pm.adam(learning_rate=QUICK_LEARNING_RATE),
                    progressbar=False,
                    random_seed=seed,
                )
                loss = np.asarray(approx.hist)
                if not np.all(np.isfinite(loss[-100:])):
                    raise MmmFitError(
                        "the media-mix model's quick fit (ADVI) diverged: its loss is not finite"
                    )
                idata = approx.sample(QUICK_DRAWS, random_seed=seed)
                meta.update(
                    method="advi",
                    iterations=QUICK_ITERATIONS,
                    draws=QUICK_DRAWS,
                    final_loss=round(float(loss[-100:].mean()), 3),
                )
            else:
                idata = pm.sample(**FULL, cores=1, progressbar=False, random_seed=seed)
                meta.update(method="nuts", **FULL, divergences=int(idata.sample_stats.diverging.sum()))
                _check_rhat(idata)
            post = idata.posterior
            contrib = pm.compute_deterministics(
                post, var_names=["channel_contribution"], merge_dataset=False, progressbar=False
            )
    meta["fit_s"] = round(time.perf_counter() - t0, 2)

    def draws(name: str, src: Any = post) -> np.ndarray:
        a = np.asarray(src[name].values, dtype=float)
        return a.reshape(-1, *a.shape[2:])

    alpha, lam, beta = draws("adstock_alpha"), draws("saturation_lam"), draws("saturation_beta")
    target_scale = float(getattr(mmm, "target_scale", 1.0))
    channel_scale = np.asarray(getattr(mmm, "channel_scale", np.ones(len(cols))), dtype=float).reshape(-1)
    contribution = draws("channel_contribution", contrib).sum(axis=1) * target_scale
    for name, a in (
        ("adstock", alpha),
        ("saturation", lam),
        ("ceiling", beta),
        ("contribution", contribution),
    ):
        if not np.all(np.isfinite(a)):
            raise MmmFitError(f"the media-mix model's {name} draws are not finite: the fit did not converge")
    return MmmFit(data, alpha, lam, beta, channel_scale, target_scale, contribution, meta)


def _normal() -> Any:
    import pymc.dims as pmd

    return pmd.Normal


def _check_rhat(idata: Any) -> None:
    import arviz as az

    rhat = az.rhat(  # type: ignore[no-untyped-call]
        idata, var_names=["adstock_alpha", "saturation_lam", "saturation_beta", "intercept"]
    )
    worst = max(float(np.nanmax(rhat[v].values)) for v in rhat.data_vars)
    if not worst <= RHAT_MAX:
        raise MmmFitError(f"the media-mix model did not converge: r-hat {worst:.3f} > {RHAT_MAX}")


@dataclass(frozen=True)
class MmmBudgetPlan:
    """Daily budget moves from the fitted curves, with the posterior interval of their gain."""

    channels: tuple[str, ...]
    spend: np.ndarray  # current mean daily spend
    recommended: np.ndarray  # daily
    gain: dict[str, float]  # expected conversions a day gained: mean, low (5 %), high (95 %)
    channel_gain: np.ndarray  # (channels, 3): mean, low, high per channel

    @property
    def multipliers(self) -> dict[str, float]:
        return {
            c: float(r / s)
            for c, s, r in zip(self.channels, self.spend, self.recommended, strict=True)
            if s > 0
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "gain_conversions_per_day": {k: round(v, 4) for k, v in self.gain.items()},
            "channels": [
                {
                    "channel": c,
                    "daily_spend": round(float(s), 4),
                    "recommended_daily_spend": round(float(r), 4),
                    "gain": round(float(g[0]), 4),
                    "gain_low": round(float(g[1]), 4),
                    "gain_high": round(float(g[2]), 4),
                }
                for c, s, r, g in zip(
                    self.channels, self.spend, self.recommended, self.channel_gain, strict=True
                )
            ],
        }


def plan_mmm_budget(fit: MmmFit, max_change: float = 0.5) -> MmmBudgetPlan:
    """The fixed total daily budget re-split to maximise the posterior-mean response (each channel
    within ±`max_change` of its spend; the curves are concave, so the optimum is where marginal
    returns are equal or a bound binds: bisection on the common marginal return)."""
    if not 0 <= max_change:
        raise AttributionInputError(f"max change {max_change!r} must be ≥ 0")
    spend = fit.data.spend.mean(axis=0)
    lo, hi = spend * (1 - min(max_change, 1.0)), spend * (1 + max_change)
    budget = float(spend.sum())
    new = equalise_marginal(lo, hi, budget, lambda grid: fit.response(grid).mean(axis=0))
    gain = fit.response(new[None, :])[:, 0, :] - fit.response(spend[None, :])[:, 0, :]  # (draws, channels)
    total = gain.sum(axis=1)
    q = np.percentile(total, [5, 95])
    per = np.stack([gain.mean(axis=0), *np.percentile(gain, [5, 95], axis=0)], axis=1)
    return MmmBudgetPlan(
        fit.data.channels,
        spend,
        new,
        {"mean": float(total.mean()), "low": float(q[0]), "high": float(q[1])},
        per,
    )


def plan_mmm_split(
    fit: MmmFit,
    split: dict[str, dict[str, tuple[float, float]]],
    max_change: float = 0.5,
) -> MmmBudgetPlan:
    """Budget moves at a finer grain than the media-mix model's units: each unit in `split` (a
    campaign) is cut into its parts (its slots), part → (credit, spend) from a multi-touch model
    at that grain (calibrated by the holdouts). A part with credit share w and spend share v of its
    unit gets the curve w · R(x / v), R the unit's fitted curve: at the unit's spend, or with every
    part scaled alike, the parts add up to the unit's curve; a part that earns more credit a dollar
    has the higher marginal return. The model sets each unit's level and saturation, the
    multi-touch credit the split within it; then the same fixed-budget optimum as
    `plan_mmm_budget`, each part within ±`max_change` of its spend. Units not in `split` stay whole.
    """
    if not 0 <= max_change:
        raise AttributionInputError(f"max change {max_change!r} must be ≥ 0")
    unit_spend = fit.data.spend.mean(axis=0)
    names: list[str] = []
    parent: list[int] = []
    weight: list[float] = []
    share: list[float] = []
    for u, unit in enumerate(fit.data.channels):
        parts = split.get(unit)
        spent = sum(v for _, v in parts.values()) if parts else 0.0
        if not parts or spent <= 0:
            names.append(unit)
            parent.append(u)
            weight.append(1.0)
            share.append(1.0)
            continue
        credit = sum(max(w, 0.0) for w, _ in parts.values())
        for name, (w, v) in parts.items():
            if v <= 0:
                continue  # a part with no spend cannot be moved
            names.append(name)
            parent.append(u)
            share.append(v / spent)
            weight.append(max(w, 0.0) / credit if credit > 0 else v / spent)
    par, wt, sh = np.array(parent), np.array(weight), np.array(share)
    scale = fit.channel_scale[par]

    def response(x: np.ndarray) -> np.ndarray:
        """(draws, ..., parts) expected conversions a day of each part at daily spend x."""
        z = np.asarray(x, dtype=float) / (sh * scale)
        lam = fit.lam[:, par].reshape(fit.lam.shape[0], *([1] * (z.ndim - 1)), -1)
        beta = fit.beta[:, par].reshape(fit.beta.shape[0], *([1] * (z.ndim - 1)), -1)
        e = np.exp(-lam * z)
        return np.asarray(fit.target_scale * wt * beta * (1 - e) / (1 + e))

    spend = unit_spend[par] * sh
    lo, hi = spend * (1 - min(max_change, 1.0)), spend * (1 + max_change)
    new = equalise_marginal(lo, hi, float(spend.sum()), lambda grid: response(grid).mean(axis=0))
    gain = response(new[None, :])[:, 0, :] - response(spend[None, :])[:, 0, :]
    total = gain.sum(axis=1)
    q = np.percentile(total, [5, 95])
    per = np.stack([gain.mean(axis=0), *np.percentile(gain, [5, 95], axis=0)], axis=1)
    return MmmBudgetPlan(
        tuple(names), spend, new, {"mean": float(total.mean()), "low": float(q[0]), "high": float(q[1])}, per
    )


def slot_split(result: Any, spend: dict[str, float]) -> dict[str, dict[str, tuple[float, float]]]:
    """A slot × campaign attribution result's credit and spend per slot (`cmp:slot`), grouped by
    campaign, as `plan_mmm_split` takes them; outside channels (no `:`) stay whole."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for c, credit in zip(result.channels, result.conversions, strict=True):
        unit, sep, _ = c.partition(":")
        if sep:
            out.setdefault(unit, {})[c] = (float(credit), float(spend.get(c, 0.0)))
    return out


def holdout_split(design: Any, spend: dict[str, float]) -> dict[str, dict[str, tuple[float, float]]]:
    """Each campaign's split into its slots from its holdout's own per-slot lifts
    (`channel_lift.HoldoutDesign.channels`), as `plan_mmm_split` takes them, shrunk toward
    "every slot returns alike a dollar" by how well the holdout tells the slots apart.

    The prior of a slot's incremental conversions is the campaign's measured total split by spend
    (its credit share = its spend share: the split then moves nothing the campaign's own curve
    does not); each slot's measurement x ± se pulls it by its precision, normal-normal shrinkage
    with the prior's spread τ² estimated from every measured slot at once (method of moments: the
    mean squared gap between measurement and prior less the measurements' own variance, as
    `incrementality.split_campaigns` does toward a model's split). Where the slots' measured
    differences are no larger than their noise, τ² is 0 and every campaign stays whole in effect;
    so too where they are larger but not significantly so (Cochran's Q, the gaps' squared
    z-scores summed, within the 95th percentile of its χ² under "every slot returns alike"): the
    truncated moment estimate is above 0 about as often as not on noise alone, and a split moved
    by noise loses conversions (the truth check's `mmm` market, 2026-12-06: 29 a run).
    A multi-touch model's split (`slot_split`) has no such check: its credits per slot differ
    whether or not the slots' returns do. A campaign whose spent slots the holdout did not all
    measure is left out (whole).
    """
    seen: dict[str, tuple[list[str], np.ndarray, np.ndarray, np.ndarray]] = {}
    for campaign, lift in design.channels.items():
        at = {s: j for j, s in enumerate(lift.slots)}
        names = [c for c in spend if c.partition(":")[0] == campaign and spend[c] > 0]
        slots = [c.partition(":")[2] for c in names]
        if len(names) < 2 or not all(s in at for s in slots):
            continue
        x = np.array([lift.incremental[at[s]] for s in slots], dtype=float)
        se = np.array([lift.se[at[s]] for s in slots], dtype=float)
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(se)) and np.all(se > 0)):
            continue
        v = np.array([spend[c] for c in names], dtype=float)
        prior = v / v.sum() * max(float(x.sum()), 0.0)
        seen[campaign] = (names, x, se, prior)
    if not seen:
        return {}
    gaps = np.concatenate([x - m for _, x, _, m in seen.values()])
    noise = np.concatenate([se**2 for _, _, se, _ in seen.values()])
    tau2 = max(0.0, float(np.mean(gaps**2 - noise)))
    # a campaign whose measured total is above 0 fixes its gaps' sum at 0: one degree fewer
    dof = sum(len(x) - (1 if x.sum() > 0 else 0) for _, x, _, _ in seen.values())
    if float(np.sum(gaps**2 / noise)) <= float(stats.chi2.ppf(0.95, dof)):
        tau2 = 0.0
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for campaign, (names, x, se, prior) in seen.items():
        w = tau2 / (tau2 + se**2)
        post = np.maximum(w * x + (1 - w) * prior, 0.0)
        if post.sum() <= 0:  # nothing measured above 0: no reason to move between its slots
            post = np.array([spend[c] for c in names], dtype=float)
        out[campaign] = {c: (float(p), float(spend[c])) for c, p in zip(names, post, strict=True)}
    return out


def equalise_marginal(
    lo: np.ndarray,
    hi: np.ndarray,
    budget: float,
    curve: Callable[[np.ndarray], np.ndarray],
    points: int = 401,
) -> np.ndarray:
    """Spend per channel within [lo, hi] summing to `budget` that maximises Σ curve (concave curves:
    where the marginal returns are equal, or a bound binds). `curve` maps spend (points, channels)
    to response (points, channels). Bisection on the common marginal return; the budget that the
    grid's steps leave goes to the channels at that return (with linear curves a whole channel's
    range can be at it: spreading it over every channel with room would fund worse ones)."""
    grid = np.linspace(0.0, 1.0, points)[:, None] * (hi - lo)[None, :] + lo[None, :]  # (points, channels)
    marginal = np.gradient(curve(grid), axis=0) / np.maximum(np.gradient(grid, axis=0), 1e-12)

    def alloc(level: float) -> np.ndarray:
        # per channel: the largest spend whose marginal return is still ≥ level (concave: decreasing)
        above = marginal >= level
        k = np.where(above.any(axis=0), above.shape[0] - 1 - np.argmax(above[::-1], axis=0), -1)
        out: np.ndarray = np.where(k >= 0, grid[np.maximum(k, 0), np.arange(grid.shape[1])], lo)
        return out

    a, b = float(marginal.min()) - 1.0, float(marginal.max()) + 1.0
    for _ in range(100):
        mid = 0.5 * (a + b)
        if alloc(mid).sum() > budget:
            a = mid
        else:
            b = mid
    new, over = alloc(b), alloc(a)
    short = budget - float(new.sum())
    if short <= 0:
        return new
    step = over - new  # what the channels at the common marginal return would take
    if step.sum() >= short:
        return np.asarray(new + step * (short / float(step.sum())))
    room = hi - new  # only when even every channel at its top cannot hold the budget
    return np.asarray(new + room * min(1.0, short / max(float(room.sum()), 1e-300)))


def lognormal_prior(mean: float, sd: float) -> dict[str, float]:
    """LogNormal(mu, sigma) with the given mean and standard deviation."""
    sigma2 = float(np.log1p((sd / mean) ** 2))
    return {"mu": round(float(np.log(mean)) - sigma2 / 2, 6), "sigma": round(float(np.sqrt(sigma2)), 6)}


def meridian_export(data: MmmData, lifts: dict[str, Lift], out_dir: Path) -> dict[str, Any]:
    """The data as Meridian's `CsvDataLoader` reads it (national: one row a day; kpi, revenue per
    kpi, media and media spend per channel) and its load spec with ROI priors from the holdout
    lifts (LogNormal `roi_m` per calibrated channel: incremental value / spend, its standard
    error); returns the spec (also written as meridian_spec.json beside meridian_data.csv)."""
    import csv

    out_dir.mkdir(parents=True, exist_ok=True)
    safe = [_column(c) for c in data.channels]
    media = [f"{s}_impression" for s in safe]
    spend_cols = [f"{s}_spend" for s in safe]
    rpk = data.value.sum() / data.conversions.sum()
    with (out_dir / "meridian_data.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["time", "conversions", "revenue_per_conversion", *media, *spend_cols])
        for d, day in enumerate(data.dates()):
            per = data.value[d] / data.conversions[d] if data.conversions[d] > 0 else rpk
            w.writerow(
                [
                    day,
                    f"{data.conversions[d]:.0f}",
                    f"{per:.6f}",
                    *(f"{v:.0f}" for v in data.impressions[d]),
                    *(f"{v:.6f}" for v in data.spend[d]),
                ]
            )
    priors: dict[str, Any] = {}
    for c, name in enumerate(data.channels):
        lift, total = lifts.get(name), float(data.spend[:, c].sum())
        if lift is None or total <= 0 or lift.incremental_conversions <= 0:
            continue
        roi = lift.incremental_conversions * rpk / total
        sd = max(lift.se * rpk / total, 0.05 * roi)
        priors[name] = {
            "distribution": "LogNormal",
            **lognormal_prior(roi, sd),
            "roi_mean": round(roi, 6),
            "roi_sd": round(sd, 6),
            "source": f"holdout of {name}",
        }
    spec = {
        "loader": "meridian.data.load.CsvDataLoader",
        "csv_path": "meridian_data.csv",
        "kpi_type": "non_revenue",
        "coord_to_columns": {
            "time": "time",
            "kpi": "conversions",
            "revenue_per_kpi": "revenue_per_conversion",
            "media": media,
            "media_spend": spend_cols,
        },
        "media_to_channel": dict(zip(media, data.channels, strict=True)),
        "media_spend_to_channel": dict(zip(spend_cols, data.channels, strict=True)),
        "roi_m_priors": priors,
    }
    (out_dir / "meridian_spec.json").write_text(json.dumps(spec, indent=2) + "\n")
    return spec


def _column(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name)


__all__ = [
    "MmmData",
    "MmmFit",
    "MmmFitError",
    "daily_data",
    "equalise_marginal",
    "fit_mmm",
    "lift_tests",
    "meridian_export",
    "plan_mmm_budget",
]
