"""The one result type of every attribution model: per-channel credit with confidence intervals."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ChannelCredit:
    """One channel's credit under one model (CIs are NaN without a bootstrap)."""

    channel: str
    conversions: float
    value: float
    share: float
    ci_low: float
    ci_high: float
    value_ci_low: float
    value_ci_high: float


@dataclass(frozen=True)
class AttributionResult:
    """Credit per channel: conversions and value sum to the credited totals (efficiency)."""

    model: str
    channels: tuple[str, ...]
    conversions: np.ndarray
    value: np.ndarray
    ci_low: np.ndarray = field(default_factory=lambda: np.zeros(0))
    ci_high: np.ndarray = field(default_factory=lambda: np.zeros(0))
    value_ci_low: np.ndarray = field(default_factory=lambda: np.zeros(0))
    value_ci_high: np.ndarray = field(default_factory=lambda: np.zeros(0))
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.channels)
        for name in ("ci_low", "ci_high", "value_ci_low", "value_ci_high"):
            if getattr(self, name).shape[0] != n:
                object.__setattr__(self, name, np.full(n, np.nan))

    @property
    def share(self) -> np.ndarray:
        total = float(self.conversions.sum())
        return self.conversions / total if total > 0 else np.zeros(len(self.channels))

    def credit(self, channel: str) -> ChannelCredit:
        """The credit of one channel by name."""
        return self.rows()[self.channels.index(channel)]

    def rows(self) -> list[ChannelCredit]:
        share = self.share
        return [
            ChannelCredit(
                c, float(self.conversions[i]), float(self.value[i]), float(share[i]),
                float(self.ci_low[i]), float(self.ci_high[i]),
                float(self.value_ci_low[i]), float(self.value_ci_high[i]),
            )
            for i, c in enumerate(self.channels)
        ]  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: model, meta and one entry per channel (NaN CIs become None)."""

        def num(x: float) -> float | None:
            return None if not np.isfinite(x) else round(x, 6)

        return {
            "model": self.model,
            "meta": self.meta,
            "channels": [
                {
                    "channel": r.channel, "conversions": num(r.conversions), "value": num(r.value),
                    "share": num(r.share), "ci_low": num(r.ci_low), "ci_high": num(r.ci_high),
                    "value_ci_low": num(r.value_ci_low), "value_ci_high": num(r.value_ci_high),
                }
                for r in self.rows()
            ],
        }  # fmt: skip


def tv_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Total-variation distance of two credit vectors as shares: ½ Σ |a/Σa − b/Σb|.

    >>> tv_distance(np.array([1.0, 1.0]), np.array([2.0, 0.0]))
    0.5
    """
    sa, sb = float(a.sum()), float(b.sum())
    pa = a / sa if sa > 0 else a * 0
    pb = b / sb if sb > 0 else b * 0
    return 0.5 * float(np.abs(pa - pb).sum())
