"""`benchmarks/hotswap.py`'s load: a fixed --rate, or by default a share of the capacity it
measures first in the same run (issue 33: hot swap at 80 % of capacity); bad values exit 2."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import hotswap


def test_the_default_load_is_eighty_percent_of_the_capacity_measured_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[Any] = []

    def found(url: str, ns: Any) -> dict[str, Any]:
        seen.append((url, ns.capacity_conns, ns.duration, ns.capacity_steps))
        return {"capacity_rps": 170, "steps": [{"target_rps": 170, "passed": True}]}

    monkeypatch.setattr(hotswap, "capacity", found)
    args = hotswap.parse_args([])
    assert args.rate is None and args.load_share == 0.8
    rate, cap = hotswap.load_rate("http://x", args)
    assert rate == 136 and cap is not None and cap["capacity_rps"] == 170
    assert seen == [("http://x", hotswap.CAPACITY_CONNS, hotswap.CAPACITY_STEP_S, hotswap.CAPACITY_STEPS)]
    # a fixed rate measures nothing
    assert hotswap.load_rate("http://x", hotswap.parse_args(["--rate", "100"])) == (100, None)
    assert len(seen) == 1


def test_no_passing_rate_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hotswap, "capacity", lambda url, ns: {"capacity_rps": 0, "steps": []})
    with pytest.raises(SystemExit, match="no paced rate passed"):
        hotswap.load_rate("http://x", hotswap.parse_args([]))


BAD = [["--rate", "0"], ["--rate", "x"], ["--load-share", "0"], ["--load-share", "2"], ["--duration", "4"]]


@pytest.mark.parametrize("argv", BAD)
def test_bad_values_exit_2_naming_them(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        hotswap.parse_args(argv)
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err
