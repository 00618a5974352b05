"""The rooms' arrows as import-linter contracts (`[tool.importlinter]` in pyproject.toml, run by
`make lint`): the contracts cover every room, and the serving contract names every module of
`trainers` outside `trainers.models`, so a new trainer module cannot slip past it."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import trainers

ROOT = Path(__file__).resolve().parents[2]


def _contracts() -> dict[str, dict[str, Any]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in config["contracts"]}


def test_every_room_with_rules_has_a_contract() -> None:
    sources = {m for c in _contracts().values() for m in c["source_modules"]}
    assert {"schemas", "streams", "trainers", "serving", "attribution", "workloads"} <= sources


def test_serving_may_import_only_the_model_modules_of_trainers() -> None:
    forbidden = set(_contracts()["serving-models-only"]["forbidden_modules"])
    trainer_modules = {
        f"trainers.{m.name}" for m in pkgutil.iter_modules(trainers.__path__) if m.name != "models"
    }
    assert trainer_modules - forbidden == set(), "add the new trainers module to the serving contract"
    assert "trainers.models" not in forbidden


def test_lint_imports_keeps_every_contract() -> None:
    out = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
