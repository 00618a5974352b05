"""The rooms' parameter dataclasses must not disagree with the settings they mirror.

`OnlineSpec.lr` once defaulted to 0.01 while `Settings.online.lr` is 0.003, so a benchmark that
built `OnlineSpec()` measured a learning rate the trainer never uses. Every mirror's default must
equal the default of the setting it is built from.
"""

from __future__ import annotations

import dataclasses

import pytest

from schemas.settings import Settings, leaf_fields
from serving.canary import CanaryRule
from serving.rerank import RerankParams
from streams.state import StateParams
from trainers.lora import LoraSpec
from trainers.online import OnlineSpec

# mirror field -> setting, for the mirrors built field by field in serving
CANARY = {
    "auc_gain": "canary.auc_gain",
    "latency_slack": "canary.latency_slack",
    "max_error_rate": "canary.max_error_rate",
    "error_window_s": "canary.error_window_s",
    "min_samples": "canary.min_samples",
}
RERANK = {
    "max_per_advertiser": "rerank.max_per_advertiser",
    "category_decay": "rerank.category_decay",
    "long_tail_boost": "rerank.long_tail_boost",
    "reserve_price": "rerank.reserve_price",
    "pacing_slack": "rerank.pacing_slack",
}


# fields resolved at run time rather than copied from a setting's default: the delta signing key
# is `settings.delta_signing_key` or else the stack's key file (trainers.delta.resolve_signing_key)
RESOLVED = {"signing_key"}


@pytest.mark.parametrize("mirror", [StateParams, OnlineSpec, LoraSpec])
def test_from_settings_of_the_defaults_is_the_default(mirror: type) -> None:
    built, default = mirror.from_settings(Settings()), mirror()
    differ = {
        f.name: (getattr(default, f.name), getattr(built, f.name))
        for f in dataclasses.fields(mirror)
        if f.name not in RESOLVED and getattr(default, f.name) != getattr(built, f.name)
    }
    assert not differ, f"{mirror.__name__} defaults (default, from settings) disagree: {differ}"


@pytest.mark.parametrize(("mirror", "mapping"), [(CanaryRule, CANARY), (RerankParams, RERANK)])
def test_field_by_field_mirrors_match_settings(mirror: type, mapping: dict[str, str]) -> None:
    default, fields = mirror(), leaf_fields()
    differ = {
        name: (getattr(default, name), fields[setting].default)
        for name, setting in mapping.items()
        if getattr(default, name) != fields[setting].default
    }
    assert not differ, f"{mirror.__name__} defaults (mirror, setting) disagree: {differ}"


def test_the_default_backoffs_are_the_settings_defaults() -> None:
    """The streams helpers' and the snapshot store's default backoffs (for callers without
    settings) equal the backoffs the settings build."""
    from streams.delivery import WORKER_BACKOFF
    from trainers.snapshots import REDIS_BACKOFF

    s = Settings()
    assert WORKER_BACKOFF == s.streams.retry_backoff
    assert REDIS_BACKOFF == s.online.redis_backoff
