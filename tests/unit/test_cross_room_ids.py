"""Rooms that derive the same identifier separately must agree (they may not import each other)."""

from __future__ import annotations

import pytest

from schemas.settings import Settings
from streams.join import adapter_id as streams_adapter_id
from trainers.lora import adapter_id_for


@pytest.mark.parametrize("scheme", ["slot", "advertiser", "slot+advertiser"])
@pytest.mark.parametrize("slot", ["feed", "search", "splash"])
def test_streams_and_trainers_name_adapters_alike(scheme: str, slot: str) -> None:
    settings = Settings(adapter_scheme=scheme)  # type: ignore[arg-type]
    for advertiser in ("v1", "adv-ü-42", "x" * 64):
        assert streams_adapter_id(slot, advertiser, settings.adapter_scheme) == adapter_id_for(
            slot, advertiser, settings.adapter_scheme
        )
