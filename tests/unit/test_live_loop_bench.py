"""benchmarks/live_loop.py's flags: sizes, --quick, --set, and shares refused naming the value."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.support.benchmarks import load_benchmark


def test_quick_and_overrides_become_the_loops_settings() -> None:
    ll = load_benchmark("live_loop")
    args = ll.parse(["--quick", "--set", "ONLINE__LR=0.001", "--control-share", "0.2"])
    assert args.seeds == [1] and args.requests == ll.QUICK["requests"]
    env = ll.ab_env(args)
    assert env["ADSTREAM_ONLINE__LR"] == "0.001"
    assert env.get("ADSTREAM_AB__CONTROL_SHARE", "0.2") == "0.2"
    # the demo's market unless asked otherwise: half the users' season hands over
    assert (args.drift_mode, args.drift_share) == ("handover", 0.5)
    assert env["ADSTREAM_AB__SHADOW_SLATES"] == "true"  # the paired adapter figure


@pytest.mark.parametrize(("argv", "on"), [([], True), (["--no-shadow-slates"], False)])
def test_shadow_slates_reach_the_loops_serving_settings(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], on: bool
) -> None:
    from schemas.settings import Settings

    ll = load_benchmark("live_loop")
    for k, v in ll.ab_env(ll.parse(["--quick", *argv])).items():
        monkeypatch.setenv(k, v)
    assert Settings(_env_file=None).ab.shadow_slates is on


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--control-share", "1.0"], "--control-share 1.0"),
        (["--correction-share", "-0.1"], "--correction-share -0.1"),
        (["--control-share", "0.5", "--correction-share", "0.5"], "must leave users"),
        (["--set", "LR=0.1"], "'LR=0.1'"),
        (["--drift-mode", "season"], "'season'"),
        (["--drift-share", "1.5"], "--drift-share 1.5"),
    ],
)
def test_bad_sizes_exit_2_naming_the_value(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ll = load_benchmark("live_loop")
    with pytest.raises(SystemExit) as exc:
        ll.parse(argv)
    assert exc.value.code == 2 and named in capsys.readouterr().err


def test_decides_reads_the_interval_half_width() -> None:
    ll = load_benchmark("live_loop")
    assert ll.decides({"mean": 0.1, "ci_low": 0.06, "ci_high": 0.14}) is True
    assert ll.decides({"mean": 0.1, "ci_low": -0.1, "ci_high": 0.3}) is False
    assert ll.decides({"error": "no arm"}) is None


def _run(seeds: list[int], lift: tuple[float, float, float], resets: int = 0) -> dict[str, object]:
    mean, lo, hi = lift
    entry = {"mean": mean, "ci_low": lo, "ci_high": hi, "users": 100}
    return {
        "ctr_lift_after": entry,
        "adapter_lift_after": entry,
        "ctr_lift_before": entry,
        "auc_online_minus_frozen_before": {"mean": 0.02, "ci_low": 0.01, "ci_high": 0.03},
        "auc_online_minus_frozen_after": {"mean": 0.02, "ci_low": 0.01, "ci_high": 0.03},
        "seeds": [{"seed": s} for s in seeds],
        "resets": resets,
        "resets_per_adapter_hour": 0.5 * resets,
        "exploration_ctr_cost": {"relative_cost": {"mean": 0.4, "ci_low": 0.3, "ci_high": 0.5}},
        "impressions": 1000,
    }


def test_merge_pooled_weighs_runs_by_their_intervals(tmp_path: Path) -> None:

    ll = load_benchmark("live_loop")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    # on the log-ratio scale: a = log 1.2 ± 0.1, b = log 1.0 ± 0.2 (1.96 se each): weights 4 : 1
    la, lb = math.log(1.2), 0.0
    a.write_text(
        json.dumps({"runs": {"loaded": _run([1, 2], (0.2, math.expm1(la - 0.1), math.expm1(la + 0.1)), 1)}})
    )
    b.write_text(
        json.dumps({"runs": {"loaded": _run([3], (0.0, math.expm1(lb - 0.2), math.expm1(lb + 0.2)))}})
    )
    merged = ll.merge_pooled([a, b])["runs"]["loaded"]
    y = (4 * la + lb) / 5
    half = 1.96 * math.sqrt(1 / (1 / (0.1 / 1.96) ** 2 + 1 / (0.2 / 1.96) ** 2))
    got = merged["ctr_lift_after"]
    assert got["mean"] == pytest.approx(math.expm1(y))
    assert got["ci_low"] == pytest.approx(math.expm1(y - half), rel=1e-6)
    assert got["ci_high"] == pytest.approx(math.expm1(y + half), rel=1e-6)
    assert got["users"] == 200
    assert [s["seed"] for s in merged["seeds"]] == [1, 2, 3] and merged["resets"] == 1
    assert merged["resets_per_adapter_hour"] == 0.5  # the larger of the runs' rates
    # a merged result merges again: its machines stay one flat list, one per run
    m1, m2 = {"cpu": "Xeon", "cores": 2}, {"cpu": "EPYC", "cores": 2}
    a.write_text(json.dumps(json.loads(a.read_text()) | {"machine": [m1, m2]}))
    b.write_text(json.dumps(json.loads(b.read_text()) | {"machine": m2}))
    assert ll.merge_pooled([a, b])["machine"] == [m1, m2, m2]
    # runs that share a seed are one run split: they must be pooled, not weighed
    b.write_text(json.dumps({"runs": {"loaded": _run([2], (0.0, -0.1, 0.1))}}))
    with pytest.raises(SystemExit, match="share seeds"):
        ll.merge_pooled([a, b])


def test_seed_level_interval_widens_with_the_spread_between_seeds() -> None:
    """Seeds that agree within their own intervals: the random-effects interval is the
    fixed-effect one (τ = 0, Hartung–Knapp's scale held at 1, t not z); seeds that disagree
    beyond them (τ > 0): wider, and Cochran's Q says so."""
    ll = load_benchmark("live_loop")
    agree = [{"mean": m, "ci_low": m - 0.1, "ci_high": m + 0.1} for m in (0.09, 0.1, 0.11, 0.1, 0.1)]
    fixed = ll.inverse_variance(agree, log_ratio=False)
    re = ll.random_effects(agree, log_ratio=False)
    assert re["tau"] == 0.0 and re["q_p"] > 0.5
    assert re["mean"] == pytest.approx(fixed["mean"])
    assert re["ci_high"] - re["ci_low"] > fixed["ci_high"] - fixed["ci_low"]  # t(4) > z
    apart = [{"mean": m, "ci_low": m - 0.1, "ci_high": m + 0.1} for m in (-0.3, 0.1, 0.5, 0.1, 0.1)]
    wide = ll.random_effects(apart, log_ratio=False)
    assert wide["tau"] > 0.2 and wide["q_p"] < 0.01 and wide["ci_low"] < 0
    assert ll.random_effects(agree[:1], log_ratio=False)["error"].startswith("1 seed")


def test_every_run_gets_its_seed_level_lifts() -> None:
    ll = load_benchmark("live_loop")
    seed = {"ctr_lift_after": {"mean": 0.1, "ci_low": 0.0, "ci_high": 0.2}}
    runs = ll.seed_level({"quiet": {"seeds": [seed, seed, seed]}, "loaded": {"error": "every seed failed"}})
    assert runs["quiet"]["ctr_lift_after_seeds"]["seeds"] == 3
    assert "ctr_lift_after_seeds" not in runs["loaded"]
    assert "adapter_lift_after_seeds" not in runs["quiet"]  # no seed has it
