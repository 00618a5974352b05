"""What one run of the live loop shows, with intervals: A/B lifts, online vs frozen, resets, exploration.

The closed loop knows every served impression and, from the simulator, whether it was clicked;
serving's arm, exploration flag and propensity of each impression are read back from
ClickHouse (the contract's `ab_arm`, `explored`, `propensity`); the trainer's progressive log
(`adstream trainer --score-log`) gives each impression's online and frozen score before it was
learned. The pure functions below turn those arrays into the figures `adstream demo` and
`benchmarks/live_loop.py` report:

- `arm_data`: per arm, one row per user (requests, impressions, clicks, revenue) — the unit of
  randomisation, which `attribution.ab.lift` resamples;
- `paired_auc_diff`: AUC(online) − AUC(frozen) on the same impressions, users resampled within
  each stratum (seed) with both scores together, so the interval is that of the difference;
- `resets_per_adapter_hour`, `exploration_cost`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from attribution.ab import ArmData, cuped_lift, lift, paired_lift
from attribution.ope import EstimationError, z_value
from schemas.stats import auc

F64 = NDArray[np.float64]
STR = NDArray[np.str_]
NO_ARM = ""


@dataclass(frozen=True)
class Served:
    """Every served impression of a run as arrays (one entry per impression)."""

    impression_id: STR
    user: STR
    request: STR
    price: F64
    clicked: F64  # the simulator's truth: 1 if the user clicked
    after: NDArray[np.bool_]  # served after the drift
    arm: STR  # NO_ARM where serving recorded none
    explored: NDArray[np.bool_]
    propensity: F64  # nan where serving recorded none
    pctr: F64 | None = None  # the served pctr (base, + adapters, + correction, as the arm was served)
    oracle: F64 | None = None  # the simulator's true click probability of the impression
    slot: STR | None = None
    position: NDArray[np.int64] | None = None
    # the simulator's season of the ad's category (`season_of`): +1 in season after the drift
    # (the handover's or trend's rising categories), -1 before it (falling), 0 neither
    season: NDArray[np.int8] | None = None

    @property
    def n(self) -> int:
        return int(self.price.shape[0])


Tags = Mapping[str, tuple[str, bool, float]]  # impression id → (arm, explored, propensity)


def season_of(world: Any, ad_ids: Sequence[str]) -> NDArray[np.int8]:
    """Per ad id, the season of its category in the simulator's world (`workloads.world.World`):
    +1 for a category whose interest rises at the drift (`trend_up`: the handover's new season),
    -1 for one whose interest falls (`trend_down`: the old season), 0 otherwise or unknown ad.

    >>> from types import SimpleNamespace as NS
    >>> w = NS(ads=NS(ad_ids=["a", "b", "c"], category=np.array([0, 1, 2])),
    ...        trend_up=np.array([1]), trend_down=np.array([2]))
    >>> season_of(w, ["a", "b", "c", "zz"]).tolist()
    [0, 1, -1, 0]
    """
    cat = dict(zip(world.ads.ad_ids, world.ads.category.tolist(), strict=True))
    up, down = set(world.trend_up.tolist()), set(world.trend_down.tolist())
    codes = [cat.get(a, -1) for a in ad_ids]
    return np.array([1 if c in up else -1 if c in down else 0 for c in codes], dtype=np.int8)


def served_of(impressions: Sequence[Any], labels: Sequence[int] | F64, drift_index: int | None,
              tags: Tags, oracle: F64 | None = None, world: Any = None) -> Served:  # fmt: skip
    """The served impressions (`schemas.events.Impression`s, in order) with the simulator's click
    labels (same order) and serving's tags; impressions from `drift_index` on are after the drift;
    with the simulator's `world`, each ad's season (`season_of`)."""
    n = min(len(impressions), len(labels))
    ids = np.array([i.event_id for i in impressions[:n]], dtype=str)
    tag = [tags.get(str(e), (NO_ARM, False, math.nan)) for e in ids]
    cut = n if drift_index is None else min(n, drift_index)
    return Served(
        impression_id=ids,
        user=np.array([i.user_id for i in impressions[:n]], dtype=str),
        request=np.array([i.request_id for i in impressions[:n]], dtype=str),
        price=np.array([i.price for i in impressions[:n]], dtype=np.float64),
        clicked=np.asarray(labels[:n], dtype=np.float64),
        after=np.arange(n) >= cut,
        arm=np.array([t[0] for t in tag], dtype=str),
        explored=np.array([t[1] for t in tag], dtype=bool),
        propensity=np.array([t[2] for t in tag], dtype=np.float64),
        pctr=np.array([math.nan if i.pctr is None else i.pctr for i in impressions[:n]], dtype=np.float64),
        oracle=None if oracle is None else np.asarray(oracle[:n], dtype=np.float64),
        slot=np.array([i.slot for i in impressions[:n]], dtype=str),
        position=np.array([i.position for i in impressions[:n]], dtype=np.int64),
        season=None if world is None else season_of(world, [i.ad_id for i in impressions[:n]]),
    )


def pool(parts: Sequence[Served]) -> Served:
    """Several runs as one: users (and requests) of run k prefixed `k:`, so users of different
    runs stay different units."""
    if not parts:
        raise EstimationError("nothing to pool: no run")

    def cat(name: str) -> Any:
        return np.concatenate([getattr(p, name) for p in parts])

    def prefixed(name: str) -> STR:
        return np.concatenate([np.char.add(f"{k}:", getattr(p, name)) for k, p in enumerate(parts)])

    pctr = None if any(p.pctr is None for p in parts) else cat("pctr")
    oracle = (  # nan for a run without one: expected-click figures use the runs that have it
        None
        if all(p.oracle is None for p in parts)
        else np.concatenate([np.full(p.n, math.nan) if p.oracle is None else p.oracle for p in parts])
    )
    slot = None if any(p.slot is None for p in parts) else cat("slot")
    position = None if any(p.position is None for p in parts) else cat("position")
    season = None if any(p.season is None for p in parts) else cat("season")
    return Served(cat("impression_id"), prefixed("user"), prefixed("request"), cat("price"), cat("clicked"),
                  cat("after"), cat("arm"), cat("explored"), cat("propensity"), pctr, oracle, slot,
                  position, season)  # fmt: skip


def arm_data(served: Served, mask: NDArray[np.bool_] | None = None) -> dict[str, ArmData]:
    """Per arm (impressions without an arm left out): per-user requests, impressions, clicks and
    revenue (the price of clicked impressions) of the impressions in `mask`."""
    keep = served.arm != NO_ARM
    if mask is not None:
        keep &= mask
    out: dict[str, ArmData] = {}
    for arm in sorted(set(served.arm[keep].tolist())):
        m = keep & (served.arm == arm)
        users, inverse = np.unique(served.user[m], return_inverse=True)
        k = users.shape[0]
        pairs = np.unique(np.char.add(np.char.add(served.user[m], "\x1f"), served.request[m]))
        req_users = np.array([p.split("\x1f", 1)[0] for p in pairs.tolist()], dtype=str)
        requests = np.bincount(np.searchsorted(users, req_users), minlength=k)
        clicks = served.clicked[m]
        out[arm] = ArmData.of(
            arm,
            requests,
            np.bincount(inverse, minlength=k),
            np.bincount(inverse, weights=clicks, minlength=k),
            np.bincount(inverse, weights=clicks * served.price[m], minlength=k),
        )
    return out


def lift_entry(
    arms: Mapping[str, ArmData],
    arm: str,
    baseline: str,
    metric: str = "ctr",
    *,
    n_boot: int = 2000,
    seed: int = 0,
) -> dict[str, Any]:
    """`{mean, ci_low, ci_high, users}` of arm's relative lift over baseline (bootstrap over users),
    or `{error}` saying why there is none (an arm without traffic, a baseline without clicks)."""
    for name in (arm, baseline):
        if name not in arms:
            return {"error": f"arm {name!r} has no traffic in the range"}
    try:
        est = lift(arms[arm], arms[baseline], metric, "bootstrap", n_boot=n_boot, seed=seed).estimate
    except EstimationError as exc:
        return {"error": str(exc)}
    return {"mean": est.value, "ci_low": est.ci_low, "ci_high": est.ci_high, "users": est.n}


def paired_auc_diff(
    online: F64,
    base: F64,
    labels: F64,
    users: STR,
    strata: NDArray[np.int64] | None = None,
    *,
    n_boot: int = 1000,
    seed: int = 0,
    alpha: float = 0.05,
) -> dict[str, Any]:
    """AUC(online) − AUC(base) on the same examples, averaged over strata weighted by examples,
    with a percentile interval from resampling users (within each stratum) with both scores.

    >>> y = np.array([0, 1, 0, 1, 0, 1.0])
    >>> d = paired_auc_diff(y, 1 - y, y, np.array(list("abcdef")), n_boot=50)
    >>> d["mean"], d["online"], d["frozen"]
    (1.0, 1.0, 0.0)
    """
    online, base, labels = (np.asarray(a, dtype=np.float64) for a in (online, base, labels))
    strata = np.zeros(labels.shape[0], dtype=np.int64) if strata is None else np.asarray(strata)
    groups = []  # per stratum: rows of each user
    for s in np.unique(strata):
        rows = np.flatnonzero(strata == s)
        uniq, inv = np.unique(users[rows], return_inverse=True)
        order = np.argsort(inv, kind="stable")
        bounds = np.cumsum(np.bincount(inv, minlength=uniq.shape[0]))[:-1]
        groups.append(np.split(rows[order], bounds))

    def figure(index_sets: list[NDArray[np.int64]]) -> tuple[float, float, float]:
        diffs, ons, offs, weights = [], [], [], []
        for idx in index_sets:
            a_on, a_off = auc(online[idx], labels[idx]), auc(base[idx], labels[idx])
            if math.isfinite(a_on) and math.isfinite(a_off):
                diffs.append(a_on - a_off)
                ons.append(a_on)
                offs.append(a_off)
                weights.append(idx.shape[0])
        if not weights:
            return math.nan, math.nan, math.nan
        w = np.asarray(weights, dtype=np.float64)
        return (float(np.average(diffs, weights=w)), float(np.average(ons, weights=w)),
                float(np.average(offs, weights=w)))  # fmt: skip

    point, a_on, a_off = figure([np.concatenate(g) for g in groups])
    if not math.isfinite(point):
        raise EstimationError(f"online vs frozen AUC: {labels.shape[0]} examples have only one class")
    rng = np.random.default_rng(seed)
    boots = np.empty(n_boot)
    for b in range(n_boot):
        sets = [np.concatenate([g[i] for i in rng.integers(0, len(g), len(g))]) for g in groups]
        boots[b] = figure(sets)[0]
    boots = boots[np.isfinite(boots)]
    lo, hi = np.quantile(boots, [alpha / 2, 1 - alpha / 2]) if boots.size else (math.nan, math.nan)
    return {"mean": point, "ci_low": float(lo), "ci_high": float(hi), "online": a_on, "frozen": a_off,
            "examples": int(labels.shape[0]), "users": int(sum(len(g) for g in groups))}  # fmt: skip


def adapter_shift(run: Run) -> dict[str, Any]:
    """How far the adapters moved the base on served impressions: online − frozen logit (mean, sd)
    and mean predicted vs observed CTR, before and after the drift. A calibrating adapter moves
    the mean; one that diverges has an sd of logits, not hundredths."""
    out: dict[str, Any] = {}
    for phase, mask in (("before", ~run.served.after), ("after", run.served.after)):
        m = mask & np.isfinite(run.online) & np.isfinite(run.base)
        if not m.any():
            continue
        on, off = (np.clip(a[m], 1e-6, 1 - 1e-6) for a in (run.online, run.base))
        shift = np.log(on / (1 - on)) - np.log(off / (1 - off))
        out[phase] = {"mean": float(shift.mean()), "sd": float(shift.std()), "online_pctr": float(on.mean()),
                      "frozen_pctr": float(off.mean()), "ctr": float(run.served.clicked[m].mean()),
                      "examples": int(m.sum())}  # fmt: skip
    return out


def season_figures(run: Run) -> dict[str, Any]:
    """What the loop learned of the drift, by the season of the served ad's category (simulator
    only, `Served.season`): per phase, the adapters' mean logit shift (online − frozen) on the new
    season's and the old season's categories, each less the shift on the other categories (the
    part that can reorder a request's ads; the truth moves the two seasons by ± the market's
    `trend_delta` at the drift), and per arm the share of impressions in each season with their
    mean true click probability."""
    s = run.served
    assert s.season is not None
    out: dict[str, Any] = {}
    names = {1: "new_season", -1: "old_season", 0: "other"}
    scored = np.isfinite(run.online) & np.isfinite(run.base)
    shift = _logit(np.where(scored, run.online, 0.5)) - _logit(np.where(scored, run.base, 0.5))
    for phase, mask in (("before", ~s.after), ("after", s.after)):
        entry: dict[str, Any] = {}
        means = {}
        for code, name in names.items():
            m = mask & scored & (s.season == code)
            means[name] = float(shift[m].mean()) if m.any() else math.nan
        entry["adapter_shift"] = means
        entry["adapter_shift_over_other"] = {
            k: means[k] - means["other"] for k in ("new_season", "old_season")
        }
        arms: dict[str, Any] = {}
        for arm in sorted(set(s.arm[mask].tolist())):
            ma = mask & (s.arm == arm)
            total = int(ma.sum())
            row: dict[str, Any] = {"impressions": total}
            for code, name in names.items():
                k = ma & (s.season == code)
                row[f"{name}_share"] = float(k.sum() / total) if total else math.nan
                if s.oracle is not None:
                    row[f"{name}_true_ctr"] = float(s.oracle[k].mean()) if k.any() else math.nan
            arms[arm or "untagged"] = row
        entry["arms"] = arms
        out[phase] = entry
    return out


def resets_per_adapter_hour(resets: int, adapters: int, seconds: float) -> float:
    """Guard resets per adapter per hour of loop.

    >>> resets_per_adapter_hour(3, 3, 1800.0)
    2.0
    """
    if adapters <= 0 or seconds <= 0 or resets < 0:
        raise EstimationError(f"reset rate: needs adapters > 0 and seconds > 0 (got {adapters}, {seconds})")
    return resets / adapters / (seconds / 3600.0)


def exploration_cost(clicked: F64, explored: NDArray[np.bool_], alpha: float = 0.05) -> dict[str, Any]:
    """CTR of explored vs greedy impressions and the relative cost 1 − explored/greedy (Katz's log
    interval of a ratio of two proportions), the share explored, and what it costs overall
    (share × cost: the CTR lost against serving every slot greedily).

    >>> c = exploration_cost(np.array([1, 0, 0, 0, 1, 1, 0, 0.0]), np.array([1, 1, 1, 1, 0, 0, 0, 0], bool))
    >>> c["explored_ctr"], c["greedy_ctr"], c["relative_cost"]["mean"], c["explored_share"]
    (0.25, 0.5, 0.5, 0.5)
    """
    ne, ng = int(explored.sum()), int((~explored).sum())
    if ne == 0 or ng == 0:
        return {
            "error": f"no {'explored' if ne == 0 else 'greedy'} impressions",
            "explored": ne,
            "greedy": ng,
        }
    ce, cg = float(clicked[explored].sum()), float(clicked[~explored].sum())
    pe, pg = ce / ne, cg / ng
    out: dict[str, Any] = {"explored_ctr": pe, "greedy_ctr": pg, "explored": ne, "greedy": ng,
                           "explored_share": ne / (ne + ng)}  # fmt: skip
    if pg == 0 or pe == 0:
        out["relative_cost"] = {
            "mean": 1.0 - pe / pg if pg else math.nan,
            "ci_low": math.nan,
            "ci_high": math.nan,
        }
        return out
    se = math.sqrt(1 / ce - 1 / ne + 1 / cg - 1 / ng)
    z = z_value(alpha)
    ratio = pe / pg
    out["relative_cost"] = {"mean": 1.0 - ratio, "ci_low": 1.0 - ratio * math.exp(z * se),
                            "ci_high": 1.0 - ratio * math.exp(-z * se)}  # fmt: skip
    out["overall_ctr_cost"] = out["explored_share"] * (1.0 - ratio)
    return out


@dataclass(frozen=True)
class Scores:
    """Online and frozen score of each impression the trainer scored (its first, pre-learning score)."""

    impression_id: STR
    adapter: STR
    online: F64
    base: F64
    resets: dict[str, int]


def read_scores(path: Path) -> Scores:
    """The trainer's `--score-log` file: the first row of each impression (later rows are its
    click's positive duplicate, scored after the fake negative was learned)."""
    body = json.loads(path.read_text())
    ids = np.asarray(body["impression_ids"], dtype=str)
    _, first = np.unique(ids, return_index=True)
    first.sort()
    return Scores(
        ids[first],
        np.asarray(body["adapters"], dtype=str)[first],
        np.asarray(body["online"], dtype=np.float64)[first],
        np.asarray(body["base"], dtype=np.float64)[first],
        dict(body.get("resets", {})),
    )


