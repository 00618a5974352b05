"""Bad input of creative assembly, named by file and line: every problem is collected before
anything is written, so a build either writes all of its variants or none."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from schemas.errors import SchemaError


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an input file, at a 1-based line."""

    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


class CreativeInputError(SchemaError):
    """Products or tone file that cannot be assembled; `problems` names each by file and line."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = sorted(problems, key=lambda p: (p.path, p.line))  # stable: found order within a line
        shown = "\n".join(str(p) for p in self.problems[:50])
        more = len(self.problems) - 50
        tail = f"\n… and {more} more" if more > 0 else ""
        super().__init__(f"{len(self.problems)} problem(s); nothing was written:\n{shown}{tail}")


def display(path: Path) -> str:
    """A path as the user gave it (relative stays relative)."""
    return str(path)
