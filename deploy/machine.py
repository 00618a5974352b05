"""The machine a measurement ran on: every benchmark and report records it with its figures.

Machines of the same class differ (the same 2-core box has come with a Xeon and with an EPYC that
runs the ranker 2× slower), so a figure without its CPU model, core count and load means little.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's model name (`/proc/cpuinfo`), or what `platform` knows elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """CPU model, cores and 1-minute load average (the load says how busy the machine was).

    >>> sorted(machine())
    ['cores', 'cpu', 'load_avg_1m']
    """
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "load_avg_1m": round(load, 2)}


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) process `pid` has used so far (Linux `/proc`).

    >>> process_cpu_s(os.getpid()) >= 0
    True
    """
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def describe(m: dict[str, Any] | None = None) -> str:
    """One line for a report: `Intel(R) Xeon(R) …, 2 cores, load 1.20`."""
    m = m or machine()
    return f"{m['cpu']}, {m['cores']} cores, load {m['load_avg_1m']:.2f}"


def command_line(argv: Sequence[str] | None = None, python: str | None = None) -> str:
    """The command that reproduces a result: this interpreter, the benchmark as a module of the
    `benchmarks` package (`.venv/bin/python -m benchmarks.rank --quick`; another script relative
    to the current folder when it lies under it), then the arguments as given, shell-quoted.

    >>> command_line(["benchmarks/rank.py", "--out", "a b.json"], python="/usr/bin/python3")
    "/usr/bin/python3 -m benchmarks.rank --out 'a b.json'"
    >>> command_line(["tools/x.py"], python="/usr/bin/python3")
    '/usr/bin/python3 tools/x.py'
    """
    argv = list(sys.argv if argv is None else argv)
    script = Path(_relative(argv[0]))
    if script.parent == Path("benchmarks") and script.suffix == ".py":
        return shlex.join([_relative(python or sys.executable), "-m", f"benchmarks.{script.stem}", *argv[1:]])
    return shlex.join([_relative(python or sys.executable), str(script), *argv[1:]])


def _relative(path: str) -> str:
    """`path` relative to the current folder when it lies under it (absolute paths of this checkout
    say nothing to another one), else unchanged. The interpreter's link is kept: `.venv/bin/python`,
    not the system Python it points to."""
    p = Path(path).absolute()
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return path


def write_result(
    path: Path,
    result: dict[str, Any],
    *,
    section: str | None = None,
    base: dict[str, Any] | None = None,
    argv: Sequence[str] | None = None,
    default: Callable[[Any], Any] | None = None,
) -> None:
    """Write a benchmark's result file (indented JSON) with what every result records: the machine
    it ran on (`machine`: CPU model, cores, the load at the start; a benchmark's own record is kept
    and completed) with the load at the end (`load_avg_1m_end`), and the `command` that reproduces
    it. The one writer of `benchmarks/results/*.json`: a figure without its machine and command
    cannot be compared or re-run.

    With `section`, `result` is one part of a file another run wrote (`serve.py --load-balanced`
    adds `load_balanced` to `serve.json`): it goes under that key, stamped with its own machine
    and command, and the rest of the file stays as that run left it (or is `base`, when given:
    that file's content as the caller updated it).

    >>> import tempfile
    >>> out = Path(tempfile.mkdtemp()) / "r.json"
    >>> write_result(out, {"p99_ms": 1.5}, argv=["benchmarks/x.py", "--quick"], default=str)
    >>> r = json.loads(out.read_text())
    >>> sorted(r), sorted(r["machine"]), r["command"].endswith("-m benchmarks.x --quick")
    (['command', 'machine', 'p99_ms'], ['cores', 'cpu', 'load_avg_1m', 'load_avg_1m_end'], True)
    """
    now = machine()
    own = result.get("machine")
    if own is None or isinstance(own, dict):
        # the benchmark's own record (taken at its start) wins; what it lacks comes from now
        result["machine"] = {**now, **(own or {}), "load_avg_1m_end": now["load_avg_1m"]}
    else:  # a record of another shape (one per part of a combined run): kept, the machine beside it
        result["machine_end"] = now
    result["command"] = command_line(argv)
    data = result
    if section is not None:
        if base is None:
            base = json.loads(path.read_text()) if path.exists() else {}
        data = base
        data[section] = result
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=default) + "\n")
