"""Settings of the slots requests may name (`AdRequest.slot`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from schemas.events import SLOTS, Slot
from schemas.settings.base import Group

MAX_SLOTS = 64


def _distinct(names: tuple[str, ...]) -> tuple[str, ...]:
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"lists {twice} more than once")
    return names


class SlotSettings(Group):
    """The slots (ad surfaces) of this deployment. Serving refuses a request naming a slot not
    listed here (422 naming `slot`); every per-slot mechanism (slot adapters, QoS class per slot,
    rollups by slot) takes any listed one. The models keep `feed`, `search` and `splash` at
    fixed indices; one trained while other slots are listed here hashes them into extra rows
    (`trainers.models.ranker.slot_buckets_for`, `trainers.models.features.slot_index`), one
    without such rows scores them with feed's row: a slot added here is served at once."""

    names: Annotated[
        tuple[Slot, ...], Field(min_length=1, max_length=MAX_SLOTS), AfterValidator(_distinct)
    ] = Field(
        SLOTS,
        description="The slots requests may name: a JSON list of identifiers (a lowercase letter, "
        "then up to 31 lowercase letters, digits, _ or -)",
    )
