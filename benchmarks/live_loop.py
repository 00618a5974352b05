"""Benchmark: the live loop (worker, trainer, Serve app through Kafka) judged by A/B arms and paired AUC.

Each seed runs `adstream demo`'s loop (`deploy.demo.run_loop`: history → offline base → the three
processes → the closed-loop simulator with a drift half-way), once on the machine as it is
("quiet") and once with one core kept busy by a CPU hog this benchmark starts and stops
("loaded"). Figures per seed and pooled over seeds (users of different seeds are different
units; `deploy.live_figures`):

- `ctr_lift_before` / `ctr_lift_after`: relative CTR lift of the learning arm over the frozen
  control arm, before / after the drift, bootstrap over users; `revenue_lift_after` likewise;
- `adapter_lift_after`: learning arm over the correction-only arm (what the LoRA adds);
- `auc_online_minus_frozen_after`: the trainer's online and frozen scores of the same served
  impressions (its progressive log) against the simulator's clicks, paired bootstrap over users;
- `resets_per_adapter_hour`: the trainer's guard resets per adapter per hour of loop;
- `exploration_ctr_cost`: CTR of explored vs greedy impressions;
- `ope`: relative error of IPS / SNIPS / DR of a known policy against the simulator's truth
  (`workloads.ope_truth`, `attribution.ope`);
- variance reduction, next to each lift: `*_cuped` (CUPED, `attribution.ab.cuped_lift`, with each
  user's CTR in the history the base was trained on: pre-treatment), `*_cuped_predrift` (the
  user's CTR before the drift: post-treatment, biased by any pre-drift effect) and `*_expected`
  (simulator only: each impression's true click probability in place of its click);
- `season` (simulator): what the adapters learned of the drift, their logit shift on the new and
  the old season's categories over the others', and each arm's share of each season
  (`deploy.live_figures.season_figures`); `--drift-mode` / `--drift-share` change the market's
  drift (the demo's: a handover for half the users);
- `adapter_lift_<phase>_shadow` (simulator; `--no-shadow-slates` leaves it out): what the adapters add on the
  very requests they served, the expected clicks of each learning-arm slate over its shadow
  slate's (the same request ranked without adapters), users resampled with both
  (`deploy.live_figures.shadow_figures`); the arms' users no longer differ, only the slates;
- `decomposition`: on the same served impressions of the learning and correction arms, AUC,
  per-user AUC and calibration of frozen, frozen + correction, frozen + adapters and all of it,
  and how the adapter's and the correction's logit shifts correlate (`deploy.live_figures.decompose`);
- `sizes` (the argument) and `decides_5pct` (per run and figure: half-width, verdict, the seeds
  that would decide).

Each seed's arrays are saved next to its loop (`run.npz`) and a partial result after each seed
(`<out>.<run>.partial.json`); `--combine A.json B.json` summarizes saved runs again with this
code into one result (how the quiet and the loaded run, run apart, become one file).

Arms, exploration flags and propensities are what serving records in each impression
(`ab_arm`, `explored`, `propensity`); where this build's serving records none, the lifts say so.

Usage: `.venv/bin/python -m benchmarks.live_loop [--seeds 1 2 3 4 5] [--requests 6000] [--runs quiet]
[--quick]`; writes `benchmarks/results/live_loop.json`.
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np
from rich.console import Console
from rich.table import Table

from deploy.live_figures import Run, loop_run, pool_runs, save_run, summarize
from deploy.machine import machine, process_cpu_s, write_result
from schemas.errors import StackError
from workloads.config import DRIFT_MODES

OUT = ROOT / "benchmarks" / "results" / "live_loop.json"
QUICK = {"seeds": [1], "requests": 900, "history": 6000, "users": 150, "ads": 120, "n_boot": 200}
SIZES = (
    "Sizes: a lift's 95 % interval over users narrows as 1/sqrt(users); users of different seeds are "
    "independent units, so the pooled half-width h_S of S seeds becomes h_S·sqrt(S/S') with S' seeds. "
    "By the binomial alone a relative CTR lift at p ≈ 0.12 with n impressions per arm has a half-width "
    "of 1.96·sqrt((1−p)/p·2/n): ±5 % needs n ≈ 23 k per arm after the drift; users' clustering (their "
    "CTRs differ and each user's impressions share them) makes the user bootstrap wider than that (the "
    "design effect, measured here as (h_bootstrap / h_binomial)²). One seed of 3,000 requests serves "
    "~5 k impressions after the drift (~1.7 k per arm at 0.3/0.3/0.4), and the 2-core machine, shared, "
    "runs one seed in ~4 min. Variance reduction: CUPED with each user's history CTR (pre-treatment: "
    "the open-loop history the base was trained on) or pre-drift CTR (post-treatment: the arms were "
    "already served; biased by any pre-drift effect) as covariate; and, simulator only, each impression's "
    "true click probability in place of its click (`*_expected`: the same served impressions without the "
    "coin flip). `decides_5pct[run][figure]`: the pooled half-width, whether it is under 5 % "
    "(`decides`), the verdict on the goal (`met`: mean ≥ 5 % and interval above 0; `not_met`: interval "
    "below 5 %; else `undecided`), and the seeds this run's own spread says would be needed for a 5 % "
    "half-width (`seeds_for_5pct`) and for the interval to exclude 0 at the observed mean "
    "(`seeds_to_exclude_0`)."
)
# the loop's processes inherit these (1 keeps torch from spinning threads on an oversubscribed machine)
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# per-seed entries that are the loop's record, not figures (kept when figures are recomputed)
META = ("seed", "loop_s", "dir", "load_avg_1m_start", "load_avg_1m_end", "errors", "cpu_s",
        "trainer_cpu_share", "scored_share", "note")  # fmt: skip
SIZED = ("ctr_lift_after", "adapter_lift_after", "ctr_lift_before")
VARIANTS = ("", "_cuped", "_cuped_predrift", "_expected", "_shadow")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--requests", type=int, default=6000, help="closed-loop requests per seed")
    ap.add_argument("--rate", type=float, default=30.0, help="closed-loop requests per second")
    ap.add_argument("--history", type=int, default=20_000, help="impressions of history (offline base)")
    ap.add_argument("--users", type=int, default=400)
    ap.add_argument("--ads", type=int, default=300)
    ap.add_argument(
        "--drift-mode",
        default="handover",
        choices=DRIFT_MODES,
        help="how the market's tastes change half-way (the demo's: handover)",
    )
    ap.add_argument(
        "--drift-share", type=float, default=0.5, help="share of users whose taste drifts (the demo's 0.5)"
    )
    ap.add_argument("--control-share", type=float, default=0.3, help="users in the frozen control arm")
    ap.add_argument("--correction-share", type=float, default=0.3, help="users in the correction-only arm")
    ap.add_argument(
        "--no-shadow-slates",
        action="store_true",
        help="serving does not also rank each learning-arm request without adapters (the demo's "
        "`ab.shadow_slates`, on by default): no `adapter_lift_<phase>_shadow`, one forward less",
    )
    ap.add_argument("--runs", nargs="+", choices=["quiet", "loaded"], default=["quiet", "loaded"])
    ap.add_argument("--n-boot", type=int, default=1000)
    ap.add_argument("--port", type=int, default=8021)
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="GROUP__FIELD=VALUE",
        help="a setting for the loop's processes (ONLINE__LR=0.001): the investigation's variants",
    )
    ap.add_argument(
        "--step-timeout",
        type=float,
        default=600.0,
        help="seconds each of the loop's steps (the base's training) may take (an oversubscribed "
        "machine needs more than the demo's 600)",
    )
    ap.add_argument("--quick", action="store_true", help="one small seed: a smoke test of the whole path")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="no loop: the runs of these results (each seed's saved arrays, `run.npz`) summarized "
        "again with this code and written as one result (quiet and loaded run apart)",
    )
    ap.add_argument(
        "--merge-pooled",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="no loop: results of runs on disjoint seeds (each pooled already) combined figure by "
        "figure by inverse-variance weights, where their seeds' arrays are gone",
    )
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    for name in ("control_share", "correction_share"):
        if not 0 <= getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)!r} is outside [0, 1)")
    for item in args.overrides:
        if "=" not in item or "__" not in item.split("=", 1)[0]:
            ap.error(f"--set {item!r} is not GROUP__FIELD=VALUE")
    if not 0 <= args.drift_share <= 1:
        ap.error(f"--drift-share {args.drift_share!r} is outside [0, 1]")
    if args.control_share + args.correction_share >= 1:
        ap.error("--control-share + --correction-share must leave users for the learning arm")
    return args


def ab_env(args: argparse.Namespace) -> dict[str, str]:
    """The arms' shares for the loop's processes, when this build's settings have the `ab` group."""
    from schemas.settings import Settings

    env = {f"ADSTREAM_{k.upper()}": v for k, v in (o.split("=", 1) for o in args.overrides)}
    if "ab" not in Settings.model_fields:
        return env
    return env | {
        "ADSTREAM_AB__CONTROL_SHARE": str(args.control_share),
        "ADSTREAM_AB__CORRECTION_SHARE": str(args.correction_share),
        "ADSTREAM_AB__SHADOW_SLATES": "false" if args.no_shadow_slates else "true",
    }


