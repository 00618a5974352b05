"""No code reads a setting by its pre-nesting flat name (`settings.lora_targets`).

`benchmarks/serve.py` typed its settings as `object` and silenced mypy with `type: ignore`, so
`s.lora_targets` and `s.redis_url` survived the nesting and the benchmark crashed at its first
adapter (found when re-running it). mypy does not cover the benchmarks or code typed `Any`; this
scan covers every Python file of the repository for the names `Settings` had before nesting.
"""

from __future__ import annotations

import re
from pathlib import Path

from schemas.settings import RENAMED, Settings

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


def test_no_python_file_reads_a_setting_by_its_flat_name() -> None:
    found = {
        str(p.relative_to(ROOT)): hits
        for p in ROOT.rglob("*.py")
        if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
        and p != Path(__file__).resolve()
        and (hits := flat_reads(p.read_text(encoding="utf-8")))
    }
    assert not found, f"flat (pre-nesting) setting names read: {found}"