def join_scores(served: Served, scores: Scores) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Index pairs (into served, into scores) of the impressions both hold."""
    _, s_idx, c_idx = np.intersect1d(served.impression_id, scores.impression_id, return_indices=True)
    order = np.argsort(s_idx)
    return s_idx[order], c_idx[order]


def scores_on(served: Served, scores: Scores) -> tuple[F64, F64]:
    """Online and frozen score per served impression (nan where the trainer scored none)."""
    online, base = np.full(served.n, math.nan), np.full(served.n, math.nan)
    s_idx, c_idx = join_scores(served, scores)
    online[s_idx], base[s_idx] = scores.online[c_idx], scores.base[c_idx]
    return online, base


@dataclass(frozen=True)
class Run:
    """One loop's arrays, and what its figures are computed from."""

    served: Served
    online: F64  # per served impression, nan where not scored
    base: F64
    resets: int
    adapters: int
    seconds: float
    pre: PreCounts | None = None  # each user's history before the loop: the CUPED covariate
    shadow: Shadow | None = None  # the learning arm's shadow slates (`ab.shadow_slates`)


@dataclass(frozen=True)
class Shadow:
    """Per learning-arm request served with adapters, the expected clicks (the simulator's truth)
    of what it was served and of its shadow slate, what serving would have served without the
    adapters (`workloads.closed_loop.ShadowSlate`): one entry per request."""

    user: STR
    after: NDArray[np.bool_]  # served after the drift
    served: F64
    shadow: F64
    same: NDArray[np.bool_]  # both slates the same ads in the same order

    @property
    def n(self) -> int:
        return int(self.served.shape[0])


