"""Import a benchmark (`benchmarks/<name>.py`, the `benchmarks` package) for tests of its core."""

from __future__ import annotations

import importlib
from types import ModuleType


def load_benchmark(name: str) -> ModuleType:
    """The module `benchmarks.<name>` (imported once)."""
    return importlib.import_module(f"benchmarks.{name}")
