"""Settings of the creative variant bandit (`serving.variants`) and how replicas teach it."""

from __future__ import annotations

from pydantic import Field

from schemas.settings.base import Group


class VariantsSettings(Group):
    """Which creative variant of an ad each replica shows: disjoint linear Thompson sampling on
    [1, user state vector] per (ad, variant), with a uniform floor so every variant keeps a
    logged chance; replicas learn from the labelled examples (`ad.training-examples`)."""

    enabled: bool = Field(
        True,
        description="Choose a variant for served ads that have them (off: no variant is named, the ad "
        "is rendered from its title, and impressions carry no variant)",
    )
    prior: float = Field(
        1.0, gt=0, le=1e6, description="Ridge prior λ of each variant's regression (precision λI)"
    )
    noise: float = Field(
        0.1, gt=0, le=100, description="Posterior scale σ of the Thompson draws (more: more exploration)"
    )
    floor: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Share of choices drawn uniformly over an ad's variants (> 0: off-policy "
        "evaluation needs every variant's chance)",
    )
    learn: bool = Field(
        True, description="Replicas follow ad.training-examples and learn each labelled variant's click"
    )
    replay_s: float = Field(
        3600.0,
        ge=0,
        description="A starting replica learns the labelled examples of this far back (then follows on)",
    )
    learn_batch: int = Field(
        256, ge=1, le=100_000, description="Labelled examples a replica learns in one posterior update"
    )
    learn_interval_s: float = Field(
        1.0, gt=0, le=3600, description="Longest a labelled example waits before it is learned"
    )
    remembered: int = Field(
        200_000,
        ge=1,
        le=10_000_000,
        description="Impressions a replica remembers as learned (a replayed or duplicated example of "
        "one of them is not learned twice); the oldest are forgotten first",
    )
