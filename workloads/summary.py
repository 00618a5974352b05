"""What a simulated run amounted to: events by type, CTR, oracle AUC and the true channel credit."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from workloads import truth

if TYPE_CHECKING:
    from workloads.market import Market


@dataclass(frozen=True)
class Summary:
    """The ground-truth report of a run (everything `adstream simulate` prints)."""

    events: dict[str, int]
    impressions: int
    clicks: int
    ctr: float
    oracle_auc: float
    mean_oracle_pctr: float
    true_channel_credit: dict[str, float]
    expected_caused_conversions: dict[str, float]
    realised_caused_conversions: dict[str, int]
    organic_conversions: int
    oracle_auc_after_drift: float = float("nan")
    frozen_auc_after_drift: float = float("nan")
    drift_ts: datetime | None = None
    drift_impression: int | None = None
    new_ads_ts: datetime | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        out = {k: v for k, v in self.__dict__.items()}
        for k in ("drift_ts", "new_ads_ts"):
            out[k] = out[k].isoformat() if out[k] is not None else None
        return out


def summarize(market: Market) -> Summary:
    """The summary of everything a market emitted or responded to so far."""
    scores, labels = market.outcomes()
    n = len(labels)
    frozen = market.frozen_pctr_after_drift()
    after = labels[n - len(frozen) :] if len(frozen) else labels[:0]
    clicks = int(labels.sum())
    lift = market.config.channel_lift
    return Summary(
        events=dict(sorted(market.counts.items())),
        impressions=n,
        clicks=clicks,
        ctr=clicks / n if n else float("nan"),
        oracle_auc=truth.auc(scores, labels),
        mean_oracle_pctr=float(scores.mean()) if n else float("nan"),
        true_channel_credit=truth.channel_credit(market.touches, lift),
        expected_caused_conversions=truth.expected_caused_conversions(market.touches, lift),
        realised_caused_conversions={c: market.caused.get(c, 0) for c in lift},
        organic_conversions=market.organic_conversions,
        oracle_auc_after_drift=truth.auc(scores[n - len(frozen) :], after) if len(frozen) else float("nan"),
        frozen_auc_after_drift=truth.auc(frozen, after) if len(frozen) else float("nan"),
        drift_ts=market.drift_ts,
        drift_impression=market.drift_impression,
        new_ads_ts=market.new_ads_ts,
    )
