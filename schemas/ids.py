"""Identifiers that two rooms must derive the same way without talking to each other."""

from __future__ import annotations

import hashlib

from schemas.errors import ConfigError

MAX_ID = 64


def impression_event_id(request_id: str, position: int) -> str:
    """The `event_id` of the Impression for the ad served at `position` (0-based) of a response.

    Serving stamps its Impression events with it, and a client that only sees the AdResponse
    (the closed-loop simulator, an SDK reporting clicks) names the impression it clicked.

    >>> impression_event_id("req-42", 3)
    'req-42/3'
    >>> len(impression_event_id("r" * 64, 7)) <= 64
    True
    """
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    value = f"{request_id}/{position}"
    if len(value) <= MAX_ID:
        return value
    digest = hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()
    return f"h{digest}/{position}"


def adapter_id_for(slot: str, advertiser_id: str, scheme: str) -> str:
    """The adapter that owns an impression under `settings.adapter_scheme`: the slot (`feed`),
    `adv:<advertiser_id>`, or `<slot>/adv:<advertiser_id>`. Streams writes it into
    `TrainingExample.adapter_id` (the trainer's partition key) and serving looks adapters up by
    it; ids over 64 characters are cut and suffixed with a hash so they stay distinct and within
    the contract.

    >>> adapter_id_for("feed", "v7", "slot+advertiser")
    'feed/adv:v7'
    >>> len(adapter_id_for("feed", "v" * 80, "advertiser")) == MAX_ID
    True
    """
    if scheme == "slot":
        aid = slot
    elif scheme == "advertiser":
        aid = f"adv:{advertiser_id}"
    elif scheme == "slot+advertiser":
        aid = f"{slot}/adv:{advertiser_id}"
    else:
        raise ConfigError(f"adapter_scheme must be slot, advertiser or slot+advertiser (got {scheme!r})")
    if len(aid) > MAX_ID:
        digest = hashlib.blake2b(aid.encode(), digest_size=12).hexdigest()
        aid = f"{aid[: MAX_ID - 25]}~{digest}"
    return aid
