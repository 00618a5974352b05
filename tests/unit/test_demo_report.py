"""`adstream demo`'s report from samples: phase means, the explanation, markdown and plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

from deploy.demo import explain
from deploy.demo_live import QUALITY_SERIES, Sample, markdown, phase_means, write_report


def _samples() -> list[Sample]:
    out = []
    for i in range(40):
        drifted = i >= 20
        out.append(
            Sample(
                t_s=float(i), requests=30 * i, events=10 * i, impressions=90 * i, p99_ms=20.0 + i % 3,
                served_auc=0.72, oracle_auc=0.86, population_auc=0.65,
                online_auc=0.70 + (0.02 if drifted and i > 30 else 0.0),
                base_auc=0.70 - (0.05 if drifted else 0.0),
                examples=100.0 * i, adapters={"feed": f"seq-{i}"}, drifted=drifted,
            )
        )  # fmt: skip
    return out


def test_phase_means_take_the_last_quarter_of_each_phase() -> None:
    m = phase_means(_samples(), "base_auc")
    assert m["before_drift"] == 0.70 and abs(m["end"] - 0.65) < 1e-12
    online = phase_means(_samples(), "online_auc")
    assert online["end"] == 0.72
    # a phase with no finite figure is NaN, not an error
    nan = phase_means([*_samples()[:3]], "online_auc")
    assert math.isnan(nan["end"])


def test_report_files_and_every_quality_series_named(tmp_path: Path) -> None:
    samples = _samples()
    quality = {k: phase_means(samples, k) for k in QUALITY_SERIES}
    train = {"ranker": {"auc": 0.69}}
    truth = {"oracle_auc": 0.86, "impressions": 20_000, "users": 400}
    report = {
        "started": "now", "machine": "test", "spec": {"seed": 7, "users": 400, "ads": 300, "history": 20_000,
        "rate": 30.0, "drift_mode": "handover"}, "loop": {"requests": 1200, "served": 3600, "errors": {},
        "p50_ms": 10.0, "p99_ms": 22.0}, "quality": quality,
        "offline": {"holdout_auc": 0.69, "oracle_auc": 0.86},
        "explanation": explain(train, truth, quality), "adapters_end": {"feed": "seq-39"}, "clickhouse": {},
    }  # fmt: skip
    write_report(tmp_path, report, samples)
    assert {"report.md", "report.json", "auc_over_time.png", "latency.png"} <= {
        p.name for p in tmp_path.iterdir()
    }
    md = (tmp_path / "report.md").read_text()
    assert "0.650" in md and "taste" in md  # the taste-blind oracle is reported and used to explain
    assert "+0.070" in " ".join(report["explanation"])  # served − taste-blind, measured
    assert len(json.loads((tmp_path / "report.json").read_text())["samples"]) == 40
    assert markdown(report).startswith("# adstream demo")


def test_a_bad_market_option_fails_before_anything_starts(tmp_path: Path) -> None:
    import pytest

    from deploy.demo import DemoSpec, run_demo
    from schemas.errors import ConfigError
    from schemas.settings import Settings

    with pytest.raises(ConfigError, match="drift_mode='bogus'"):
        run_demo(DemoSpec(drift_mode="bogus"), Settings(state_dir=tmp_path), print)
    assert not (tmp_path / "demo").exists()  # no run folder, no topics, no processes


def test_report_shows_ab_lift_paired_auc_resets_and_exploration_with_intervals(tmp_path: Path) -> None:
    from deploy.cli_demo import summary_table
    from deploy.demo_live import live_rows

    samples = _samples()
    quality = {k: phase_means(samples, k) for k in QUALITY_SERIES}
    curves = [
        {"end": float(e), "after_drift": float(e >= 3000), "online": 0.7, "online_lo": 0.65,
         "online_hi": 0.75, "frozen": 0.68, "frozen_lo": 0.63, "frozen_hi": 0.73}
        for e in range(1500, 6001, 500)
    ]  # fmt: skip
    live = {
        "ctr_lift_before": {"mean": -0.01, "ci_low": -0.08, "ci_high": 0.06},
        "ctr_lift_after": {"mean": 0.12, "ci_low": 0.03, "ci_high": 0.21},
        "adapter_lift_after": {"error": "arm 'correction' has no traffic in the range"},
        "adapter_lift_after_shadow": {"mean": 0.05, "ci_low": 0.01, "ci_high": 0.09},
        "auc_online_minus_frozen_after": {"mean": 0.02, "ci_low": 0.005, "ci_high": 0.035},
        "resets": 1, "resets_per_adapter_hour": 2.0,
        "exploration_ctr_cost": {"relative_cost": {"mean": 0.3, "ci_low": 0.1, "ci_high": 0.5}},
        "curves": curves,
    }  # fmt: skip
    report = {
        "started": "now", "machine": "test", "spec": {"seed": 7, "users": 400, "ads": 300, "history": 20_000,
        "rate": 30.0, "drift_mode": "handover"}, "loop": {"requests": 1200, "served": 3600, "errors": {},
        "p50_ms": 10.0, "p99_ms": 22.0}, "quality": quality,
        "offline": {"holdout_auc": 0.69, "oracle_auc": 0.86}, "explanation": [], "adapters_end": {},
        "clickhouse": {}, "live": live,
    }  # fmt: skip
    write_report(tmp_path, report, samples)
    assert (tmp_path / "auc_smoothed.png").exists()
    md = (tmp_path / "report.md").read_text()
    assert "+12.0% (95 % interval +3.0% … +21.0%)" in md  # the lift with its interval
    assert "+0.0200 (95 % interval +0.0050 … +0.0350)" in md
    assert "no traffic" in md and "2.0 per adapter-hour" in md and "30.0% (95 % interval" in md
    rows = dict(live_rows(live))
    assert rows["guard resets"] == "1 (2.0 per adapter-hour)"
    assert "+5.0% (95 % interval +1.0% … +9.0%)" in md  # the adapters on the same requests
    assert live_rows(None) == [("live figures", "not measured")]
    assert summary_table({**report, "adapters_end": {}}).row_count >= len(rows)
