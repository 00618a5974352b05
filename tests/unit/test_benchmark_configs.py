"""The named simulator configs of benchmarks/offline_quality.py (`--configs`)."""

from __future__ import annotations

import argparse
from types import ModuleType

import pytest

from tests.support.benchmarks import load_benchmark


def _offline_quality() -> ModuleType:
    return load_benchmark("offline_quality")


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