class Hog:
    """One core kept busy by a spinning child process (started and stopped by the benchmark)."""

    def __enter__(self) -> Hog:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu_s = process_cpu_s(self.proc.pid)
        self.wall_s = time.monotonic() - self.t0
        self.proc.kill()
        self.proc.wait()


def one_seed(args: argparse.Namespace, seed: int, say: Any) -> tuple[Run, dict[str, Any]]:
    """One loop of one seed: its arrays and its figures."""
    from deploy.demo import Demo, DemoSpec, run_loop
    from schemas.settings import Settings

    Demo.run.__kwdefaults__ = {"timeout": args.step_timeout}  # the demo's steps: this run's patience
    spec = DemoSpec(users=args.users, ads=args.ads, history=args.history, requests=args.requests,
                    rate=args.rate, seed=seed, port=args.port, drift_mode=args.drift_mode,
                    drift_share=args.drift_share)  # fmt: skip
    m0 = machine()
    loop = run_loop(spec, Settings(), say, live=False, env=ab_env(args), extras=False)
    run, why = loop_run(loop)
    save_run(run, loop.demo.dir / "run.npz")  # every array the figures come from, for re-analysis
    figures = summarize(run, n_boot=args.n_boot, seed=seed)
    figures |= {"seed": seed, "loop_s": round(loop.loop_s, 1), "dir": str(loop.demo.dir),
                "load_avg_1m_start": m0["load_avg_1m"], "load_avg_1m_end": machine()["load_avg_1m"],
                "errors": dict(loop.loop.errors), "cpu_s": loop.cpu_s,
                "trainer_cpu_share": loop.cpu_s.get("trainer", 0.0) / max(loop.loop_s, 1e-9),
                "scored_share": float(np.isfinite(run.online).mean()) if run.served.n else 0.0}  # fmt: skip
    if why:
        figures["note"] = why
    return run, figures


