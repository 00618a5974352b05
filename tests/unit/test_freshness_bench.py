"""benchmarks/freshness.py records the loop's settings with its result.

Its list still named the flat settings of before issue 17 (`label_mode`, …): every run crashed
after its 120 trials, while writing the result (2026-12-02), and lost them.
"""

from __future__ import annotations

import numpy as np

from schemas.settings import Settings
from tests.support.benchmarks import load_benchmark


def test_the_settings_summary_reads_every_setting_it_names() -> None:
    s = Settings()
    summary = load_benchmark("freshness").settings_summary(s)
    assert summary["online.label_mode"] == s.online.label_mode
    assert summary["streams.attribution_window_s"] == s.streams.attribution_window_s
    assert summary["adapter_scheme"] == s.adapter_scheme
    assert len(summary) >= 8


def test_the_summary_reports_every_hop_and_the_seeing_polls_round_trip() -> None:
    """Per hop P50/P99 over the completed trials, failures counted by kind, and the round trip
    of the poll that saw each delta (the HTTP share of the replica hop on a busy machine)."""
    bench = load_benchmark("freshness")
    ok = [
        bench.Trial(
            f"u{i}", total_s=0.2 + i / 100, hops={h: 0.01 * (i + 1) for h in bench.HOPS}, poll_rtt_s=0.01 * i
        )
        for i in range(10)
    ]
    res = bench.summarize([*ok, bench.Trial("x", error="not_served")])
    assert res["trials"] == 10 and res["attempted"] == 11 and res["failed"] == {"not_served": 1}
    assert set(res["hops"]) == set(bench.HOPS) and res["hops"]["trainer"]["p50_s"] == 0.055
    assert res["poll_rtt"]["p50_s"] == 0.045
    assert bench.GOAL_P99_S == 0.5 and bench.GOAL_TRIALS == 100  # issue 35


def test_the_p99_goal_is_decided_by_its_interval_not_by_the_point() -> None:
    """A P99 under the goal over 120 trials is not 'met' (2026-12-03: P99 0.479 s, max 0.497 s,
    recorded as met): 120 draws put the true P99 above their largest with probability
    0.99^120 = 0.30, so the order-statistic interval has no upper end and the goal is undecided.
    Over 400 trials all under the goal, the interval's upper end is under it: met. All over: not."""
    bench = load_benchmark("freshness")

    def trials(totals: list[float]) -> list[object]:
        return [bench.Trial(f"u{i}", total_s=t, hops={}) for i, t in enumerate(totals)]

    rng = np.random.default_rng(0)
    short = bench.summarize(trials(list(rng.uniform(0.1, 0.49, 120))))
    assert short["p99_interval_s"][1] is None and bench.judge(short) is None
    long = bench.summarize(trials(list(rng.uniform(0.1, 0.49, 400))))
    low, high = long["p99_interval_s"]
    assert low is not None and high is not None and low <= long["p99_s"] <= high < 0.5
    assert bench.judge(long) is True
    slow = bench.summarize(trials(list(rng.uniform(0.6, 0.9, 400))))
    assert bench.judge(slow) is False
    failed = bench.summarize(
        [*trials(list(rng.uniform(0.1, 0.49, 400))), bench.Trial("x", error="not_served")]
    )
    assert bench.judge(failed) is False  # a lost trial is a failure, whatever the others say
