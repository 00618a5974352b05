"""Settings of live learning's A/B arms and of the serving policy's exploration."""

from __future__ import annotations

from pydantic import Field, model_validator

from schemas.settings.base import Group


class AbSettings(Group):
    """Stable shares of users (by a salted hash of the user id, independent of the canary's arms)
    served without learning: `control` by the frozen base model alone (no adapters, no per-user
    correction), `correction` with the per-user correction but no adapters; the rest is the
    learning arm. Every arm's traffic still trains the adapters."""

    control_share: float = Field(
        0.1, ge=0, lt=1, description="Share of users in the frozen control arm (0 turns it off)"
    )
    correction_share: float = Field(
        0.1, ge=0, lt=1, description="Share of users served with the per-user correction, no adapters"
    )
    salt: str = Field(
        "ab-v1", min_length=1, max_length=64, description="Hash salt (a new salt reshuffles the arms)"
    )
    shadow_slates: bool = Field(
        False,
        description="Measurement only (the live-loop benchmark): each learning-arm request ranked "
        "with adapters is also ranked without them (the correction-only arm's policy on the same "
        "request, exploration's draw included) and the ad ids of that shadow slate are returned in "
        "the `x-adstream-shadow` response header; costs one more forward per such request",
    )

    @model_validator(mode="after")
    def _shares_leave_a_learning_arm(self) -> AbSettings:
        if self.control_share + self.correction_share >= 1:
            raise ValueError(
                f"ab.control_share ({self.control_share}) + ab.correction_share "
                f"({self.correction_share}) must be < 1: the learning arm needs users"
            )
        return self


class ExploreSettings(Group):
    """Epsilon-greedy exploration per served position, with the exact probability of each choice
    logged on its impression (`Impression.propensity`) for off-policy evaluation."""

    epsilon: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="Chance that a position's ad is drawn uniformly from the best `top_m` remaining "
        "candidates instead of the greedy one (0 turns exploration off; propensities are then 1)",
    )
    top_m: int = Field(
        8, ge=2, le=100, description="How many of the best remaining candidates exploration draws from"
    )
