"""Incrementality per channel (campaign × slot) from a campaign's randomised holdout.

A campaign's holdout (`incrementality`) is drawn per user, so it measures the campaign as a whole:
it says nothing by itself about how the campaign's effect splits over its slots. But every
held-out request is recorded as a holdout impression *in its slot*, so each user of the
campaign, exposed or held out, carries the number of impressions they got (or would have got)
in each slot, and the assignment is independent of those counts. Regressing a user's
conversions (in the lift's window after their first impression of the campaign) on their
per-slot counts separately in each arm gives, as the difference of the arms' slopes, the
conversions one more impression in that slot causes (a linear dose response; the regression is
on the randomised contrast, so who the campaign targets, however confounded with conversion,
cancels out). A channel's incremental conversions are that slope times the exposed users'
impressions in the slot, with a robust (HC1) standard error.

The same regression gives the campaign's incremental conversions adjusted for the counts
(exposed users' conversions minus what the holdout arm's fit predicts for them), which is
unbiased like the plain difference of rates but more precise where the counts predict
conversions (a campaign that reaches heavy converters more often).

The holdouts of different campaigns are drawn independently, so together they are a factorial
experiment: for two campaigns a and b, the users in both are split four ways, and
(r11 − r01) − (r10 − r00) (rates of a's conversions by exposure to a and to b) is their
interaction per user. A campaign's own lift counts the whole interaction with every campaign its
users also saw (without a, the interaction does not happen), so the lifts of two campaigns that
work together add up to more than both cause. The Shapley split of a pairwise interaction is
half to each: `interactions` measures each ordered pair's interaction conversions with its
standard error, and `shapley_lifts` subtracts half of each from the campaign's lift, each
interaction shrunk toward 0 by its precision (normal-normal, τ² by the method of moments over
all pairs), so that pairs measured as noise change little.

`calibrate` (in `incrementality`) uses these: campaign totals from `shapley_lifts`, each split
over its channels with each channel's measured share pulling the model's by its precision.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from attribution.sql import Backend
from schemas.holdout import HOLDOUT_AD_ID

if TYPE_CHECKING:
    from attribution.incrementality import Lift

# One row per campaign × user × slot: the user's arm, conversions in the window after their first
# impression of the campaign (as LIFT_SQL counts them), and their impressions in that slot.
DOSE_SQL = """
SELECT campaign_id, user_id, exposed, conversions, slot, count() AS n
FROM (
    SELECT campaign_id, user_id, exposed, slots,
           -- 18.16 drops a column a lambda only captures: first_ts travels as an array argument
           length(arrayFilter((t, f) -> t >= f AND t - f <= %(window)s,
                              c_ts, arrayResize([first_ts], length(c_ts), first_ts))) AS conversions
    FROM (
        SELECT campaign_id, user_id, advertiser_id, max(ad_id != %(holdout)s) AS exposed,
               min(toUInt32(ts)) AS first_ts, groupArray(slot) AS slots
        FROM impressions FINAL
        WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
        GROUP BY campaign_id, user_id, advertiser_id
    ) AS e ANY LEFT JOIN (
        SELECT user_id, advertiser_id, groupArray(toUInt32(ts)) AS c_ts
        FROM conversions FINAL
        WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
        GROUP BY user_id, advertiser_id
    ) AS c USING user_id, advertiser_id
) ARRAY JOIN slots AS slot
GROUP BY campaign_id, user_id, exposed, conversions, slot
"""


@dataclass(frozen=True)
class ChannelLift:
    """A campaign's incremental conversions per slot (dose response) and in total (adjusted)."""

    campaign_id: str
    slots: tuple[str, ...]
    incremental: np.ndarray  # per slot: slope difference × exposed users' impressions there
    se: np.ndarray  # its standard error (HC1)
    exposed_impressions: np.ndarray  # per slot
    total: float  # the campaign's incremental conversions, adjusted for the counts
    total_se: float


@dataclass(frozen=True)
class HoldoutDesign:
    """What the holdouts measure beyond each campaign's lift: per-slot lifts and interactions."""

    channels: dict[str, ChannelLift] = field(default_factory=dict)
    # (a, b) → (interaction conversions inside a's lift among users exposed to both, its SE)
    interactions: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)


Cell = tuple[str, int, float, str, int]  # user, exposed, conversions, slot, impressions


def measure_design(backend: Backend, since: int, until: int, window_s: int = 7 * 86400) -> HoldoutDesign:
    """Per-slot lifts and pairwise interactions of every campaign with both arms in [since, until)."""
    params = {"since": since, "until": until, "holdout": HOLDOUT_AD_ID, "window": window_s}
    by_campaign: dict[str, list[Cell]] = {}
    for campaign, user, exposed, conv, slot, n in backend.execute(DOSE_SQL, params):
        by_campaign.setdefault(str(campaign), []).append(
            (str(user), int(exposed), float(conv), str(slot), int(n))
        )
    channels: dict[str, ChannelLift] = {}
    for campaign, cells in by_campaign.items():
        lift = dose_response(campaign, cells)
        if lift is not None:
            channels[campaign] = lift
    return HoldoutDesign(channels, interactions(by_campaign))