def shadow_of(pairs: Sequence[Any], drift_index: int | None) -> Shadow | None:
    """The closed loop's shadow pairs (`ClosedLoopReport.shadows`) as arrays; a pair whose
    request was served from the drift's impression on is after it (None: no pairs)."""
    if not pairs:
        return None
    cut = math.inf if drift_index is None else drift_index
    return Shadow(
        user=np.array([p.user_id for p in pairs], dtype=str),
        after=np.array([p.served_index >= cut for p in pairs], dtype=bool),
        served=np.array([p.served for p in pairs], dtype=np.float64),
        shadow=np.array([p.shadow for p in pairs], dtype=np.float64),
        same=np.array([p.same for p in pairs], dtype=bool),
    )


def shadow_figures(shadow: Shadow, *, n_boot: int, seed: int) -> dict[str, Any]:
    """What the adapters add on the very requests they served, per phase (`before`, `after`):
    the expected clicks of the served slates over those of their shadow slates (the same
    request ranked without adapters, exploration's draw included: the correction-only arm's
    policy on the same user at the same moment) − 1, users resampled with both totals
    (`attribution.ab.paired_lift`); with the requests, the share whose slates differ and the mean
    expected clicks per request each way.

    `adapter_lift_<phase>_shadow` (`summarize`) is the lift, in the form of the other lifts."""
    out: dict[str, Any] = {}
    for phase, mask in (("before", ~shadow.after), ("after", shadow.after)):
        idx = np.flatnonzero(mask)
        if idx.size == 0:
            out[phase] = {"error": f"no shadow slate {phase} the drift"}
            continue
        users, inv = np.unique(shadow.user[idx], return_inverse=True)
        served = np.bincount(inv, weights=shadow.served[idx], minlength=users.size)
        counter = np.bincount(inv, weights=shadow.shadow[idx], minlength=users.size)
        try:
            est = paired_lift(served, counter, n_boot=n_boot, seed=seed)
        except EstimationError as exc:
            out[phase] = {"error": str(exc)}
            continue
        out[phase] = {
            "mean": est.value, "ci_low": est.ci_low, "ci_high": est.ci_high, "users": est.n,
            "requests": int(idx.size), "differ_share": float((~shadow.same[idx]).mean()),
            "served_per_request": float(shadow.served[idx].mean()),
            "shadow_per_request": float(shadow.shadow[idx].mean()),
        }  # fmt: skip
    return out


