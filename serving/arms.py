"""Live learning's A/B arms: which users are served without learning, so that what learning earns
can be measured on live traffic (`adstream ab`, `attribution.ab`).

A user's arm is a salted hash of the user id (stable across requests, replicas and restarts,
independent of the canary's arms, `serving.canary.user_bucket`):

- `control`: the frozen base model alone — no adapters, no per-user correction;
- `correction`: the per-user correction of the streams worker, no adapters;
- `learning`: everything (adapters and the correction).

Every arm's impressions and clicks still train the adapters; each impression records its arm.
"""

from __future__ import annotations

import hashlib

from schemas.events import AbArm
from schemas.settings import AbSettings


def ab_bucket(user_id: str, salt: str) -> float:
    """A user's point in [0, 1) for the A/B split (blake2b of salt and id; not the canary's hash).

    >>> ab_bucket("u1", "ab-v1") == ab_bucket("u1", "ab-v1")
    True
    >>> 0.0 <= ab_bucket("u1", "ab-v1") < 1.0
    True
    """
    digest = hashlib.blake2b(f"{salt}\x00{user_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def ab_arm_for(user_id: str, ab: AbSettings) -> AbArm:
    """The user's A/B arm under the settings' shares.

    >>> ab_arm_for("u1", AbSettings(control_share=0.0, correction_share=0.0))
    'learning'
    """
    u = ab_bucket(user_id, ab.salt)
    if u < ab.control_share:
        return "control"
    if u < ab.control_share + ab.correction_share:
        return "correction"
    return "learning"


def uses_adapters(arm: AbArm) -> bool:
    """Whether the arm ranks with the online adapters (only the learning arm)."""
    return arm == "learning"


def uses_correction(arm: AbArm) -> bool:
    """Whether the arm adds the per-user correction to the ranker's logit."""
    return arm != "control"
