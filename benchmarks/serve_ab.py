"""The replica's CPU per served request of two checkouts of the ad server, interleaved (issue 33).

A serving change worth a few percent of the replica's CPU cannot be read from `benchmarks/serve.py`:
on the 2-core machines the same code's CPU per request moves by ±10 % from one run to the next
(2026-12-07, AMD EPYC: 9.99 / 11.88 / 11.80 ms at 50 req/s, three runs of one commit). This
benchmark deploys each of two git refs in turn, `--rounds` times (A B, then B A, …), each as
`benchmarks/serve.py` deploys the ad server (the slot scheme, its adapters in Redis, 10,000 ads,
5,000 warm users, direct ingress), loads it with wrk at each `--rates` for `--duration` seconds and
reads the replica process's CPU time (/proc, every thread) over the requests it served. The
result is each ref's CPU per request and the same-round ratio B / A with a bootstrap interval
over the rounds (a round ran both back to back, so the machine's phases hit them alike).

    .venv/bin/python -m benchmarks.serve_ab --refs 07c2455 HEAD --rounds 4

A ref is checked out as a git worktree in a temporary folder (`.` is this checkout as it is,
uncommitted changes included) and runs with this checkout's virtual environment; the stack
(Kafka, Redis) must be up (`make up`). Writes `benchmarks/results/serve_ab.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lib.args import int_at_least
from benchmarks.lib.stats import ratio_summary
from deploy.machine import machine, write_result

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "serve_ab.json"
CHILD_TIMEOUT_S = 900
FIGURES = ("cpu_ratio_b_to_a", "ci_low", "ci_high")  # per rate, in `figures`
KEPT = ("rate", "rps", "p50_ms", "p99_ms", "errors", "cpu_ms_per_request")  # of each paced run


def paired(a: list[float], b: list[float], seed: int = 0) -> dict[str, Any]:
    """Median of the same-round ratios b / a with its 95 % bootstrap interval (rounds resampled),
    and each side's mean.

    >>> r = paired([10.0, 11.0, 12.0, 10.5], [9.0, 10.0, 10.8, 9.6])
    >>> r["median"], r["ci95"][0] <= r["median"] <= r["ci95"][1], r["rounds"], r["mean_a"]
    (0.9045, True, 4, 10.875)
    """
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape or not x.size:
        raise ValueError(f"paired rounds needed (got {x.size} and {y.size})")
    means = {"mean_a": round(float(x.mean()), 3), "mean_b": round(float(y.mean()), 3)}
    return ratio_summary(b, a, seed) | means


def child(rates: list[int], duration: int, out: Path) -> None:
    """One deployment of the checkout this process imports from (its cwd, first on PYTHONPATH):
    CPU per request at each rate, into `out`."""
    sys.path.insert(0, os.getcwd())
    import benchmarks.serve as bs
    from deploy.cli_serving import start
    from schemas.settings import Settings

    tmp = Path(tempfile.mkdtemp(prefix="adstream-serve-ab-"))
    catalog = tmp / "catalog.jsonl"
    bs.make_catalog(catalog, 10_000)
    bs.make_model(tmp / "models", Settings().model_dir)
    args = argparse.Namespace(
        duration=duration, conns=32, users=5000, profile_stacks=False, profile_raw=None, port=8011
    )
    settings = bs.scheme_settings(args, tmp, catalog, "slot")
    bs.warm_users(settings, 5000, catalog)
    bs.write_adapters(settings, tmp / "models", catalog)
    rows = []
    try:
        url = start(settings, name="bench").best
        bs.wait_ready(url)
        bs.run_wrk(url, rates[0], 5, 32, 5000)  # warm-up
        for rate in rates:
            res = bs.profile_replica(url, "bench", rate, args)
            rows.append(
                {k: res.get(k) for k in ("rate", "rps", "p50_ms", "p99_ms", "errors", "cpu_ms_per_request")}
            )
    finally:
        bs.teardown(settings)
        shutil.rmtree(tmp, ignore_errors=True)
    out.write_text(json.dumps(rows))


def checkout(ref: str, into: Path) -> Path:
    """A worktree of `ref` under `into` with this checkout's virtual environment (`.`: this
    checkout itself)."""
    if ref == ".":
        return ROOT
    path = into / ref.replace("/", "_")
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(path), ref],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (path / ".venv").symlink_to(ROOT / ".venv")
    return path


def resolve(ref: str) -> str:
    """The commit `ref` names (`.`: the working tree); a clear error for a name git does not know."""
    if ref == ".":
        return "working tree"
    got = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
        capture_output=True, text=True,
    )  # fmt: skip
    if got.returncode != 0:
        raise SystemExit(f"serve_ab: {ref!r} is not a commit of this repository")
    return got.stdout.strip()[:12]


def run_one(path: Path, rates: list[int], duration: int, out: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(path)}
    cmd = [str(ROOT / ".venv" / "bin" / "python"), str(Path(__file__).resolve()), "--child",
           "--rates", ",".join(map(str, rates)), "--duration", str(duration), "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, cwd=path, env=env, check=True, timeout=CHILD_TIMEOUT_S, stdout=subprocess.DEVNULL)
    rows: list[dict[str, Any]] = json.loads(out.read_text())
    return rows


def rates_arg(text: str) -> list[int]:
    try:
        rates = [int(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates are whole numbers, comma-separated (got {text!r})") from None
    if not rates or min(rates) < 1:
        raise argparse.ArgumentTypeError(f"rates must be at least 1 request/s (got {text!r})")
    return rates


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--refs",
        nargs=2,
        metavar=("A", "B"),
        default=["HEAD", "."],
        help="the two git refs (`.`: this checkout as it is; default: HEAD against it, with no "
        "changes the A/A run that shows the noise)",
    )
    ap.add_argument("--rates", type=rates_arg, default=[50, 100], help="request rates, comma-separated")
    ap.add_argument("--duration", type=int_at_least(5), default=15, help="seconds of load at each rate")
    ap.add_argument("--rounds", type=int_at_least(2), default=4, help="rounds (each deploys A and B)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args.rates, args.duration, args.out)
        return
    commits = [resolve(r) for r in args.refs]
    start = machine()
    tmp = Path(tempfile.mkdtemp(prefix="adstream-serve-ab-trees-"))
    cpu: dict[str, dict[int, list[float]]] = {
        "a": {r: [] for r in args.rates},
        "b": {r: [] for r in args.rates},
    }
    runs: list[dict[str, Any]] = []
    try:
        paths = {"a": checkout(args.refs[0], tmp), "b": checkout(args.refs[1], tmp)}
        for round_ in range(args.rounds):
            for side in ("a", "b") if round_ % 2 == 0 else ("b", "a"):
                rows = run_one(paths[side], args.rates, args.duration, tmp / f"{side}{round_}.json")
                load = os.getloadavg()[0]
                runs.append(
                    {
                        "round": round_,
                        "ref": args.refs[side == "b"],
                        "load_avg_1m": round(load, 2),
                        "rows": rows,
                    }
                )
                for row in rows:
                    cpu[side][row["rate"]].append(row["cpu_ms_per_request"])
                print(f"round {round_} {side}: " + ", ".join(
                    f"{r['rate']}/s {r['cpu_ms_per_request']} ms (errors {r['errors']})" for r in rows
                ), flush=True)  # fmt: skip
    finally:
        for side_path in tmp.iterdir() if tmp.exists() else []:
            if side_path.is_dir():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(side_path)],
                               capture_output=True)  # fmt: skip
        shutil.rmtree(tmp, ignore_errors=True)
    by_rate = {str(rate): paired(cpu["a"][rate], cpu["b"][rate]) for rate in args.rates}
    result = {
        "benchmark": "serve_ab",
        "machine": start,
        "refs": {"a": [args.refs[0], commits[0]], "b": [args.refs[1], commits[1]]},
        "cpu_ms_per_request_ratio_b_to_a": by_rate,
        # the table's headline (`adstream bench table`): each rate's ratio and its interval's ends
        "figures": {
            f"{name}_{rate}": value
            for rate, r in by_rate.items()
            for name, value in zip(FIGURES, (r["median"], *r["ci95"]), strict=True)
        },
        "runs": runs,
        "what": "the ad server replica's CPU per served request (process CPU, every thread) of ref b over "
        "ref a, each deployed in turn per round; median of the same-round ratios, bootstrap 95 % interval",
    }
    write_result(args.out, result)
    for rate, r in by_rate.items():
        print(f"{rate}/s: a {r['mean_a']} ms, b {r['mean_b']} ms, b/a {r['median']} {r['ci95']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