@dataclass(frozen=True)
class PreCounts:
    """Impressions and clicks per user before the loop (the history the base was trained on,
    simulated open-loop: no arm served it, so it is a pre-treatment covariate)."""

    user: STR
    impressions: F64
    clicks: F64


def read_history(path: Path) -> PreCounts:
    """Per-user impressions and clicks of a demo's `history.jsonl` (one JSON event per line)."""
    imps: dict[str, int] = {}
    clicks: dict[str, int] = {}
    with path.open("rb") as fh:
        for line in fh:
            event = json.loads(line)
            kind = event.get("kind")
            if kind == "impression":
                imps[event["user_id"]] = imps.get(event["user_id"], 0) + 1
            elif kind == "click":
                clicks[event["user_id"]] = clicks.get(event["user_id"], 0) + 1
    users = sorted(imps)
    return PreCounts(np.array(users, dtype=str), np.array([imps[u] for u in users], dtype=np.float64),
                     np.array([min(clicks.get(u, 0), imps[u]) for u in users], dtype=np.float64))  # fmt: skip


def save_run(run: Run, path: Path) -> None:
    """A run's arrays as one `.npz` (offline analysis: `load_run`)."""
    s = run.served
    arrays = {f"served_{k}": getattr(s, k) for k in Served.__dataclass_fields__ if getattr(s, k) is not None}
    if run.pre is not None:
        arrays |= {
            "pre_user": run.pre.user,
            "pre_impressions": run.pre.impressions,
            "pre_clicks": run.pre.clicks,
        }
    if run.shadow is not None:
        arrays |= {f"shadow_{k}": getattr(run.shadow, k) for k in Shadow.__dataclass_fields__}
    meta = np.array([run.resets, run.adapters, run.seconds], dtype=np.float64)
    np.savez_compressed(path, online=run.online, base=run.base, meta=meta, **arrays)


