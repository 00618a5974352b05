"""benchmarks/freshness.py records the loop's settings with its result.

Its list still named the flat settings of before issue 17 (`label_mode`, …): every run crashed
after its 120 trials, while writing the result (2026-12-02), and lost them.
"""

from __future__ import annotations

from schemas.settings import Settings
from tests.support.benchmarks import load_benchmark


def test_the_settings_summary_reads_every_setting_it_names() -> None:
    s = Settings()
    summary = load_benchmark("freshness").settings_summary(s)
    assert summary["online.label_mode"] == s.online.label_mode
    assert summary["streams.attribution_window_s"] == s.streams.attribution_window_s
    assert summary["adapter_scheme"] == s.adapter_scheme
    assert len(summary) >= 8
