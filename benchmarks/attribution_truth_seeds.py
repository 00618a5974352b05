"""The attribution truth check over several seeds: each figure with its interval across markets.

One seed is one market; the truth check's figures (TV error of credit shares, the calibrated
error as a ratio of the uncalibrated one, the true outcome of budget moves) move with it by more
than the differences they are used to judge. This runs `benchmarks.attribution.truth` for each
seed and reports, per market and model, the mean over seeds with a 95 % t-interval, and the
minimum and maximum. For each `<model>+holdout`, `calibrated_ratio` is its error over its
model's, per seed (the goal: ≤ 0.33 for every data-driven model on the confounded market).

Budget moves are compared by the expected true conversions they add (given the touches served,
`MarketData.expected_credit`; one re-simulation's realised count moves by tens whatever the plan)
beside that realised count; each media-mix model's gain is paired by seed with every multi-touch
model's (`mmm_paired`), and the plans from the true curves (`true_curves`, per channel and per
campaign) give the ceiling.

Run: `.venv/bin/python -m benchmarks.attribution_truth_seeds --markets confounded --seeds 1-8`
(`--no-budget-moves` skips re-simulating each plan; `--users` as the truth check's). Writes
`benchmarks/results/attribution_truth_seeds_<markets>.json` (or `--out`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.attribution import markets, truth
from deploy.machine import machine, write_result
from schemas.settings import Settings

RESULTS = Path(__file__).resolve().parent / "results"
FIGURES = (
    "error",
    "calibrated_ratio",
    "budget_moves_expected_conversions_delta",
    "budget_moves_true_conversions_delta",
)
MOVES = "budget_moves_expected_conversions_delta"
# the plans that are not a multi-touch model's: what a media-mix model is compared with is the rest
REFERENCES = ("exact_credit", "true_curves", "true_curves_by_campaign")


def interval(xs: list[float]) -> dict[str, float | int]:
    """Mean, 95 % t-interval, min and max of per-seed figures.

    >>> interval([1.0, 2.0, 3.0])["mean"], round(interval([1.0, 2.0, 3.0])["high"], 3)
    (2.0, 4.484)
    """
    from scipy import stats

    a = np.asarray(xs, dtype=float)
    mean = float(a.mean())
    half = (
        float(stats.t.ppf(0.975, a.size - 1) * a.std(ddof=1) / np.sqrt(a.size))
        if a.size > 1
        else float("nan")
    )
    return {"mean": mean, "low": mean - half, "high": mean + half, "min": float(a.min()),
            "max": float(a.max()), "seeds": int(a.size)}  # fmt: skip


def summarise(per_seed: dict[int, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per model: each figure's interval over the seeds (calibrated ratio for `+holdout` models)."""
    out: dict[str, dict[str, Any]] = {}
    models = next(iter(per_seed.values()))
    for model in models:
        figures: dict[str, list[float]] = {}
        for res in per_seed.values():
            r = res[model]
            figures.setdefault("error", []).append(r["error"])
            base = model.removesuffix("+holdout")
            if model.endswith("+holdout") and res.get(base, {}).get("error"):
                figures.setdefault("calibrated_ratio", []).append(r["error"] / res[base]["error"])
            for k in ("budget_moves_true_conversions_delta", MOVES):
                if k in r:
                    figures.setdefault(k, []).append(r[k])
        out[model] = {k: {n: round(v, 4) for n, v in interval(v).items()} for k, v in figures.items()}
    return out


