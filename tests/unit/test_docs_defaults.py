"""Every default the README or docs state for a setting equals the code's: a settings table row
``| `ADSTREAM_GROUP__FIELD` | `value` |`` (or ``empty``) is read back through `Settings`."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import SecretStr

from schemas.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| `ADSTREAM_([A-Z0-9_]+)` \| (?:`([^`]*)`|(empty)) \|", re.M)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _default(name: str) -> object:
    value: object = Settings()
    for part in name.lower().split("__"):
        value = getattr(value, part)
    return value.get_secret_value() if isinstance(value, SecretStr) else value


def test_every_stated_default_is_the_codes() -> None:
    stated = [(page.name, m) for page in _pages() for m in ROW.finditer(page.read_text())]
    assert stated, "no settings table found in README.md or docs/"
    wrong = []
    for page, m in stated:
        code = _default(m.group(1))
        doc = "" if m.group(3) else m.group(2)
        if str(code) != doc and not (isinstance(code, float) and float(doc) == code):
            wrong.append(f"{page}: ADSTREAM_{m.group(1)} says {doc!r}, the code has {code!r}")
    assert not wrong, "\n".join(wrong)
