"""No code reads a setting by its pre-nesting flat name (`settings.lora_targets`).

`benchmarks/serve.py` typed its settings as `object` and silenced mypy with `type: ignore`, so
`s.lora_targets` and `s.redis_url` survived the nesting and the benchmark crashed at its first
adapter (found when re-running it). mypy does not cover the benchmarks or code typed `Any`; this
scan covers every Python file of the repository for the names `Settings` had before nesting.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from schemas.settings import RENAMED, Settings, env_name, leaf_fields

ROOT = Path(__file__).resolve().parents[3]
# the names a settings object goes by in this code base
RECEIVERS = r"(?:\bs|\bsettings|\bself\.settings|\bself\.s|\bstack|\bdeployment|\btimed|\bcfg\.settings)"


def flat_reads(text: str) -> list[str]:
    """`receiver.flat_name` reads of a flat name that is no top-level setting any more."""
    names = sorted(n for n in RENAMED if n not in Settings.model_fields)
    pattern = re.compile(rf"{RECEIVERS}\.({'|'.join(map(re.escape, names))})\b")
    return [m.group(0) for m in pattern.finditer(text)]


def test_the_scan_finds_a_flat_read() -> None:
    assert flat_reads("shapes = target_shapes(model, s.lora_targets)") == ["s.lora_targets"]
    assert flat_reads("x = settings.lora.targets; y = s.redis.url") == []


def python_files(root: Path) -> list[Path]:
    """The repository's Python files, hidden directories never entered: `.adstream` holds the
    local services' data (ClickHouse merges and drops part directories while a walk lists them;
    `rglob` descended there and failed on one that vanished) and `.venv` the dependencies."""
    out = []
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        out += [Path(top) / f for f in files if f.endswith(".py")]
    return out


def test_the_walk_never_enters_a_hidden_directory(tmp_path: Path) -> None:
    (tmp_path / ".adstream" / "data").mkdir(parents=True)
    (tmp_path / ".adstream" / "data" / "x.py").write_text("")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("")
    assert python_files(tmp_path) == [tmp_path / "pkg" / "a.py"]


def test_no_python_file_reads_a_setting_by_its_flat_name() -> None:
    found = {
        str(p.relative_to(ROOT)): hits
        for p in python_files(ROOT)
        if p != Path(__file__).resolve() and (hits := flat_reads(p.read_text(encoding="utf-8")))
    }
    assert not found, f"flat (pre-nesting) setting names read: {found}"


# env names that are no setting on purpose: the README's example of a refused flat name,
# switches the fault-injection tests read themselves, where an installed `adstream bench` writes
# its results, and the packaging tests' "the package index must answer" (CI)
NOT_SETTINGS = {
    "ADSTREAM_ONLINE_LR",
    "ADSTREAM_FAULT_DEBUG",
    "ADSTREAM_KEEP_FAULT_RUN",
    "ADSTREAM_BENCH_RESULTS",
    "ADSTREAM_REQUIRE_INDEX",
}
_ENV = re.compile(r"ADSTREAM_[A-Z0-9_]*[A-Z0-9](_\*)?")


def unknown_env_names(text: str) -> list[str]:
    """`ADSTREAM_…` names in `text` that name no setting (`NAME_*`: no setting starts so)."""
    flat = {env_name(dotted) for dotted in leaf_fields()}
    out = []
    for m in _ENV.finditer(text):
        name, glob = m.group(0).removesuffix("_*"), m.group(1)
        known = any(f.startswith(name + "_") for f in flat) if glob else name in flat
        if not known and name not in NOT_SETTINGS:
            out.append(m.group(0))
    return out


def test_the_env_scan_finds_a_name_that_is_no_setting() -> None:
    assert unknown_env_names("set ADSTREAM_RECALL_ANN_* or ADSTREAM_ONLINE__LABEL_MODE") == [
        "ADSTREAM_RECALL_ANN_*"
    ]
    assert (
        unknown_env_names("ADSTREAM_RECALL__ANN_* and ADSTREAM_KAFKA__BOOTSTRAP, ADSTREAM_TOPIC_PREFIX") == []
    )


def test_every_env_name_the_docs_and_deploy_files_give_is_a_setting() -> None:
    # the README told users `ADSTREAM_RECALL_ANN_*` (the nested name is `ADSTREAM_RECALL__ANN_*`):
    # pydantic-settings ignores an env name it does not know, so the knob silently did nothing
    suffixes = (".md", ".yml", ".yaml", ".example", ".toml", ".sh", ".py", ".txt", ".json", ".lua")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    found = {
        name: hits
        for name in tracked.stdout.split()
        if (name.endswith(suffixes) or Path(name).name in ("Makefile", "Dockerfile", "run"))
        and not name.startswith(("tests/", "benchmarks/results/"))
        and (hits := unknown_env_names((ROOT / name).read_text(encoding="utf-8", errors="replace")))
    }
    assert not found, f"ADSTREAM_ names that are no setting: {found}"