def load_run(path: Path) -> Run:
    """A run saved by `save_run`."""
    z = np.load(path)
    served = Served(**{k: z[f"served_{k}"] for k in Served.__dataclass_fields__ if f"served_{k}" in z})
    pre = PreCounts(z["pre_user"], z["pre_impressions"], z["pre_clicks"]) if "pre_user" in z else None
    fields = Shadow.__dataclass_fields__
    shadow = Shadow(**{k: z[f"shadow_{k}"] for k in fields}) if "shadow_user" in z else None
    resets, adapters, seconds = z["meta"].tolist()
    return Run(served, z["online"], z["base"], int(resets), int(adapters), float(seconds), pre, shadow)


def pool_runs(runs: Sequence[Run]) -> tuple[Run, NDArray[np.int64]]:
    """Runs as one (users kept apart per run), and each impression's run index (the strata)."""
    strata = np.concatenate([np.full(r.served.n, k, dtype=np.int64) for k, r in enumerate(runs)])
    pre = None
    if runs and all(r.pre is not None for r in runs):
        parts = [r.pre for r in runs if r.pre is not None]
        pre = PreCounts(np.concatenate([np.char.add(f"{k}:", p.user) for k, p in enumerate(parts)]),
                        np.concatenate([p.impressions for p in parts]),
                        np.concatenate([p.clicks for p in parts]))  # fmt: skip
    shadows = [(k, r.shadow) for k, r in enumerate(runs) if r.shadow is not None]
    shadow = None
    if shadows:  # the runs that have shadow slates, their users kept apart as in `pool`
        shadow = Shadow(np.concatenate([np.char.add(f"{k}:", sh.user) for k, sh in shadows]),
                        *(np.concatenate([getattr(sh, f) for _, sh in shadows])
                          for f in ("after", "served", "shadow", "same")))  # fmt: skip
    pooled = Run(pool([r.served for r in runs]), np.concatenate([r.online for r in runs]),
                 np.concatenate([r.base for r in runs]), sum(r.resets for r in runs),
                 sum(r.adapters for r in runs), float(np.mean([r.seconds for r in runs])), pre,
                 shadow)  # fmt: skip
    return pooled, strata


def _logit(p: F64) -> F64:
    q = np.clip(p, 1e-6, 1 - 1e-6)
    out: F64 = np.log(q / (1 - q))
    return out


def arm_users(served: Served, mask: NDArray[np.bool_] | None = None) -> dict[str, STR]:
    """Per arm, its users in `arm_data`'s row order (sorted ids) over the impressions in `mask`."""
    keep = served.arm != NO_ARM
    if mask is not None:
        keep &= mask
    return {
        arm: np.unique(served.user[keep & (served.arm == arm)])
        for arm in sorted(set(served.arm[keep].tolist()))
    }


