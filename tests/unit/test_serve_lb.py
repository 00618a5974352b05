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


def _at(p99: float, errors: int = 0, rps: float = 100.0) -> dict[str, Any]:
    return {"p99_ms": p99, "errors_all_runs": errors, "rps": rps}


def test_p99_at_100_is_not_judged_against_a_direct_replica_that_cannot_carry_100(serve: Any) -> None:
    # EPYC 2026-12-02: one replica served 107 req/s at saturation and shed 517 of 3,000 requests
    # at 100 req/s (P99 65.7 ms, a queue); the balanced case's 77.6 ms read as "1.18 x: met"
    cases = {
        "direct_1": {"capacity": _run(1500.0, 1070, 13930), "at_100": _at(65.66, errors=517)},
        "haproxy_2": {"capacity": _run(1300.0, 1199, 11801), "at_100": _at(77.62, errors=6)},
    }
    assert serve.lb_ratios(cases) == "haproxy_2"
    c = cases["haproxy_2"]
    assert c["p99_at_100_comparable"] is False
    goals = serve.lb_goals(c)
    assert goals["p99_ratio_to_direct_at_100"]["met"] is None  # not judged, and says why
    assert "cannot carry" in goals["p99_ratio_to_direct_at_100"]["why"]
    assert goals["capacity_ratio_to_direct"]["met"] is True


def test_p99_at_100_is_judged_when_the_direct_replica_has_headroom(serve: Any) -> None:
    cases = {
        "direct_1": {"capacity": _run(1500.0, 1820, 13180), "at_100": _at(6.91)},
        "haproxy_2": {"capacity": _run(1300.0, 2709, 10043), "at_100": _at(8.18)},
    }
    serve.lb_ratios(cases)
    c = cases["haproxy_2"]
    assert c["p99_at_100_comparable"] is True
    goals = serve.lb_goals(c)
    assert goals["p99_ratio_to_direct_at_100"]["met"] is True
    c["at_100"]["p99_ms"] = 9.0  # 1.30 x
    serve.lb_ratios(cases)
    assert serve.lb_goals(c)["p99_ratio_to_direct_at_100"]["met"] is False


def test_the_relative_rate_ratio_compares_the_same_share_of_direct_capacity(serve: Any) -> None:
    cases = {
        "direct_1": {
            "capacity": _run(1500.0, 1070, 13930),
            "at_100": _at(65.66, errors=517),
            "at_share": {**_at(9.0, rps=53.0), "rate": 53, "share": 0.5},
        },
        "haproxy_2": {
            "capacity": _run(1300.0, 1199, 11801),
            "at_100": _at(77.62, errors=6),
            "at_share": {**_at(9.9, rps=53.0), "rate": 53, "share": 0.5},
        },
    }
    serve.lb_ratios(cases)
    assert cases["haproxy_2"]["p99_ratio_to_direct_at_share"] == pytest.approx(1.1, abs=1e-3)
    assert serve.lb_share_rate(cases["direct_1"], 0.5) == 53