def interactions(by_campaign: dict[str, list[Cell]]) -> dict[tuple[str, str], tuple[float, float]]:
    """Each ordered pair's interaction conversions inside the first campaign's lift, with SE.

    For campaign a, over its users: a's conversions regressed on a's exposure and, per other
    campaign b, being in b's population, exposed to b, and both crossed with a's exposure; the
    coefficient of (exposed to a) × (exposed to b), times the users exposed to both, is the
    interaction (HC1 standard error). Pairs with under 10 users in a cell are left out.
    """
    arm = {c: {u: (e, y) for u, e, y, _, _ in cells} for c, cells in by_campaign.items()}
    out: dict[tuple[str, str], tuple[float, float]] = {}
    for a, users_a in arm.items():
        users = list(users_a)
        ea = np.array([users_a[u][0] for u in users], dtype=float)
        y = np.array([users_a[u][1] for u in users])
        cols, names = [np.ones(len(users)), ea], []
        for b, users_b in arm.items():
            if b == a:
                continue
            pb = np.array([u in users_b for u in users], dtype=float)
            eb = np.array([users_b[u][0] if u in users_b else 0 for u in users], dtype=float)
            both = ea * pb * eb
            cells = (pb * (1 - ea) * (1 - eb), pb * (1 - ea) * eb, pb * ea * (1 - eb), both)
            if min(float(c.sum()) for c in cells) < 10:
                continue
            cols += [pb, pb * eb, ea * pb, both]
            names.append((b, float(both.sum())))
        fit = _ols(np.column_stack(cols), y) if names else None
        if fit is None:
            continue
        coef, cov = fit
        for j, (b, n_both) in enumerate(names):
            k = 2 + 4 * j + 3
            out[(a, b)] = (float(coef[k]) * n_both, float(np.sqrt(cov[k, k])) * n_both)
    return out


def shapley_lifts(
    lifts: dict[str, Lift], pairs: dict[tuple[str, str], tuple[float, float]]
) -> dict[str, Lift]:
    """The lifts with half of each pairwise interaction taken out (its Shapley split), each
    interaction shrunk toward 0 by its precision (τ² over all pairs, method of moments)."""
    if not pairs:
        return lifts
    vals = np.array([v for v, _ in pairs.values()])
    ses = np.array([se for _, se in pairs.values()])
    tau2 = max(0.0, float(np.mean(vals**2 - ses**2)))
    if tau2 == 0.0:
        return lifts
    out: dict[str, Lift] = {}
    for campaign, lift in lifts.items():
        shared = sum(v * tau2 / (tau2 + se**2) for (a, _), (v, se) in pairs.items() if a == campaign)
        out[campaign] = replace(lift, incremental_conversions=lift.incremental_conversions - 0.5 * shared)
    return out


def dose_response(campaign: str, cells: list[Cell]) -> ChannelLift | None:
    """The estimate from (user, exposed, conversions, slot, impressions) cells of one campaign;
    None without enough users in both arms to fit the slopes."""
    slots = tuple(sorted({c[3] for c in cells}))
    users = sorted({c[0] for c in cells})
    ui = {u: i for i, u in enumerate(users)}
    si = {s: j for j, s in enumerate(slots)}
    n = np.zeros((len(users), len(slots)))
    y = np.zeros(len(users))
    exposed = np.zeros(len(users), dtype=bool)
    for user, e, conv, slot, count in cells:
        i = ui[user]
        n[i, si[slot]] = count
        y[i], exposed[i] = conv, bool(e)
    x = np.column_stack([np.ones(len(users)), n])
    k = x.shape[1]
    if min(int(exposed.sum()), int((~exposed).sum())) <= 2 * k:
        return None
    fits = [_ols(x[m], y[m]) for m in (exposed, ~exposed)]
    if any(f is None for f in fits):
        return None
    (b_e, v_e), (b_h, v_h) = fits  # type: ignore[misc]
    beta = (b_e - b_h)[1:]
    beta_var = np.diag(v_e + v_h)[1:]
    dose = n[exposed].sum(axis=0)
    # exposed users' conversions minus what the holdout arm's fit predicts for them
    xbar = x[exposed].mean(axis=0)
    n_e = int(exposed.sum())
    resid = y[exposed] - x[exposed] @ b_e
    mean_var = float(resid @ resid) / max(n_e - k, 1) / n_e
    total = n_e * float(y[exposed].mean() - xbar @ b_h)
    total_se = n_e * float(np.sqrt(mean_var + xbar @ v_h @ xbar))
    return ChannelLift(campaign, slots, beta * dose, np.sqrt(beta_var) * dose, dose, total, total_se)


def _ols(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """OLS coefficients and their HC1 (heteroskedasticity-robust) covariance; None if singular.

    >>> b, v = _ols(np.column_stack([np.ones(4), [0.0, 1.0, 2.0, 3.0]]), np.array([1.0, 3.0, 5.0, 7.0]))
    >>> [round(float(c), 6) for c in b]
    [1.0, 2.0]
    """
    xtx = x.T @ x
    try:
        inv = np.linalg.inv(xtx)
    except np.linalg.LinAlgError:
        return None
    if not np.all(np.isfinite(inv)) or np.linalg.cond(xtx) > 1e12:
        return None
    b = inv @ x.T @ y
    r = y - x @ b
    m, k = x.shape
    meat = (x * (r**2)[:, None]).T @ x
    return b, inv @ meat @ inv * (m / max(m - k, 1))
