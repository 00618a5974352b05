"""Benchmark: off-policy estimators against the simulator's truth (`workloads.ope_truth`).

Per seed, the market's requests are logged with an ε-greedy policy on a noisy ranker (known
propensities); a different policy (greedy on a better ranker) is scored by IPS, SNIPS and DR
(`attribution.ope`) and compared with its true CTR from the oracle on the same requests.
Reported per estimator: the relative error per seed, its mean with a t interval over seeds, the
mean and worst absolute error, and how many seeds' 95 % intervals held the truth.
Goal: SNIPS or DR within 10 % of the truth.

Usage: `.venv/bin/python benchmarks/ope_truth.py [--seeds 0 1 … 9] [--rounds 100000]`;
writes `benchmarks/results/ope_truth.json`.
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from rich.console import Console
from rich.table import Table

from deploy.machine import machine, write_result
from workloads.ope_truth import OpeTruthConfig, score, summarize

OUT = ROOT / "benchmarks" / "results" / "ope_truth.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--rounds", type=int, default=100_000)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    m0, t0 = machine(), time.perf_counter()
    configs = [OpeTruthConfig(seed=s, rounds=args.rounds) for s in args.seeds]
    runs = [score(c) for c in configs]
    pooled = summarize(runs)
    goal = any(pooled[e]["max_abs"] <= 0.10 for e in ("snips", "dr"))
    table = Table(
        title=f"relative error of the target's CTR estimate ({len(runs)} seeds × {args.rounds:,} rounds)"
    )
    for col in (
        "estimator",
        "mean",
        "95 % interval (seeds)",
        "mean |error|",
        "worst |error|",
        "CI held truth",
    ):
        table.add_column(col, justify="left" if col == "estimator" else "right")
    for name, v in pooled.items():
        held = f"{v['intervals_covering_truth']}/{v['runs']}"
        interval = f"{v['ci_low']:+.2%} … {v['ci_high']:+.2%}"
        table.add_row(
            name.upper(), f"{v['mean']:+.2%}", interval, f"{v['mean_abs']:.2%}", f"{v['max_abs']:.2%}", held
        )
    Console().print(table)
    Console().print(f"goal (SNIPS or DR within 10 % in every seed): {'met' if goal else 'NOT met'}")
    config = asdict(configs[0])
    config.pop("seed")
    write_result(
        args.out,
        {
            "relative_error": pooled,
            "goal_within_10pct": goal,
            "seeds": args.seeds,
            "config": config,
            "per_seed": [{"seed": c.seed, **r.as_dict()} for c, r in zip(configs, runs, strict=True)],
            "wall_s": round(time.perf_counter() - t0, 2),
            "machine": m0,
        },
    )


if __name__ == "__main__":
    main()
