"""Identifiers that two rooms must derive the same way without talking to each other."""

from __future__ import annotations

import hashlib

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