def one_mode(args: argparse.Namespace, mode: str, say: Any) -> dict[str, Any]:
    """Every seed in one machine condition, then the pooled figures."""
    runs, seeds, hog = [], [], None
    failed: list[dict[str, Any]] = []
    t0 = time.monotonic()
    if mode == "loaded":
        hog = Hog().__enter__()
    try:
        for seed in args.seeds:
            say(f"[bold]{mode}: seed {seed}[/]")
            try:
                run, figures = one_seed(args, seed, say)
            except (StackError, subprocess.TimeoutExpired) as exc:  # one seed's loop, not the run
                failed.append({"seed": seed, "error": str(exc).splitlines()[0][:300]})
                say(f"[red]{mode}: seed {seed} failed: {failed[-1]['error']}[/]")
                continue
            runs.append(run)
            seeds.append(figures)
            # each finished seed on disk at once: a cut-short run still combines (--combine)
            config = {k: v for k, v in vars(args).items() if k != "out"}
            config["threads"] = {k: os.environ.get(k) for k in THREAD_VARS}
            partial = {"runs": {mode: {"seeds": seeds, "failed": failed}}, "config": config,
                       "machine": machine(), "partial": True}  # fmt: skip
            write_result(args.out.with_suffix(f".{mode}.partial.json"), partial, default=str)
    finally:
        if hog is not None:
            hog.__exit__(None, None, None)
    if not runs:
        return {"error": "every seed failed", "failed": failed}
    pooled, strata = pool_runs(runs)
    out = summarize(pooled, strata, n_boot=args.n_boot, seed=0) | {"seeds": seeds, "failed": failed}
    out["wall_s"] = round(time.monotonic() - t0, 1)
    if hog is not None:
        out["hog"] = {"cpu_s": round(hog.cpu_s, 1), "wall_s": round(hog.wall_s, 1)}
    return out


