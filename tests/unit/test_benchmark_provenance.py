"""Every benchmark's result file records the machine it ran on and the command that reproduces it.

Machines of the same class differ by 2× (a Xeon and an EPYC), so a figure without its CPU model,
cores, load and command cannot be compared or re-run. Before this test, half the committed result
files lacked the command, `hotswap.json` had no machine at all and `produce.json` had neither CPU
model nor load, each benchmark writing its own JSON (five renderings of the command, three local
copies of `machine()`). One writer now stamps both: `deploy.machine.write_result`.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

from deploy.machine import command_line, write_result

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# every benchmark, and `adstream bench all`, which writes a summary of a run of all of them
SCRIPTS = [
    *sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_")),
    BENCHMARKS.parent / "deploy/cli_bench.py",
]


def _indented_json_writes(tree: ast.AST) -> list[int]:
    """Lines that pretty-print JSON into a file themselves (`….write_text(json.dumps(…, indent=…))`):
    a result file written around `write_result`. Compact JSON between a benchmark and its own
    child processes is not a result file."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "dump":
            if any(k.arg == "indent" for k in node.keywords):
                lines.append(node.lineno)
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "write_text" or not node.args:
            continue
        for inner in ast.walk(node.args[0]):
            if (
                isinstance(inner, ast.Call)
                and isinstance(inner.func, ast.Attribute)
                and inner.func.attr == "dumps"
                and any(k.arg == "indent" for k in inner.keywords)
            ):
                lines.append(node.lineno)
    return sorted(set(lines))


def _defines(tree: ast.AST, name: str) -> list[int]:
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_a_benchmark_writes_its_results_through_the_one_writer(script: Path) -> None:
    src = script.read_text()
    tree = ast.parse(src)
    own = _indented_json_writes(tree)
    assert not own, f"{script.name} writes a result file itself at lines {own}: use write_result"
    assert not _defines(tree, "machine"), f"{script.name} defines its own machine(): use deploy.machine's"
    if "results" in src and "json" in src:
        assert "write_result" in src, f"{script.name} names benchmarks/results but never calls write_result"


def test_the_writer_records_machine_and_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "results" / "x.json"
    own = {"cpu": "Test CPU", "cores": 2, "load_avg_1m": 0.5, "python": "3.11"}
    write_result(out, {"p99_ms": 2.0, "machine": own}, argv=[str(tmp_path / "benchmarks/x.py"), "--n", "a b"])
    r = json.loads(out.read_text())
    assert r["p99_ms"] == 2.0
    assert r["machine"]["cpu"] == "Test CPU"  # the benchmark's own record (its start) is kept
    assert r["machine"]["python"] == "3.11" and r["machine"]["load_avg_1m"] == 0.5
    assert isinstance(r["machine"]["load_avg_1m_end"], float)
    assert r["command"].split(" ", 1)[1] == "-m benchmarks.x --n 'a b'"  # a module, shell-quoted


def test_a_machine_record_of_another_shape_is_kept_beside_the_machine(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    parts = [{"machine_before": {"cpu": "A"}}]
    write_result(out, {"machine": parts}, argv=["b.py"])
    r = json.loads(out.read_text())
    assert r["machine"] == parts
    assert set(r["machine_end"]) == {"cpu", "cores", "load_avg_1m"}


def test_the_command_names_this_interpreter_relative_to_the_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    venv_python = str(root / ".venv" / "bin" / "python")
    assert command_line(["benchmarks/rank.py"], python=venv_python) == ".venv/bin/python -m benchmarks.rank"
    assert command_line(["/elsewhere/b.py"], python="/usr/bin/python3") == "/usr/bin/python3 /elsewhere/b.py"
    assert command_line().startswith(command_line([sys.argv[0]]))


def test_a_section_joins_the_file_with_its_own_provenance(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    write_result(out, {"capacity_rps": 110}, argv=["benchmarks/serve.py"])
    write_result(out, {"cases": 3}, section="load_balanced", argv=["benchmarks/serve.py", "--load-balanced"])
    r = json.loads(out.read_text())
    assert r["capacity_rps"] == 110 and r["command"].endswith("-m benchmarks.serve")
    assert r["load_balanced"]["cases"] == 3
    assert r["load_balanced"]["command"].endswith("-m benchmarks.serve --load-balanced")
    assert "cpu" in r["load_balanced"]["machine"]
