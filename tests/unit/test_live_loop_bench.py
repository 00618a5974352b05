"""benchmarks/live_loop.py's flags: sizes, --quick, --set, and shares refused naming the value."""

from __future__ import annotations

import pytest

from tests.support.benchmarks import load_benchmark


def test_quick_and_overrides_become_the_loops_settings() -> None:
    ll = load_benchmark("live_loop")
    args = ll.parse(["--quick", "--set", "ONLINE__LR=0.001", "--control-share", "0.2"])
    assert args.seeds == [1] and args.requests == ll.QUICK["requests"]
    env = ll.ab_env(args)
    assert env["ADSTREAM_ONLINE__LR"] == "0.001"
    assert env.get("ADSTREAM_AB__CONTROL_SHARE", "0.2") == "0.2"


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--control-share", "1.0"], "--control-share 1.0"),
        (["--correction-share", "-0.1"], "--correction-share -0.1"),
        (["--control-share", "0.5", "--correction-share", "0.5"], "must leave users"),
        (["--set", "LR=0.1"], "'LR=0.1'"),
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