def resummarize(run: dict[str, Any], n_boot: int) -> dict[str, Any]:
    """A run's figures again from each seed's saved arrays (its `dir`/run.npz), seed metadata kept."""
    from deploy.live_figures import load_run

    runs, seeds = [], []
    for entry in run["seeds"]:
        arrays = load_run(Path(entry["dir"]) / "run.npz")
        runs.append(arrays)
        keep = {k: v for k, v in entry.items() if k in META}
        # per seed fewer resamples (its interval is a side figure; the pooled one decides)
        seeds.append(summarize(arrays, n_boot=min(n_boot, 200), seed=entry["seed"]) | keep)
    pooled, strata = pool_runs(runs)
    out = summarize(pooled, strata, n_boot=n_boot, seed=0) | {"seeds": seeds}
    return out | {k: run[k] for k in ("wall_s", "hog", "command") if k in run}


def combine(args: argparse.Namespace) -> dict[str, Any]:
    """The runs of several results as one: the seeds of one run (quiet, loaded) in several files
    (a run cut short and resumed) are pooled; each file's config, machine and command are kept."""
    import json

    parts: dict[str, dict[str, Any]] = {}
    for path in args.combine:
        body = json.loads(path.read_text())
        for mode, run in body["runs"].items():
            part = parts.setdefault(mode, {"seeds": [], "failed": [], "sources": []})
            part["seeds"] += run.get("seeds", [])
            part["failed"] += run.get("failed", [])
            source = {k: body.get(k) for k in ("command", "config", "machine")}
            part["sources"].append(
                source | {"file": str(path), "hog": run.get("hog"), "wall_s": run.get("wall_s")}
            )
    runs: dict[str, Any] = {}
    for mode, part in parts.items():
        runs[mode] = resummarize({"seeds": part["seeds"]}, args.n_boot)
        runs[mode] |= {"failed": part["failed"], "sources": part["sources"]}
    config = {mode: [s["config"] for s in part["sources"]] for mode, part in parts.items()}
    machines = {mode: [s["machine"] for s in part["sources"]] for mode, part in parts.items()}
    seeds = sorted({e["seed"] for r in runs.values() for e in r["seeds"]})
    return {"runs": runs, "ope": ope_entry(seeds), "config": config, "sizes": SIZES,
            "decides_5pct": decisions(runs), "machine": machines,
            "combined_from": [str(p) for p in args.combine]}  # fmt: skip


# figures of a run that `merge_pooled` combines (lifts on the log ratio, AUC differences as they are)
LIFTS = tuple(f + v for f in (*SIZED, "revenue_lift_after") for v in VARIANTS) + tuple(
    f"adapter_lift_before{v}" for v in VARIANTS
)
DIFFS = ("auc_online_minus_frozen_before", "auc_online_minus_frozen_after")
Z95 = 1.959963984540054


def _on_scale(
    entries: list[dict[str, Any]], log_ratio: bool
) -> tuple[list[float], list[float], Callable[[float], float]]:
    """Estimates `{mean, ci_low, ci_high}` (95 %) as means and standard errors on the scale their
    intervals are near symmetric on (log(1 + lift) for a relative lift), and the way back."""
    f: Callable[[float], float] = (lambda x: math.log1p(x)) if log_ratio else (lambda x: x)
    g: Callable[[float], float] = (lambda y: math.expm1(y)) if log_ratio else (lambda y: y)
    ys = [f(e["mean"]) for e in entries]
    ses = [max((f(e["ci_high"]) - f(e["ci_low"])) / (2 * Z95), 1e-12) for e in entries]
    return ys, ses, g