def _share_cases(direct_runs: list[float], lb_runs: list[float], direct_errors: int = 0) -> dict[str, Any]:
    def at_share(runs: list[float], errors: int) -> dict[str, Any]:
        return {**_at(sorted(runs)[len(runs) // 2], errors=errors, rps=53.0), "p99_ms_runs": runs, "rate": 53}

    return {
        "direct_1": {"capacity": _run(1500.0, 1070, 13930), "at_100": _at(65.66, errors=517),
                     "at_share": at_share(direct_runs, direct_errors)},
        "haproxy_2": {"capacity": _run(1300.0, 1199, 11801), "at_100": _at(77.62, errors=6),
                      "at_share": at_share(lb_runs, 0)},
    }  # fmt: skip


def test_p99_at_the_share_is_judged_by_its_interval_over_the_repeats(serve: Any) -> None:
    """Issue 36 item 6: where one replica cannot carry 100 req/s, P99 through the balancer is
    judged at the same share of the direct replica's capacity (goal <= 1.2 x direct), and only
    when every repeat agrees: the ratio's range over the runs, not the median alone."""
    cases = _share_cases([9.0, 10.0, 11.0], [9.5, 10.0, 10.5])  # 0.86-1.17: under 1.2 whatever the pairing
    serve.lb_ratios(cases)
    goal = serve.lb_goals(cases["haproxy_2"])["p99_ratio_to_direct_at_share"]
    assert goal["goal"] == 1.2 and goal["met"] is True
    assert goal["interval"] == pytest.approx([9.5 / 11.0, 10.5 / 9.0], abs=1e-3)
    cases = _share_cases([9.0, 10.0, 11.0], [13.5, 14.0, 15.0])  # 1.23-1.67: over in every pairing
    serve.lb_ratios(cases)
    assert serve.lb_goals(cases["haproxy_2"])["p99_ratio_to_direct_at_share"]["met"] is False
    cases = _share_cases([9.0, 10.0, 11.0], [10.0, 11.5, 13.0])  # 0.91-1.44: inside the noise
    serve.lb_ratios(cases)
    goal = serve.lb_goals(cases["haproxy_2"])["p99_ratio_to_direct_at_share"]
    assert goal["met"] is None and "noise" in goal["why"]
    cases = _share_cases([9.0, 10.0, 11.0], [9.5, 10.0, 10.5], direct_errors=4)  # the direct replica shed
    serve.lb_ratios(cases)
    goal = serve.lb_goals(cases["haproxy_2"])["p99_ratio_to_direct_at_share"]
    assert goal["met"] is None and "shed" in goal["why"]


def test_the_share_must_be_a_share_of_capacity(serve: Any) -> None:
    import argparse

    assert serve.share("0.5") == 0.5
    for bad in ("0", "-0.2", "1.5", "nan", "half"):
        with pytest.raises(argparse.ArgumentTypeError):
            serve.share(bad)


def test_cpu_parts_count_each_stack_once_for_its_first_part(serve: Any) -> None:
    """A stack under the rank stage that also passes through Ray Serve and asyncio counts for
    rank only; per-request milliseconds are samples / rate / served requests."""
    raw = "\n".join(
        [
            "t;Thread.run (threading.py:982);Replica.call (ray/serve/_private/replica.py:1);"
            "AdServer._rank_batch (serving/app.py:175);RankModel.score (serving/ranking.py:143) 40",
            "t;Thread.run (threading.py:982);Replica.call (ray/serve/_private/replica.py:1) 20",
            "t;Thread.run (threading.py:982) 10",
            "t;main (somewhere.py:1) 10",
            "garbage line without a count",
        ]
    )
    parts = serve.cpu_parts(raw, 200, 10)
    assert parts["rank (model forward, serve.batch)"] == pytest.approx(40 / 200 / 10 * 1000)
    assert parts["Ray Serve (replica, batching, metrics)"] == pytest.approx(10.0)
    assert parts["event loop (asyncio, uvloop)"] == pytest.approx(5.0)
    assert parts["other"] == pytest.approx(5.0)
    assert sum(parts.values()) == pytest.approx(80 / 200 / 10 * 1000)


def test_cpu_summary_needs_both_profiles(serve: Any) -> None:
    floor = {"rate": 50, "cpu_ms_per_request": 1.5, "parts_ms_per_request": {"other": 1.5}}
    served = {"rate": 50, "cpu_ms_per_request": 9.9, "parts_ms_per_request": {"other": 9.0}}
    summary = serve.cpu_summary(floor, served)
    assert summary["cpu_ratio_to_floor"] == pytest.approx(6.6)
    assert summary["floor_parts_ms_per_request"] == {"other": 1.5}
    assert serve.cpu_summary(None, served) is None
    assert serve.cpu_summary(floor, {"error": "no ServeReplica process of app 'bench' found"}) is None


def test_the_profile_rate_is_a_rate_or_zero(serve: Any) -> None:
    """`--profile-rate -5` paced wrk at a negative rate; `0` skips the profile runs."""
    import argparse

    assert serve.rate_or_zero("0") == 0
    assert serve.rate_or_zero("50") == 50
    for bad in ("-5", "2.5", "fifty"):
        with pytest.raises(argparse.ArgumentTypeError):
            serve.rate_or_zero(bad)


def test_model_bounds_say_whether_the_model_alone_leaves_room_for_the_goals(serve: Any) -> None:
    """The model floor's capacity over the floor's bounds the ad server's capacity ratio: a goal
    above that bound cannot be met by any one-replica server of this model on the machine."""
    model = {"capacity": {"capacity_rps": 420}, "at_100": {"p99_ms": 6.5}}
    b = serve.model_bounds(1750, 2.4, model, 100, 26.8)
    assert b["capacity_bound_ratio"] == pytest.approx(0.24)
    assert b["capacity_ratio_to_model_floor"] == pytest.approx(0.238, abs=1e-3)
    assert b["p99_over_model_floor_ms_at_100"] == pytest.approx(20.3)
    assert b["goal_reachable"] == {"capacity": False, "p99_at_100": True}
    slow_model = {"capacity": {"capacity_rps": 300}, "at_100": {"p99_ms": 13.0}}
    roomy = serve.model_bounds(1000, 2.0, slow_model, 1, None)
    assert roomy["goal_reachable"] == {"capacity": True, "p99_at_100": False}
    assert roomy["p99_over_model_floor_ms_at_100"] is None
    assert serve.model_bounds(1750, 2.4, None, 100, 26.8) is None


def test_a_serve_run_keeps_the_sections_other_runs_wrote(serve: Any) -> None:
    """serve.json's routes (benchmarks.serve_routes), load_balanced and hung_redis are each written
    by their own command: a plain `benchmarks.serve` run must keep them (it dropped `routes`)."""
    previous = {
        "capacity_rps": 110,
        "routes": {"events": {"events_per_s": 9}},
        "load_balanced": {"ingress": "haproxy_2"},
        "hung_redis": {"p99_ms": 80.0},
    }
    result: dict[str, object] = {"capacity_rps": 170}
    serve.keep_sections(result, previous)
    assert result == {**previous, "capacity_rps": 170}
    remeasured: dict[str, object] = {"capacity_rps": 170, "hung_redis": {"p99_ms": 50.0}}
    serve.keep_sections(remeasured, previous)
    assert remeasured["hung_redis"] == {"p99_ms": 50.0}


def _hist(rng: Any, p99_ms: float, n: int = 900) -> list[list[int]]:
    """wrk's [latency µs, count] pairs of `n` requests whose tail sits near `p99_ms`."""
    import numpy as np

    values = np.round(rng.gamma(4.0, p99_ms * 1000 / 10.0, n)).astype(int)
    unique, counts = np.unique(values, return_counts=True)
    return [[int(v), int(c)] for v, c in zip(unique, counts, strict=True)]


def test_p99_at_the_share_is_judged_by_every_request_when_the_latencies_are_there(serve: Any) -> None:
    """With each repeat's latencies (`hist`), the share goal's interval is a bootstrap over the
    repeats and their requests of the pooled P99 ratio: tighter than the range of the repeats'
    P99s, which only grows with more repeats; the range stays for older results."""
    import numpy as np

    rng = np.random.default_rng(1)
    cases = _share_cases([9.0, 10.0, 11.0], [9.5, 10.0, 10.5])
    cases["direct_1"]["at_share"]["hists"] = [_hist(rng, 10.0) for _ in range(3)]
    cases["haproxy_2"]["at_share"]["hists"] = [_hist(rng, 10.0) for _ in range(3)]
    serve.lb_ratios(cases)
    c = cases["haproxy_2"]
    low, high = c["p99_ratio_to_direct_at_share_interval"]
    assert low < c["p99_ratio_to_direct_at_share_pooled"] < high
    goal = serve.lb_goals(c)["p99_ratio_to_direct_at_share"]
    assert goal["interval"] == [low, high] and goal["measured"] == c["p99_ratio_to_direct_at_share_pooled"]
    assert goal["met"] is (True if high <= 1.2 else None)
    cases["haproxy_2"]["at_share"]["hists"] = [_hist(rng, 20.0) for _ in range(3)]  # twice as slow
    serve.lb_ratios(cases)
    assert serve.lb_goals(cases["haproxy_2"])["p99_ratio_to_direct_at_share"]["met"] is False
