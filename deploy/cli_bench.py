"""`adstream bench …`: the project's benchmarks (`benchmarks/*.py`), one or all, from the CLI.

Each benchmark stays a script runnable alone (`python benchmarks/<name>.py`, its own flags, its
JSON under `benchmarks/results/`). `adstream bench <name> [ARGS…]` runs one with its flags;
`adstream bench all` runs every one in turn and writes one markdown table (status, wall time,
headline figures of its JSON) with the machine it ran on. `--quick` passes each benchmark small
sizes (`QUICK`; one without an entry there, or without `--out`, is skipped, not run at full
size) and `--out benchmarks/results/quick/<name>.json`, so the committed results stay as they
are; the table goes there too.

The benchmarks ship in the wheel (package `benchmarks`, next to `deploy`; their extra
dependencies are `adstream[bench]`), so `adstream bench` works from an installed package too.
Installed, there are no committed results: runs write under `$ADSTREAM_BENCH_RESULTS`, default
`./bench-results` of the working directory (a benchmark with `--out` gets one there unless given),
and run in the working directory; in a source checkout they write `benchmarks/results/` as before.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from deploy.machine import machine, write_result

# the package `benchmarks` next to `deploy`: the source checkout's, or the installed wheel's
BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
# small sizes for `bench all --quick` (a smoke run of every benchmark, minutes in all)
QUICK: dict[str, list[str]] = {
    "cold_start": ["--seeds", "7", "--impressions", "20000"],
    "dw_step": ["--steps", "30", "--warmup", "3"],
    "freshness": ["--trials", "10", "--rate", "10", "--history", "3000", "--warmup-s", "5"],
    "hotswap": ["--swaps", "10", "--duration", "10"],
    "offline_quality": ["--seeds", "1"],
    "online_drift": [
        "--seeds",
        "7",
        "--impressions",
        "30000",
        "--pretrain",
        "10000",
        "--window",
        "3000",
        "--recover-window",
        "1500",
        "--horizon",
        "6000",
        "--no-trend",
        "--no-redraw",
        "--no-population",
        "--no-default-targets",
    ],
    "peer_online": ["--seeds", "7", "--impressions", "20000", "--pretrain", "8000"],
    "rank": ["--seconds", "3", "--runs", "1"],
    "recall": ["--ads", "20000", "--queries", "200"],
    "serve": ["--rates", "50", "--duration", "5", "--repeats", "1"],
    "serve_routes": ["--quick", "--served", "100"],
    "serve_ab": ["--rounds", "2", "--rates", "50", "--duration", "5"],
}
NEEDS_GPU = {"gpu_check"}


def benchmarks() -> list[str]:
    """Names of the benchmark scripts (every `benchmarks/*.py`)."""
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_"))


def checkout() -> bool:
    """Whether the benchmarks are a source checkout's, not an installed package's (in this
    interpreter's site-packages, or the user's)."""
    sites = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib"), site.getusersitepackages()}
    return BENCH_DIR.parent not in {Path(s).resolve() for s in sites}


def results_dir() -> Path:
    """Where runs write their JSON: `benchmarks/results/` of a checkout; installed,
    `$ADSTREAM_BENCH_RESULTS` or `./bench-results`."""
    if checkout():
        return BENCH_DIR / "results"
    return Path(os.environ.get("ADSTREAM_BENCH_RESULTS", "bench-results")).resolve()


def _shown(path: Path) -> str:
    """`path` relative to the checkout (benchmarks/results/…) or to the working directory."""
    for base in (BENCH_DIR.parent, Path.cwd()):
        if path.is_relative_to(base):
            return str(path.relative_to(base))
    return str(path)


def _takes_out(name: str) -> bool:
    """Whether `benchmarks/<name>.py` has an `--out` flag."""
    return '"--out"' in (BENCH_DIR / f"{name}.py").read_text()


def _command(name: str, args: list[str]) -> tuple[list[str], dict[str, Any]]:
    """The child process of `benchmarks/<name>.py args`: in a checkout it runs from the repository
    root; installed, from the working directory (relative paths in `args` mean what the user
    meant), with the installed package first on the path and `--out` under `results_dir()`."""
    cmd = [sys.executable, "-m", f"benchmarks.{name}", *args]
    if checkout():
        return cmd, {"cwd": BENCH_DIR.parent}
    asked = {a.split("=", 1)[0] for a in args}
    if _takes_out(name) and not asked & {"--out", "--help", "-h"}:
        out = results_dir() / f"{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd += ["--out", str(out)]
    path = os.pathsep.join(p for p in (str(BENCH_DIR.parent), os.environ.get("PYTHONPATH")) if p)
    return cmd, {"env": {**os.environ, "PYTHONPATH": path}}


def headline(result: dict[str, Any], n: int = 6) -> str:
    """A few top-level scalar figures of a benchmark's JSON (goals, P50/P99, AUCs, judged cost
    ratios first); a JSON that gathers its judged figures under `figures` (attribution) shows
    those."""
    top = result["figures"] if isinstance(result.get("figures"), dict) else result
    scalars = {k: v for k, v in top.items() if isinstance(v, int | float | bool) and not isinstance(v, str)}
    words = ("goal", "p50", "p99", "auc", "recovered", "per_s", "cost_ratio")
    first = [k for k in scalars if any(w in k for w in words)]
    keys = (first + [k for k in scalars if k not in first])[:n]
    return ", ".join(
        f"{k}={scalars[k]:.4g}" if isinstance(scalars[k], float) else f"{k}={scalars[k]}" for k in keys
    )


def run_one(name: str, args: list[str], quick: bool) -> dict[str, Any]:
    """Run `benchmarks/<name>.py args`; its status, wall time, result file and headline.

    A quick run writes its JSON to `benchmarks/results/quick/<name>.json` (`--out`) and touches
    nothing else; a full run's figures are read from `benchmarks/results/<name>.json` (installed:
    `results_dir()` in place of `benchmarks/results`)."""
    result = results_dir() / ("quick" if quick else "") / f"{name}.json"
    if quick or (not checkout() and _takes_out(name)):
        result.parent.mkdir(parents=True, exist_ok=True)
        args = [*args, "--out", str(result)]
    before = result.stat().st_mtime if result.exists() else None
    t0 = time.monotonic()
    cmd, where = _command(name, args)
    proc = subprocess.run(cmd, capture_output=True, text=True, **where)
    wall = time.monotonic() - t0
    wrote = result.exists() and result.stat().st_mtime != before
    figures = ""
    if wrote:
        try:
            figures = headline(json.loads(result.read_text()))
        except (ValueError, OSError):
            pass
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] if proc.returncode else []
    return {
        "benchmark": name,
        "status": "ok" if proc.returncode == 0 else f"failed ({proc.returncode}): {' '.join(tail)[:200]}",
        "wall_s": round(wall, 1),
        "results": [_shown(result)] if wrote else [],
        "headline": figures,
    }


def markdown(rows: list[dict[str, Any]], quick: bool) -> str:
    """The table of a `bench all` run, with the machine."""
    m = machine()
    lines = [
        f"# adstream benchmarks{' (quick)' if quick else ''}",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, load {m['load_avg_1m']} (1 min, at the end); "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| benchmark | status | wall s | headline | results |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        files = ", ".join(r["results"])
        lines.append(f"| {r['benchmark']} | {r['status']} | {r['wall_s']} | {r['headline']} | {files} |")
    return "\n".join(lines) + "\n"


def _machine_of(result: dict[str, Any]) -> str:
    """The machine a result ran on; a result merged from runs on several machines lists each.

    >>> _machine_of({"machine": {"cpu": "AMD EPYC", "cores": 2, "load_avg_1m": 0.4}})
    'AMD EPYC, 2 cores, load 0.4'
    >>> _machine_of({"machine": [{"cpu": "Xeon", "cores": 2, "load_avg_1m": 1.1}, None,
    ...                          {"cpu": "AMD EPYC", "cores": 2, "load_avg_1m": 0.4}]})
    'Xeon, 2 cores, load 1.1; AMD EPYC, 2 cores, load 0.4'
    """
    m = result.get("machine")
    parts = [
        f"{x['cpu']}, {x.get('cores')} cores, load {x.get('load_avg_1m_start', x.get('load_avg_1m'))}"
        for x in (m if isinstance(m, list) else [m])
        if isinstance(x, dict) and "cpu" in x
    ]
    if parts:
        return "; ".join(parts)
    return str(m) if m else "not recorded"


def results_table() -> str:
    """The committed results (`benchmarks/results/<name>.json` of every benchmark) as one markdown
    table: headline figures and the machine each one ran on (they may differ: each is the latest
    full run of that benchmark, not one `bench all` run)."""
    lines = [
        "| benchmark | headline (latest committed run) | machine of that run |",
        "|---|---|---|",
    ]
    for name in benchmarks():
        path = BENCH_DIR / "results" / f"{name}.json"
        shown = ""
        if not path.exists():  # a benchmark that names its files by what it ran (`<name>_<markets>`)
            variants = sorted(
                (BENCH_DIR / "results").glob(f"{name}_*.json"), key=lambda p: (_committed_at(p), p.name)
            )
            if not variants:
                lines.append(f"| {name} | no committed result | |")
                continue
            path = variants[-1]
            shown = f"`{path.name}` (latest of {len(variants)}): "
        result = json.loads(path.read_text())
        lines.append(f"| {name} | {shown}{headline(result)} | {_machine_of(result)} |")
    return "\n".join(lines) + "\n"


def _committed_at(path: Path) -> float:
    """When a result file was last committed (git); its modification time where git cannot say."""
    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%ct", "--", path.name],
            cwd=path.parent, capture_output=True, text=True, timeout=10, check=False,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        out = ""
    return float(out) if out else path.stat().st_mtime


app = typer.Typer(help="Run the benchmarks (benchmarks/*.py): one by name, or all", no_args_is_help=True)


@app.command(
    "all", context_settings={"allow_extra_args": False}, help="Run every benchmark; one markdown table"
)
def all_(
    quick: Annotated[bool, typer.Option(help="Small sizes; committed results left as they are")] = False,
    skip: Annotated[str, typer.Option(help="Comma-separated benchmarks to leave out")] = "",
) -> None:
    from rich.console import Console

    console = Console()
    skipped = {s for s in skip.split(",") if s}
    start = machine()  # before the first benchmark
    rows = []
    for name in benchmarks():
        if name in skipped:
            continue
        if quick and name not in QUICK:  # never a full-size run by surprise (a 30-minute soak)
            rows.append({"benchmark": name, "status": "skipped (no --quick sizes)", "wall_s": 0,
                         "results": [], "headline": ""})  # fmt: skip
            continue
        if name in NEEDS_GPU and not _cuda():
            rows.append({"benchmark": name, "status": "skipped (no GPU)", "wall_s": 0, "results": [],
                         "headline": ""})  # fmt: skip
            continue
        console.print(f"[bold]{name}[/bold] …")
        rows.append(run_one(name, QUICK.get(name, []) if quick else [], quick))
        console.print(f"  {rows[-1]['status']} in {rows[-1]['wall_s']} s {rows[-1]['headline']}")
    out = results_dir() / ("quick" if quick else "") / "bench_all.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(rows, quick))
    write_result(out.with_suffix(".json"), {"machine": start, "runs": rows})
    console.print(out.read_text())
    if any(not str(r["status"]).startswith(("ok", "skipped")) for r in rows):
        raise typer.Exit(1)


TABLE_START, TABLE_END = "<!-- table:start -->", "<!-- table:end -->"


def with_table(page: str, table: str) -> str:
    r"""`page` (benchmarks/RESULTS.md) with the text between its table markers replaced by `table`.

    >>> with_table("a\n<!-- table:start -->\nold\n<!-- table:end -->\nb\n", "| new |\n")
    'a\n<!-- table:start -->\n| new |\n<!-- table:end -->\nb\n'
    """
    head, sep, rest = page.partition(TABLE_START)
    _, sep_end, tail = rest.partition(TABLE_END)
    if not (sep and sep_end):
        raise typer.BadParameter(f"the results page lacks its markers {TABLE_START} … {TABLE_END}")
    return f"{head}{TABLE_START}\n{table}{TABLE_END}{tail}"


@app.command("table", help="The committed results as a table in benchmarks/RESULTS.md (runs nothing)")
def table() -> None:
    if not checkout():
        typer.echo(f"bench table: no committed results here ({BENCH_DIR / 'results'}); it edits a source "
                   "checkout's benchmarks/RESULTS.md", err=True)  # fmt: skip
        raise typer.Exit(2)
    page = BENCH_DIR / "RESULTS.md"
    rows = results_table()
    page.write_text(with_table(page.read_text(), rows))
    print(rows, end="")


def _one(name: str) -> None:
    @app.command(
        name,
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
        help=f"benchmarks/{name}.py (its flags pass through: adstream bench {name} --help)",
        add_help_option=False,
    )
    def cmd(ctx: typer.Context) -> None:
        cmd, where = _command(name, list(ctx.args))
        rc = subprocess.call(cmd, **where)
        raise typer.Exit(rc)


for _name in benchmarks():
    _one(_name)


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False