def inverse_variance(entries: list[dict[str, Any]], log_ratio: bool) -> dict[str, Any]:
    """Independent estimates `{mean, ci_low, ci_high}` (95 %) combined by inverse-variance
    weights (a fixed-effect meta-analysis): each one's standard error is its interval's
    half-width / 1.96 on the scale the interval is near symmetric on — log(1 + lift) for a
    relative lift, the difference itself otherwise — and the combined interval is ±1.96 of the
    combined standard error on that scale. What is pooled are runs on disjoint seeds (their users
    independent) whose per-user arrays are no longer there to be pooled again.

    >>> e = {"mean": 0.1, "ci_low": 0.0, "ci_high": 0.2}
    >>> m = inverse_variance([e, e], log_ratio=False)
    >>> round(m["mean"], 6), round(m["ci_high"] - m["ci_low"], 4)  # same mean, 1/sqrt(2) as wide
    (0.1, 0.1414)
    >>> inverse_variance([e, {"error": "arm 'control' has no traffic"}], log_ratio=False)["error"]
    "arm 'control' has no traffic"
    """
    for e in entries:
        if "mean" not in e:
            return {"error": e.get("error", "no interval")}
    ys, ses, g = _on_scale(entries, log_ratio)
    w = [1 / se**2 for se in ses]
    y = sum(wi * yi for wi, yi in zip(w, ys, strict=True)) / sum(w)
    se = 1 / math.sqrt(sum(w))
    out: dict[str, Any] = {"mean": g(y), "ci_low": g(y - Z95 * se), "ci_high": g(y + Z95 * se)}
    if all("users" in e for e in entries):
        out["users"] = sum(e["users"] for e in entries)
    return out | {"method": "inverse-variance over runs on disjoint seeds"}


# figures also judged across seeds (`seed_level`): a seed's users share its loop's timing, which
# pooling users across seeds treats as independent
SEED_LEVEL = (
    "ctr_lift_after",
    "ctr_lift_after_expected",
    "adapter_lift_after",
    "adapter_lift_after_expected",
    "adapter_lift_after_shadow",
)


def random_effects(entries: list[dict[str, Any]], log_ratio: bool) -> dict[str, Any]:
    """Per-seed estimates `{mean, ci_low, ci_high}` (95 %) combined with the seeds as the unit: a
    random-effects meta-analysis (DerSimonian–Laird between-seed variance τ², Hartung–Knapp
    interval on t with k − 1 degrees of freedom, its scale never below the fixed-effect one), on
    the scale `inverse_variance` uses. Where seeds differ by more than their own intervals say
    (the loop's timing, the drift's draw), τ² > 0 widens the interval; Cochran's Q and its p say
    whether they do.

    >>> same = [{"mean": 0.1, "ci_low": 0.0, "ci_high": 0.2}] * 4
    >>> r = random_effects(same, log_ratio=False)
    >>> round(r["mean"], 6), r["tau"], r["seeds"]
    (0.1, 0.0, 4)
    >>> apart = [{"mean": m, "ci_low": m - 0.05, "ci_high": m + 0.05} for m in (-0.3, 0.0, 0.3, 0.6)]
    >>> wide = random_effects(apart, log_ratio=False)
    >>> wide["tau"] > 0.3 and wide["ci_low"] < 0 < wide["ci_high"] and wide["q_p"] < 0.001
    True
    """
    from scipy import stats

    ok = [e for e in entries if "mean" in e]
    if len(ok) < 2:
        return {"error": f"{len(ok)} seed(s) with an interval: a seed-level interval needs 2"}
    means, ses, g = _on_scale(ok, log_ratio)
    y, v = np.array(means), np.array(ses) ** 2
    k, w = len(ok), 1 / v
    fixed = float((w * y).sum() / w.sum())
    q = float((w * (y - fixed) ** 2).sum())
    c = float(w.sum() - (w**2).sum() / w.sum())
    tau2 = max(0.0, (q - (k - 1)) / c) if c > 0 else 0.0
    wr = 1 / (v + tau2)
    mean = float((wr * y).sum() / wr.sum())
    scale = max(1.0, float((wr * (y - mean) ** 2).sum()) / (k - 1))  # Hartung–Knapp, never narrower
    half = float(stats.t.ppf(0.975, k - 1)) * math.sqrt(scale / float(wr.sum()))
    return {
        "mean": g(mean), "ci_low": g(mean - half), "ci_high": g(mean + half), "seeds": k,
        "tau": round(math.sqrt(tau2), 4), "q": round(q, 2), "q_p": float(stats.chi2.sf(q, k - 1)),
        "method": "random effects over seeds (DerSimonian–Laird τ², Hartung–Knapp t interval)",
    }  # fmt: skip


