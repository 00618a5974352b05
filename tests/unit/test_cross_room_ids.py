"""Identifiers several rooms derive (they may not import each other): one definition in schemas."""

from __future__ import annotations

import pytest

from schemas.errors import ConfigError
from schemas.ids import MAX_ID, adapter_id_for
from schemas.settings import Settings


@pytest.mark.parametrize("scheme", ["slot", "advertiser", "slot+advertiser"])
def test_adapter_ids_fit_the_contract_and_stay_distinct(scheme: str) -> None:
    settings = Settings(adapter_scheme=scheme)  # type: ignore[arg-type]
    advertisers = ["v1", "adv-ü-42", "x" * 64, "x" * 63 + "y", "x" * 200]
    for slot in ("feed", "search", "splash"):
        ids = [adapter_id_for(slot, a, settings.adapter_scheme) for a in advertisers]
        assert all(0 < len(i) <= MAX_ID for i in ids)
        if scheme == "slot":
            assert set(ids) == {slot}
        else:
            assert len(set(ids)) == len(advertisers)  # long ids are cut but stay distinct
            assert ids[0] == ("adv:v1" if scheme == "advertiser" else f"{slot}/adv:v1")
    with pytest.raises(ConfigError, match=r"adapter_scheme.*bogus"):
        adapter_id_for("feed", "v1", "bogus")
