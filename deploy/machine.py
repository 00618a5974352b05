"""The machine a measurement ran on: every benchmark and report records it with its figures.

Machines of the same class differ (the same 2-core box has come with a Xeon and with an EPYC that
runs the ranker 2× slower), so a figure without its CPU model, core count and load means little.
"""

from __future__ import annotations

import os
import platform
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