def seed_level(runs: dict[str, Any]) -> dict[str, Any]:
    """Each run with `<figure>_seeds` (`random_effects` of its seeds' own intervals) for the
    `SEED_LEVEL` figures, beside the figures pooled over users."""
    for r in runs.values():
        seeds = r.get("seeds", []) if isinstance(r, dict) else []
        for key in SEED_LEVEL:
            if seeds and any(key in e for e in seeds):
                r[f"{key}_seeds"] = random_effects([e.get(key, {}) for e in seeds], log_ratio=True)
    return runs


def merge_pooled(paths: list[Path]) -> dict[str, Any]:
    """Runs on disjoint seeds, each pooled by its own user bootstrap, as one result: each figure
    combined by `inverse_variance`, the seeds' entries listed together, resets summed."""
    import json

    bodies = [json.loads(p.read_text()) for p in paths]
    runs: dict[str, Any] = {}
    for mode in sorted({m for b in bodies for m in b["runs"]}):
        parts = [b["runs"][mode] for b in bodies if mode in b["runs"]]
        seeds = [e["seed"] for r in parts for e in r.get("seeds", [])]
        if len(seeds) != len(set(seeds)):
            raise SystemExit(
                f"--merge-pooled: the {mode} runs share seeds ({sorted(seeds)}): pool them instead"
            )
        run: dict[str, Any] = {k: inverse_variance([r[k] for r in parts], log_ratio=True) for k in LIFTS
                               if all(k in r for r in parts)}  # fmt: skip
        run |= {k: inverse_variance([r[k] for r in parts], log_ratio=False) for k in DIFFS}
        run["seeds"] = [e for r in parts for e in r.get("seeds", [])]
        run["resets"] = sum(r["resets"] for r in parts)
        # the largest of the runs' rates (each run's adapter-hours are not kept): an upper bound
        run["resets_per_adapter_hour"] = max((r["resets_per_adapter_hour"] or 0.0) for r in parts)
        run["exploration_ctr_cost"] = {
            "relative_cost": inverse_variance(
                [r["exploration_ctr_cost"]["relative_cost"] for r in parts], log_ratio=False
            ),
            "runs": [r["exploration_ctr_cost"] for r in parts],
        }
        run["impressions"] = sum(r.get("impressions", 0) for r in parts)
        run["parts"] = [{k: r.get(k) for k in ("command", "wall_s", "hog")} for r in parts]
        runs[mode] = run
    seeds = sorted({e["seed"] for r in runs.values() for e in r["seeds"]})
    return {"runs": runs, "ope": bodies[-1].get("ope"), "sizes": SIZES, "decides_5pct": decisions(runs),
            "machine": [m for b in bodies for m in _listed(b.get("machine"))],
            "merged_from": [str(p) for p in paths], "seeds": seeds}  # fmt: skip


def _listed(machine: Any) -> list[Any]:
    """A result's machine as a list (a merged result already lists its runs' machines).

    >>> _listed({"cpu": "x"}), _listed([{"cpu": "x"}, {"cpu": "y"}])
    ([{'cpu': 'x'}], [{'cpu': 'x'}, {'cpu': 'y'}])
    """
    return list(machine) if isinstance(machine, list) else [machine]


def ope_entry(seeds: list[int]) -> dict[str, Any]:
    """Relative error of the off-policy estimators of a known policy vs its simulated truth."""
    try:
        from workloads.ope_truth import OpeTruthConfig, score
        from workloads.ope_truth import summarize as ope_summary
    except ImportError as exc:
        return {"error": f"no off-policy truth in this build: {exc}"}
    seeds = seeds if len(seeds) > 1 else [*seeds, seeds[0] + 1]  # its interval is over seeds
    runs = [score(OpeTruthConfig(seed=s)) for s in seeds]
    pooled = ope_summary(runs)
    return {
        "relative_error": pooled,
        "seeds": seeds,
        "source": "workloads.ope_truth (simulator, not the loop)",
    }


def _ci(entry: dict[str, Any], fmt: str = "{:+.1%}") -> str:
    if "mean" not in entry:
        return f"n/a ({entry.get('error', '?')[:40]})"
    return f"{fmt.format(entry['mean'])} [{fmt.format(entry['ci_low'])}, {fmt.format(entry['ci_high'])}]"


