"""The stable, random holdout assignment: which users a campaign does not show ads to.

Serving calls `is_holdout(user_id, campaign_id, share, salt)` before serving a campaign's ad;
a held-out user gets no ad of that campaign and the request is recorded as a *holdout
impression*: an `Impression` whose `ad_id` is `HOLDOUT_AD_ID` and whose `price` is 0 (the
campaign, slot and user are the real ones). Attribution (attribution.incrementality) compares
conversion rates of exposed and held-out users per campaign.

The assignment is a pure function of (salt, campaign, user): the same user stays in or out
for a campaign across requests, replicas and restarts, and campaigns draw independently.

>>> is_holdout("u1", "cmp001_0", 0.0, "s")
False
>>> is_holdout("u1", "cmp001_0", 0.999999, "s")
True
"""

from __future__ import annotations

import hashlib

HOLDOUT_AD_ID = "__holdout__"  # the ad_id of a holdout impression (never a real creative)

_SCALE = float(2**64)


def holdout_draw(user_id: str, campaign_id: str, salt: str) -> float:
    """A uniform draw in [0, 1) fixed by (salt, campaign, user): blake2b of the three."""
    digest = hashlib.blake2b(f"{salt}\x1f{campaign_id}\x1f{user_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / _SCALE


def is_holdout(user_id: str, campaign_id: str, share: float, salt: str) -> bool:
    """Whether `user_id` is in `campaign_id`'s holdout (a `share` in [0, 1) of users)."""
    if not 0.0 <= share < 1.0:
        from schemas.errors import ConfigError

        raise ConfigError(f"holdout share {share!r} must be in [0, 1)")
    return share > 0.0 and holdout_draw(user_id, campaign_id, salt) < share


def is_holdout_impression(ad_id: str) -> bool:
    """Whether an impression row records a holdout (no ad shown) rather than a served ad."""
    return ad_id == HOLDOUT_AD_ID
