"""The rooms take their settings group itself, not a copy of it.

`OnlineSpec.lr` once defaulted to 0.01 while `Settings.online.lr` is 0.003, so a benchmark that
built `OnlineSpec()` measured a learning rate the trainer never uses. The per-room mirrors
(`StateParams`, `OnlineSpec`, `LoraSpec`, `CanaryRule`, `RerankParams`, `EngagementWeights`) are
gone: each room's knobs are the frozen sub-model of `Settings`, so there is one default to read.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, get_type_hints

import pytest

from schemas.settings import (
    CanarySettings,
    LoraSettings,
    OnlineSettings,
    RerankSettings,
    Settings,
    StateSettings,
)
from serving.canary import Canary
from serving.rerank import rerank
from streams.processor import Processor
from trainers.models.lora import AdapterBank
from trainers.online import AdapterOptimizer, OnlineTrainer


@pytest.mark.parametrize(
    ("owner", "argument", "group"),
    [
        (OnlineTrainer.__init__, "spec", OnlineSettings),
        (AdapterOptimizer.__init__, "spec", OnlineSettings),
        (AdapterBank.__init__, "spec", LoraSettings),
        (Processor, "params", StateSettings),
        (Canary, "rule", CanarySettings),
        (rerank, "params", RerankSettings),
    ],
)
def test_rooms_take_the_settings_group_itself(owner: Callable[..., Any], argument: str, group: type) -> None:
    assert get_type_hints(owner)[argument] is group


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("streams.state", "StateParams"),
        ("streams.state", "EngagementWeights"),
        ("trainers.online", "OnlineSpec"),
        ("trainers.models.lora", "LoraSpec"),
        ("serving.canary", "CanaryRule"),
        ("serving.rerank", "RerankParams"),
    ],
)
def test_the_mirrors_are_gone(module: str, name: str) -> None:
    assert not hasattr(importlib.import_module(module), name)


def test_built_from_settings_the_rooms_hold_the_settings_groups() -> None:
    s = Settings()
    proc = Processor.from_settings(s)
    assert proc.params is s.state and proc.dim == s.state_dim
    assert s.online.fn_loss == "weighted" and s.lora.scaling == s.lora.alpha / s.lora.rank


def test_the_default_backoffs_are_the_settings_defaults() -> None:
    """The streams helpers' and the snapshot store's default backoffs (for callers without
    settings) equal the backoffs the settings build."""
    from streams.delivery import WORKER_BACKOFF
    from trainers.snapshots import REDIS_BACKOFF

    s = Settings()
    assert WORKER_BACKOFF == s.streams.retry_backoff
    assert REDIS_BACKOFF == s.online.redis_backoff