def table(result: dict[str, Any]) -> Table:
    """Pooled figures per run, one row each."""
    t = Table(title="live loop, pooled over seeds")
    for col in ("figure", *result["runs"]):
        t.add_column(col)
    rows: dict[str, Callable[[dict[str, Any]], str]] = {
        "CTR lift before drift (learning/control)": lambda r: _ci(r["ctr_lift_before"]),
        "CTR lift after drift": lambda r: _ci(r["ctr_lift_after"]),
        "  seeds as the unit (random effects)": lambda r: _ci(r.get("ctr_lift_after_seeds", {})),
        "  CUPED (history CTR)": lambda r: _ci(r.get("ctr_lift_after_cuped", {})),
        "  expected clicks (simulator)": lambda r: _ci(r.get("ctr_lift_after_expected", {})),
        "adapter lift after (learning/correction)": lambda r: _ci(r["adapter_lift_after"]),
        "  seeds as the unit (random effects) ": lambda r: _ci(r.get("adapter_lift_after_seeds", {})),
        "  CUPED (history CTR) ": lambda r: _ci(r.get("adapter_lift_after_cuped", {})),
        "  expected clicks (simulator) ": lambda r: _ci(r.get("adapter_lift_after_expected", {})),
        "  paired shadow slates (simulator)": lambda r: _ci(r.get("adapter_lift_after_shadow", {})),
        "    seeds as the unit (random effects)": lambda r: _ci(r.get("adapter_lift_after_shadow_seeds", {})),
        "    requests whose slates differ": lambda r: (
            f"{r['adapter_lift_after_shadow']['differ_share']:.1%}"
            if "differ_share" in r.get("adapter_lift_after_shadow", {})
            else "n/a"
        ),
        "AUC online − frozen after": lambda r: _ci(r["auc_online_minus_frozen_after"], "{:+.4f}"),
        "AUC online − frozen before": lambda r: _ci(r["auc_online_minus_frozen_before"], "{:+.4f}"),
        "resets per adapter-hour": lambda r: (
            f"{r['resets_per_adapter_hour']:.1f} ({r['resets']} resets)"
            if r["resets_per_adapter_hour"] is not None
            else "n/a"
        ),
        "exploration CTR cost": lambda r: _ci(
            r["exploration_ctr_cost"].get("relative_cost", r["exploration_ctr_cost"]), "{:.1%}"
        ),
        "adapters' shift after, new / old season over other": lambda r: _season(r, "after"),
        "  before the drift": lambda r: _season(r, "before"),
    }
    for name, fn in rows.items():
        t.add_row(name, *[fn(r) for r in result["runs"].values()])
    return t


def _season(run: dict[str, Any], phase: str) -> str:
    """The adapters' logit shift on the new and the old season's categories, each over the other
    categories' (`deploy.live_figures.season_figures`), in one phase; n/a without the simulator's
    seasons.

    >>> over = {"adapter_shift_over_other": {"new_season": 0.5, "old_season": -0.25}}
    >>> _season({"season": {"after": over}}, "after")
    '+0.50 / -0.25 logit'
    """
    over = run.get("season", {}).get(phase, {}).get("adapter_shift_over_other")
    if not over:
        return "n/a"
    return f"{over['new_season']:+.2f} / {over['old_season']:+.2f} logit"


def decides(entry: dict[str, Any], goal: float = 0.05) -> bool | None:
    """Whether an interval is narrow enough to tell the goal (half-width below it)."""
    if "ci_low" not in entry:
        return None
    return bool((entry["ci_high"] - entry["ci_low"]) / 2 < goal)


def verdict(entry: dict[str, Any], goal: float = 0.05) -> str | None:
    """`met` (mean ≥ goal, interval above 0), `not_met` (interval entirely below the goal) or
    `undecided`.

    >>> met = {"mean": 0.2, "ci_low": 0.01, "ci_high": 0.4}
    >>> miss = {"mean": 0.0, "ci_low": -0.1, "ci_high": 0.04}
    >>> verdict(met), verdict(miss)
    ('met', 'not_met')
    """
    if "ci_low" not in entry:
        return None
    if entry["mean"] >= goal and entry["ci_low"] > 0:
        return "met"
    if entry["ci_high"] < goal:
        return "not_met"
    return "undecided"