def history_rows(users: STR, arm: str, pre: PreCounts) -> ArmData:
    """The history's impressions and clicks of `users` (zeros for a user without history)."""
    index = {u: k for k, u in enumerate(pre.user.tolist())}
    rows = np.array([index.get(u, -1) for u in users.tolist()], dtype=np.int64)
    has = rows >= 0
    imps = np.where(has, pre.impressions[np.maximum(rows, 0)], 0.0)
    clicks = np.where(has, pre.clicks[np.maximum(rows, 0)], 0.0)
    return ArmData.of(arm, imps, imps, clicks, np.zeros(users.shape[0]))


def period_rows(users: STR, arm: str, data: Mapping[str, ArmData], data_users: Mapping[str, STR]) -> ArmData:
    """`data`'s rows of `users` in arm `arm` (another period of the same arm; zeros where absent)."""
    z = np.zeros(users.shape[0])
    if arm not in data:
        return ArmData.of(arm, z, z, z, z)
    index = {u: k for k, u in enumerate(data_users[arm].tolist())}
    rows = np.array([index.get(u, -1) for u in users.tolist()], dtype=np.int64)
    has = rows >= 0
    cols = [np.where(has, data[arm].column(c)[np.maximum(rows, 0)], 0.0) for c in ("requests", "impressions",
            "clicks", "revenue")]  # fmt: skip
    return ArmData.of(arm, *cols)


def cuped_entry(arms: Mapping[str, ArmData], pre: Mapping[str, ArmData], arm: str, baseline: str,
                covariate: str,
                *, n_boot: int, seed: int) -> dict[str, Any]:  # fmt: skip
    """`lift_entry` of the CTR, CUPED-adjusted by `pre` (the same users' rows in a pre-period),
    with θ, the variance ratio (adjusted / raw) and which covariate it was."""
    for name in (arm, baseline):
        if name not in arms:
            return {"error": f"arm {name!r} has no traffic in the range"}
    try:
        c = cuped_lift(arms[arm], arms[baseline], (pre[arm], pre[baseline]), "ctr", n_boot=n_boot, seed=seed)
    except EstimationError as exc:
        return {"error": str(exc)}
    est = c.lift.estimate
    return {"mean": est.value, "ci_low": est.ci_low, "ci_high": est.ci_high, "users": est.n,
            "theta": c.theta, "variance_ratio": c.variance_ratio, "covariate": covariate}  # fmt: skip


def expected_served(served: Served) -> Served | None:
    """The impressions with each click replaced by its true probability (the simulator's oracle):
    the same policies' expected clicks, without the coin flip's noise (None without an oracle)."""
    if served.oracle is None:
        return None
    return dataclasses.replace(served, clicked=served.oracle)


def variance_reduced(run: Run, *, n_boot: int, seed: int) -> dict[str, Any]:
    """The CTR lifts CUPED-adjusted by each user's history CTR (pre-treatment: the history was
    simulated open-loop, before any arm served), by their pre-drift CTR in the loop (for the
    after-drift lifts; the arms already differed then, so it removes any effect they had before
    the drift too), and on the oracle's expected clicks (simulator only)."""
    s = run.served
    out: dict[str, Any] = {}
    pairs = {"ctr_lift": ("learning", "control"), "adapter_lift": ("learning", "correction")}
    before, after = arm_data(s, ~s.after), arm_data(s, s.after)
    u_before, u_after = arm_users(s, ~s.after), arm_users(s, s.after)
    for phase, arms, users in (("before", before, u_before), ("after", after, u_after)):
        if run.pre is not None:
            hist = {a: history_rows(users[a], a, run.pre) for a in arms}
            for name, (a, b) in pairs.items():
                out[f"{name}_{phase}_cuped"] = cuped_entry(
                    arms, hist, a, b, "history CTR", n_boot=n_boot, seed=seed
                )
    pre_drift = {a: period_rows(u_after[a], a, before, u_before) for a in after}
    for name, (a, b) in pairs.items():
        why = "pre-drift CTR (post-treatment)"
        out[f"{name}_after_cuped_predrift"] = cuped_entry(after, pre_drift, a, b, why,
                                                          n_boot=n_boot, seed=seed)  # fmt: skip
    exp = expected_served(s)
    if exp is not None:
        known = np.isfinite(exp.clicked)
        exp = dataclasses.replace(exp, clicked=np.nan_to_num(exp.clicked))
        for phase, mask in (("before", ~exp.after & known), ("after", exp.after & known)):
            arms = arm_data(exp, mask)
            for name, (a, b) in pairs.items():
                out[f"{name}_{phase}_expected"] = lift_entry(arms, a, b, n_boot=n_boot, seed=seed)
    return out


def position_gap(run: Run) -> tuple[dict[str, float], dict[str, Any]]:
    """Serving scores every candidate as if at position 0 (`serving.ranking.build_input`) and logs
    that pctr; the trainer scores the example at its real position. In the control arm (base
    alone on both sides) the gap served − trainer's base logit per slot and position is that
    difference (plus the serve/join feature skew: its sd). Also, per slot and position, the logged
    pctr against the CTR: what the worker's correction, whose step is lr·(click − logged pctr),
    sees as the base's error at that position."""
    s = run.served
    if s.pctr is None or s.slot is None or s.position is None:
        return {}, {}
    key = np.char.add(np.char.add(s.slot, ":"), s.position.astype(str))
    ctl = (s.arm == "control") & np.isfinite(run.base) & np.isfinite(s.pctr)
    gaps: dict[str, float] = {}
    table: dict[str, Any] = {}
    for k in sorted(set(key[ctl].tolist())):
        m = ctl & (key == k)
        g = _logit(s.pctr[m]) - _logit(run.base[m])
        gaps[k] = float(g.mean())
        table[k] = {"n": int(m.sum()), "served_minus_base_logit": gaps[k], "sd": float(g.std()),
                    "logged_pctr": float(s.pctr[m].mean()), "ctr": float(s.clicked[m].mean())}  # fmt: skip
    return gaps, table


