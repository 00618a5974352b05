"""The named simulator configs of benchmarks/offline_quality.py (`--configs`)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _offline_quality() -> ModuleType:
    path = ROOT / "benchmarks" / "offline_quality.py"
    spec = importlib.util.spec_from_file_location("bench_offline_quality", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


ARGS = argparse.Namespace(rich_users=20, rich_per_user=10_000)


def test_users_by_history_config() -> None:
    oq = _offline_quality()
    cfg, n = oq.sim_config("u200x1000", 3, ARGS)
    assert (cfg.n_users, cfg.seed, cfg.drift_at, n) == (200, 3, None, 200_000)
    assert oq.sim_config("rich", 3, ARGS) == oq.sim_config("u20x10000", 3, ARGS)
    drifting, _ = oq.sim_config("rich-drift", 3, ARGS)
    assert drifting.drift_at is not None


@pytest.mark.parametrize("name", ["u0x10", "u10x0", "u10", "x10", "u10x10x", "bogus"])
def test_unknown_config_is_named(name: str) -> None:
    with pytest.raises(ValueError, match=f"unknown config '{name}'"):
        _offline_quality().sim_config(name, 0, ARGS)