def sizing(entry: dict[str, Any], seeds: int, goal: float = 0.05) -> dict[str, Any]:
    """A pooled lift's half-width and the seeds its spread says a decision needs (scaling the
    half-width as 1/sqrt(seeds): users of different seeds are independent).

    >>> sizing({"mean": 0.1, "ci_low": 0.0, "ci_high": 0.2}, 4)["seeds_for_5pct"]
    16
    """
    if "ci_low" not in entry:
        return {"error": entry.get("error", "no interval")}
    half = (entry["ci_high"] - entry["ci_low"]) / 2
    out: dict[str, Any] = {
        "half_width": half,
        "decides": decides(entry, goal),
        "verdict": verdict(entry, goal),
        "seeds": seeds,
        "seeds_for_5pct": math.ceil(seeds * (half / goal) ** 2),
    }
    mean = abs(entry["mean"])
    out["seeds_to_exclude_0"] = math.ceil(seeds * (half / mean) ** 2) if mean > 0 else None
    return out


def decisions(runs: dict[str, Any]) -> dict[str, Any]:
    """`sizing` of every sized figure and variant of every run."""
    out: dict[str, Any] = {}
    for mode, r in runs.items():
        out[mode] = {}
        for key in (f + v for f in SIZED for v in VARIANTS):
            if key in r:  # the seeds that have the figure (an early seed saved no oracle)
                n = sum("mean" in s.get(key, {}) for s in r.get("seeds", [])) or len(r.get("seeds", [])) or 1
                out[mode][key] = sizing(r[key], n)
        for key in (f"{f}_seeds" for f in SEED_LEVEL):
            if "seeds" in r.get(key, {}):
                out[mode][key] = sizing(r[key], r[key]["seeds"])
    return out


HEADLINE = ("auc_online_minus_frozen_after", "ctr_lift_after", "adapter_lift_after", "ctr_lift_after_seeds",
            "adapter_lift_after_shadow")  # fmt: skip


def headline_figures(runs: dict[str, Any]) -> dict[str, float | int]:
    """The judged figures' means per run, flat (`figures`: what `adstream bench table` shows) —
    their intervals are in `runs`.

    >>> headline_figures({"quiet": {"ctr_lift_after": {"mean": 0.19, "ci_low": 0.02, "ci_high": 0.38},
    ...                             "adapter_lift_after": {"error": "no traffic"}, "resets": 0}})
    {'ctr_lift_after_quiet': 0.19, 'resets_quiet': 0}
    """
    out: dict[str, float | int] = {}
    for key in HEADLINE:
        for mode, r in runs.items():
            if "mean" in r.get(key, {}):
                out[f"{key}_{mode}"] = r[key]["mean"]
    for mode, r in runs.items():
        if isinstance(r.get("resets"), int):
            out[f"resets_{mode}"] = r["resets"]
    return out


def main(argv: list[str] | None = None) -> None:
    from deploy import stack
    from schemas.settings import Settings

    args = parse(argv)
    console = Console()
    if args.combine or args.merge_pooled:
        combined = combine(args) if args.combine else merge_pooled(args.merge_pooled)
        seed_level(combined["runs"])
        combined["decides_5pct"] = decisions(combined["runs"])
        combined["figures"] = headline_figures(combined["runs"])
        console.print(table(combined))
        write_result(args.out, combined, default=str)
        return
    stack.up(Settings())
    m0, t0 = machine(), time.perf_counter()
    runs = seed_level({mode: one_mode(args, mode, console.print) for mode in args.runs})
    result: dict[str, Any] = {
        "runs": runs,
        "figures": headline_figures(runs),
        "ope": ope_entry(args.seeds),
        "config": {k: v for k, v in vars(args).items() if k != "out"}
        | {"ab_env": ab_env(args), "threads": {k: os.environ.get(k) for k in THREAD_VARS}},
        "sizes": SIZES,
        "decides_5pct": decisions(runs),
        "wall_s": round(time.perf_counter() - t0, 1),
        "machine": m0,
    }
    console.print(table(result))
    write_result(args.out, result, default=str)


if __name__ == "__main__":
    main()