def paired(per_seed: dict[int, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each media-mix model's budget moves against every multi-touch model's, paired by seed: the
    interval of the per-seed difference in expected true conversions gained (the goal: above 0
    against every one)."""
    first = next(iter(per_seed.values()))
    mmms = [m for m in first if m.startswith("mmm") and MOVES in first[m]]
    others = [m for m in first if not m.startswith("mmm") and m not in REFERENCES and MOVES in first[m]]
    out: dict[str, dict[str, Any]] = {}
    for mmm in mmms:
        diffs = {o: [res[mmm][MOVES] - res[o][MOVES] for res in per_seed.values()] for o in others}
        body = {o: {n: round(v, 2) for n, v in interval(d).items()} for o, d in diffs.items()}
        best = max(others, key=lambda o: float(np.mean([res[o][MOVES] for res in per_seed.values()])))
        out[mmm] = {
            "against": body,
            "best_multi_touch": best,
            "beats_every_multi_touch": all(b["low"] > 0 for b in body.values()),
        }
    return out


def figures(markets: dict[str, dict[str, Any]]) -> dict[str, float | bool]:
    """The headline of a run, per market: the best media-mix plan's and the best multi-touch
    model's mean budget moves (expected true conversions gained) and whether that plan beats
    every multi-touch model paired by seed (`adstream bench table` shows these).

    >>> figures({"m": {"summary": {"mmm": {MOVES: {"mean": 5.0}}, "last_click": {MOVES: {"mean": 4.0}}},
    ...                "mmm_paired": {"mmm": {"best_multi_touch": "last_click",
    ...                                       "beats_every_multi_touch": False}}}})
    {'m.mmm_moves': 5.0, 'm.last_click_moves': 4.0, 'm.beats_every_multi_touch': False}
    """
    out: dict[str, float | bool] = {}
    for market, body in markets.items():
        plans = body.get("mmm_paired")
        if not plans:
            continue
        summary = body["summary"]
        best = max(plans, key=lambda p: float(summary[p][MOVES]["mean"]))
        rival = plans[best]["best_multi_touch"]
        out[f"{market}.{best}_moves"] = float(summary[best][MOVES]["mean"])
        out[f"{market}.{rival}_moves"] = float(summary[rival][MOVES]["mean"])
        out[f"{market}.beats_every_multi_touch"] = bool(plans[best]["beats_every_multi_touch"])
    return out


def seeds_arg(text: str) -> list[int]:
    """`1-8` or `1,3,5` as a list of seeds."""
    if "-" in text:
        lo, hi = (int(x) for x in text.split("-", 1))
        return list(range(lo, hi + 1))
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--markets", nargs="+", default=["confounded"], choices=list(markets(1)))
    ap.add_argument("--seeds", type=seeds_arg, default=seeds_arg("1-8"))
    ap.add_argument("--users", type=int, default=20_000, help="the truth check's users (market sizes scale)")
    ap.add_argument("--no-budget-moves", action="store_true", help="skip re-simulating each budget plan")
    ap.add_argument("--out", help="result file name (default attribution_truth_seeds_<markets>.json)")
    args = ap.parse_args()
    settings = Settings()
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for seed in args.seeds:
        got = truth(settings, args.users, args.markets, seed=seed, budget_moves=not args.no_budget_moves)
        for market, body in got.items():
            runs.setdefault(market, {})[seed] = body["models"]
    result = {
        "machine": machine(),
        "users": args.users,
        "seeds": args.seeds,
        "markets": {
            m: {"summary": summarise(r), "mmm_paired": paired(r), "per_seed": r} for m, r in runs.items()
        },
    }
    result["figures"] = figures(result["markets"])
    show(result)
    write_result(RESULTS / (args.out or f"attribution_truth_seeds_{'_'.join(args.markets)}.json"), result)


def show(result: dict[str, Any]) -> None:
    t = Table("market", "model", *(f"{f} mean [95 % CI] (min–max)" for f in FIGURES))
    for market, body in result["markets"].items():
        for model, figs in body["summary"].items():
            cells = [
                f"{f['mean']:.3f} [{f['low']:.3f}, {f['high']:.3f}] ({f['min']:.3f}–{f['max']:.3f})"
                if (f := figs.get(k))
                else ""
                for k in FIGURES
            ]
            t.add_row(market, model, *cells)
    Console().print(t)
    p = Table("market", "media-mix model", "against", "Δ expected true conversions, mean [95 % CI]")
    for market, body in result["markets"].items():
        for mmm, vs in body.get("mmm_paired", {}).items():
            for other, f in vs["against"].items():
                p.add_row(market, mmm, other, f"{f['mean']:+.1f} [{f['low']:+.1f}, {f['high']:+.1f}]")
    Console().print(p)


if __name__ == "__main__":
    main()