def decompose(run: Run) -> dict[str, Any]:
    """What each part contributes on the same served impressions, per phase: logits of the frozen
    base (trainer's), + correction, + adapters (trainer's online), + both. The correction is not
    logged; it is read off the served pctr: served logit − trainer's online logit in the learning
    arm (the adapter a few seconds newer than the one served), − base logit in the correction arm,
    each less the control arm's gap at the impression's slot and position (`position_gap`).
    AUC over all impressions and per user (GAUC: impression-weighted mean of each user's AUC, how
    a user's ads are ordered, which is what the arms' CTR depends on), calibration (mean predicted
    vs CTR), and the correlation of the adapter's and the correction's logit shifts (the
    correction, learned on the served score, undoing the adapter's move reads as a negative one)."""
    s = run.served
    if s.pctr is None:
        return {"error": "no served pctr"}
    gaps, table = position_gap(run)
    out: dict[str, Any] = {"control_gap_by_slot_position": table}
    gap = np.zeros(s.n)
    if gaps and s.slot is not None and s.position is not None:
        key = np.char.add(np.char.add(s.slot, ":"), s.position.astype(str))
        fallback = float(np.mean(list(gaps.values())))
        gap = np.array([gaps.get(k, fallback) for k in key.tolist()])
    ok = np.isfinite(run.online) & np.isfinite(run.base) & np.isfinite(s.pctr)
    served_l, online_l, base_l = _logit(s.pctr) - gap, _logit(run.online), _logit(run.base)
    for phase, mask in (("before", ~s.after), ("after", s.after)):
        ph: dict[str, Any] = {}
        for arm in ("learning", "correction"):
            m = ok & mask & (s.arm == arm)
            if m.sum() < 50:
                continue
            corr = served_l[m] - (online_l[m] if arm == "learning" else base_l[m])
            adapter = online_l[m] - base_l[m]
            y = s.clicked[m]
            models = {"frozen": base_l[m], "frozen+correction": base_l[m] + corr,
                      "frozen+adapters": online_l[m], "full": online_l[m] + corr}  # fmt: skip
            if s.oracle is not None and np.isfinite(s.oracle[m]).all():
                models["oracle"] = _logit(s.oracle[m])
            entry: dict[str, Any] = {"impressions": int(m.sum()), "ctr": float(y.mean())}
            for name, logit in models.items():
                entry[name] = {"auc": float(auc(logit, y)), "gauc": _gauc(logit, y, s.user[m]),
                               "mean_pctr": float((1 / (1 + np.exp(-logit))).mean())}  # fmt: skip
            entry["correction"] = {"mean": float(corr.mean()), "sd": float(corr.std())}
            entry["adapter"] = {"mean": float(adapter.mean()), "sd": float(adapter.std())}
            if corr.std() > 0 and adapter.std() > 0:
                entry["corr_adapter_correction"] = float(np.corrcoef(adapter, corr)[0, 1])
            ph[arm] = entry
        out[phase] = ph
    return out


def _gauc(score: F64, y: F64, users: STR) -> float:
    """Impression-weighted mean over users (with both classes) of each user's AUC."""
    order = np.argsort(users, kind="stable")
    _, start = np.unique(users[order], return_index=True)
    total, weight = 0.0, 0
    for idx in np.split(order, start[1:]):
        a = auc(score[idx], y[idx])
        if math.isfinite(a):
            total += a * idx.shape[0]
            weight += idx.shape[0]
    return total / weight if weight else math.nan


