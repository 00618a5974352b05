"""benchmarks/serve.py --load-balanced: capacity is served requests per second, not answers.

An unpaced run against a saturated replica is answered mostly by fast 503s. The ratio used to
divide those answer rates, so the balanced case read 0.81–0.87 × direct while it served 1.6×
the requests (EPYC, 2026-12-01: 1,836 vs 1,149 200s in 10 s).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def serve() -> Any:
    return load_benchmark("serve")


def _run(rps: float, ok: int, shed: int, p99: float = 10.0) -> dict[str, Any]:
    return {"rps": rps, "requests": ok + shed, "codes": {"200": ok, "503": shed}, "p99_ms": p99}


def test_capacity_counts_only_the_served_requests(serve: Any) -> None:
    assert serve.ok_rps(_run(1197.2, 1149, 10836)) == pytest.approx(114.8, abs=0.1)
    cases = {
        "direct_1": {"capacity": _run(1197.2, 1149, 10836), "at_100": {"p99_ms": 13.5}},
        "haproxy_2": {
            "capacity": _run(971.4, 1836, 7894),
            "at_100": {"p99_ms": 12.4},
            "same_deployment_direct": {"capacity": _run(1200.0, 1186, 12045), "at_100": {"p99_ms": 12.9}},
        },
    }
    assert serve.lb_ratios(cases) == "haproxy_2"
    c = cases["haproxy_2"]
    assert c["capacity_ratio_to_direct"] == pytest.approx(1.6, abs=0.01)  # not 971 / 1197 = 0.81
    assert c["p99_ratio_to_direct_at_100"] == pytest.approx(12.4 / 13.5, abs=1e-3)
    assert c["capacity_ratio_to_same_deployment_direct"] == pytest.approx(1.71, abs=0.01)


def test_no_direct_case_no_ratio(serve: Any) -> None:
    assert serve.lb_ratios({"haproxy_2": {"capacity": _run(10, 5, 5), "at_100": {"p99_ms": 1.0}}}) is None
