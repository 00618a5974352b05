"""`adstream bench`: every benchmark script is a command; `bench all --quick` keeps committed results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deploy import cli_bench


def test_every_benchmark_script_is_listed_and_a_command() -> None:
    names = cli_bench.benchmarks()
    assert {"freshness", "online_drift", "serve", "streams"} <= set(names)
    import typer.main

    from deploy.cli import app

    bench = typer.main.get_command(app).commands["bench"]  # type: ignore[attr-defined]
    assert {"all", *names} <= set(bench.commands)
    assert set(cli_bench.QUICK) <= set(names), "QUICK names a benchmark that does not exist"


def test_headline_takes_the_judged_figures_when_a_result_gathers_them() -> None:
    got = cli_bench.headline(
        {"machine": {"cores": 2}, "figures": {"sink_rows_per_s": 437649, "shapley_1m_paths_s": 0.179}}
    )
    assert got == "sink_rows_per_s=437649, shapley_1m_paths_s=0.179"


def test_headline_prefers_goals_and_percentiles() -> None:
    got = cli_bench.headline({"trials": 120, "p99_s": 1.234567, "goal_met": True, "hops": {}, "note": "x"})
    assert got.startswith("p99_s=1.235, goal_met=True") and "trials=120" in got and "note" not in got


def test_headline_shows_a_judged_cost_ratio_beside_its_goal() -> None:
    result = {"lora_rank": 8, "candidates_per_s_base": 762777, "adapter_cost_fraction": 0.2}
    result |= {"folded_adapters_cost_ratio": 1.0173, "folded_adapters_goal": 1.02, "torch_threads": 1}
    got = cli_bench.headline(result, n=3)
    assert got == "candidates_per_s_base=762777, folded_adapters_cost_ratio=1.017, folded_adapters_goal=1.02"


def _fake_bench(root: Path, body: str) -> None:
    (root / "benchmarks" / "results").mkdir(parents=True)
    (root / "benchmarks" / "fake.py").write_text(body)


def test_quick_run_writes_only_under_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_bench(
        tmp_path,
        "import argparse, json, pathlib\n"
        "ap = argparse.ArgumentParser(); ap.add_argument('--small', action='store_true')\n"
        "here = pathlib.Path(__file__).parent\n"
        "ap.add_argument('--out', type=pathlib.Path, default=here / 'results' / 'fake.json')\n"
        "a = ap.parse_args()\n"
        "a.out.write_text(json.dumps({'p50_s': 0.5, 'small': a.small}))\n",
    )
    committed = tmp_path / "benchmarks" / "results" / "fake.json"
    committed.write_text('{"p50_s": 9.0}')
    monkeypatch.setattr(cli_bench, "BENCH_DIR", tmp_path / "benchmarks")
    row = cli_bench.run_one("fake", ["--small"], quick=True)
    assert row["status"] == "ok" and row["headline"] == "p50_s=0.5, small=True"
    assert committed.read_text() == '{"p50_s": 9.0}'  # the committed figures are untouched
    quick = tmp_path / "benchmarks" / "results" / "quick" / "fake.json"
    assert json.loads(quick.read_text()) == {"p50_s": 0.5, "small": True}
    assert row["results"] == ["benchmarks/results/quick/fake.json"]
    full = cli_bench.run_one("fake", [], quick=False)
    assert full["headline"] == "p50_s=0.5, small=False"
    assert full["results"] == ["benchmarks/results/fake.json"]


def test_a_failing_benchmark_is_reported_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_bench(tmp_path, "raise SystemExit('broken: no data')\n")
    monkeypatch.setattr(cli_bench, "BENCH_DIR", tmp_path / "benchmarks")
    row = cli_bench.run_one("fake", [], quick=False)
    assert row["status"].startswith("failed (1)") and "broken: no data" in row["status"]
    table = cli_bench.markdown([row], quick=False)
    assert "| fake | failed (1)" in table and "cores" in table


def test_bench_all_help_runs() -> None:
    from deploy.cli import app

    res = CliRunner().invoke(app, ["bench", "all", "--help"])
    assert res.exit_code == 0 and "--quick" in res.output


def test_results_table_has_a_row_per_benchmark_with_its_machine() -> None:
    from deploy.cli_bench import benchmarks, results_table

    rows = results_table().splitlines()[2:]
    assert [r.split(" | ")[0].lstrip("| ") for r in rows] == benchmarks()
    fresh = next(r for r in rows if r.startswith("| freshness |"))
    assert "p99_s=" in fresh and "cores" in fresh  # headline figures and the machine they ran on


def test_a_benchmark_that_names_its_files_by_run_shows_its_latest_committed_one() -> None:
    """`attribution_truth_seeds` writes `attribution_truth_seeds_<markets>.json`, never
    `<name>.json`: the table shows the latest committed of those (git's order), named, with its
    machine."""
    from deploy.cli_bench import results_table

    row = next(r for r in results_table().splitlines() if r.startswith("| attribution_truth_seeds |"))
    assert "no committed result" not in row and "`attribution_truth_seeds_" in row and "cores" in row, row