def summarize(
    run: Run, strata: NDArray[np.int64] | None = None, *, n_boot: int = 1000, seed: int = 0
) -> dict[str, Any]:
    """Every figure of a run (or of pooled runs, with their strata): lifts before/after the
    drift, online − frozen AUC (paired), resets per adapter-hour and exploration's cost."""
    s = run.served
    before, after = arm_data(s, ~s.after), arm_data(s, s.after)
    out: dict[str, Any] = {
        "impressions": s.n,
        "arms": {a: int((s.arm == a).sum()) for a in sorted(set(s.arm.tolist()))},
        "ctr_lift_before": lift_entry(before, "learning", "control", n_boot=n_boot, seed=seed),
        "ctr_lift_after": lift_entry(after, "learning", "control", n_boot=n_boot, seed=seed),
        "revenue_lift_after": lift_entry(
            after, "learning", "control", "revenue_per_request", n_boot=n_boot, seed=seed
        ),
        "adapter_lift_after": lift_entry(after, "learning", "correction", n_boot=n_boot, seed=seed),
    }
    for phase, mask in (("before", ~s.after), ("after", s.after)):
        m = mask & np.isfinite(run.online) & np.isfinite(run.base)
        try:
            out[f"auc_online_minus_frozen_{phase}"] = paired_auc_diff(
                run.online[m], run.base[m], s.clicked[m], s.user[m], None if strata is None else strata[m],
                n_boot=n_boot, seed=seed,
            )  # fmt: skip
        except EstimationError as exc:
            out[f"auc_online_minus_frozen_{phase}"] = {"error": str(exc)}
    out["adapter_shift"] = adapter_shift(run)
    if run.shadow is not None:
        shadow = shadow_figures(run.shadow, n_boot=n_boot, seed=seed)
        out |= {f"adapter_lift_{phase}_shadow": shadow[phase] for phase in ("before", "after")}
    if s.season is not None:
        out["season"] = season_figures(run)
    out |= variance_reduced(run, n_boot=n_boot, seed=seed)
    out["decomposition"] = decompose(run)
    out["resets"] = run.resets
    out["resets_per_adapter_hour"] = (
        resets_per_adapter_hour(run.resets, run.adapters, run.seconds) if run.adapters else None
    )
    tagged = s.arm != NO_ARM
    out["exploration_ctr_cost"] = (
        exploration_cost(s.clicked[tagged], s.explored[tagged]) if tagged.any()
        else {"error": "no impression carries serving's exploration flag"}
    )  # fmt: skip
    return out


TAGS_SQL = """
SELECT event_id, toString(assumeNotNull(ab_arm)), toUInt8(ifNull(explored, 0)),
       toFloat64(ifNull(propensity, nan))
FROM impressions FINAL
WHERE ts >= toDateTime(%(since)s)
"""


def read_tags(
    settings: Any, since: int, expect: int, timeout_s: float = 60.0
) -> tuple[dict[str, tuple[str, bool, float]], str | None]:
    """Serving's tags of the impressions since `since` (epoch s) from ClickHouse, waiting up to
    `timeout_s` for `expect` of them; ({}, why) when the table has no such columns."""
    import time

    from clickhouse_driver.errors import ServerException

    from schemas.clients import clickhouse_client, clickhouse_database

    client = clickhouse_client(settings, clickhouse_database(settings))
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                rows = client.execute(TAGS_SQL, {"since": since})
            except ServerException as exc:
                return {}, f"impressions carry no arm/exploration tags here: {str(exc).splitlines()[0]}"
            if len(rows) >= expect or time.monotonic() > deadline:
                return {str(r[0]): (str(r[1]), bool(r[2]), float(r[3])) for r in rows}, None
            time.sleep(2)
    finally:
        client.disconnect()


def loop_run(run: Any) -> tuple[Run, str | None]:
    """The arrays of a finished `deploy.demo.LoopRun` (ClickHouse read for serving's tags)."""
    oracle, labels = run.market.outcomes()
    imps = run.loop.impressions
    since = int(imps[0].ts.timestamp()) - 1 if imps else 0
    tags, why = read_tags(run.demo.settings, since, int(0.98 * len(imps)))
    served = served_of(
        imps, labels, run.market.drift_impression, tags, oracle, getattr(run.market, "world", None)
    )
    if run.score_log.exists():
        scores = read_scores(run.score_log)
        online, base = scores_on(served, scores)
        resets, adapters = sum(scores.resets.values()), len(set(scores.adapter.tolist()))
    else:
        online, base = np.full(served.n, math.nan), np.full(served.n, math.nan)
        resets, adapters = 0, 0
        why = (why + "; " if why else "") + f"no trainer score log at {run.score_log}"
    history = run.demo.dir / "history.jsonl"
    pre = read_history(history) if history.exists() else None
    shadow = shadow_of(run.loop.shadows, run.market.drift_impression)
    return Run(served, online, base, resets, adapters, run.loop_s, pre, shadow), why


def loop_figures(run: Any) -> dict[str, Any]:
    """The live figures of one demo run (see `summarize`), with any reason a figure is missing."""
    arrays, why = loop_run(run)
    out = summarize(arrays) | {"curves": auc_curves(arrays)}
    if why:
        out["note"] = why
    return out


def auc_curves(run: Run, window: int = 1500, step: int = 500) -> list[dict[str, float]]:
    """Online and frozen AUC over sliding windows of `window` scored impressions (serving order),
    each with its Hanley–McNeil 95 % band: a curve that moves less than its band did not move."""
    from serving.canary import auc_standard_error

    idx = np.flatnonzero(np.isfinite(run.online) & np.isfinite(run.base))
    z = z_value(0.05)
    out = []
    ends = list(range(min(window, idx.shape[0]), idx.shape[0] + 1, step))
    if ends and ends[-1] != idx.shape[0]:  # the last window ends at the last impression
        ends.append(idx.shape[0])
    for end in ends:
        rows = idx[max(0, end - window) : end]
        y = run.served.clicked[rows]
        pos = int(y.sum())
        point = {"end": float(rows[-1]), "after_drift": float(run.served.after[rows[-1]])}
        for name, scores in (("online", run.online[rows]), ("frozen", run.base[rows])):
            a = auc(scores, y)
            half = z * auc_standard_error(a, pos, rows.shape[0] - pos) if math.isfinite(a) else math.nan
            point |= {name: a, f"{name}_lo": a - half, f"{name}_hi": a + half}
        out.append(point)
    return out
