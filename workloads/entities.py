"""The small types of the simulator: its event union, a request, and id parsing."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from schemas.errors import AdstreamError
from schemas.events import AdCreative, Click, Conversion, Device, Dwell, Impression, Slot, View

Event = AdCreative | Impression | View | Click | Dwell | Conversion


class UnknownEntityError(AdstreamError):
    """A user or ad id that this market did not create (e.g. served from another catalog)."""


@dataclass(frozen=True)
class Request:
    """One ad request of the simulated traffic: who, where, how many ads, when, and the
    interests the user declared (sent with every request; serving uses them while it knows
    little of the user); the user's country and device, and a search request's query text."""

    user_id: str
    user: int
    slot: Slot
    k: int
    ts: datetime
    interests: tuple[str, ...] = ()
    geo: str | None = None
    device: Device | None = None
    query: str | None = None


def index_of(ident: str, prefix: str, n: int, what: str) -> int:
    """The number inside a market id such as `u000123` or `ad00042`, checked against `n`."""
    if ident.startswith(prefix) and ident[len(prefix) :].isdigit():
        i = int(ident[len(prefix) :])
        if i < n:
            return i
    raise UnknownEntityError(f"{what} {ident!r} is not one of this market's {n} {what}s")
