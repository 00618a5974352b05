"""`benchmarks/serve_ab.py`: the paired CPU comparison's statistics and its refusals of bad
arguments (a clear error, never a run that measures nothing)."""

from __future__ import annotations

import pytest

from benchmarks import serve_ab


def test_paired_ratios_are_per_round_and_their_interval_holds_the_median() -> None:
    r = serve_ab.paired([10.0, 12.0, 11.0, 13.0], [9.0, 10.8, 9.9, 11.7])
    assert r["median"] == pytest.approx(0.9) and r["ci95"] == [0.9, 0.9]  # every round 0.9
    assert (r["mean_a"], r["mean_b"], r["rounds"]) == (11.5, 10.35, 4)
    with pytest.raises(ValueError, match="paired rounds"):
        serve_ab.paired([1.0, 2.0], [1.0])


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--refs", "HEAD"], "expected 2 arguments"),
        (["--refs", "HEAD", "HEAD", "--rates", "50,x"], "comma-separated"),
        (["--refs", "HEAD", "HEAD", "--rates", "0"], "at least 1 request/s"),
        (["--refs", "HEAD", "HEAD", "--rounds", "1"], "must be at least 2"),
    ],
)
def test_bad_arguments_exit_2_naming_them(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        serve_ab.parse_args(argv)
    assert exit_.value.code == 2 and said in capsys.readouterr().err


def test_a_ref_git_does_not_know_is_named() -> None:
    with pytest.raises(SystemExit, match="'no-such-ref-xyz' is not a commit"):
        serve_ab.resolve("no-such-ref-xyz")
    assert serve_ab.resolve(".") == "working tree"
    assert len(serve_ab.resolve("HEAD")) == 12
