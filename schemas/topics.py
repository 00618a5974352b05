"""Kafka topic names of the wire contract, their keys and default partition counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True)
class TopicSpec:
    """One contract topic: its name, what its messages are keyed by, and its partition count."""

    name: str
    key: str
    partitions: int


IMPRESSIONS: Final = "ad.impressions"
CLICKS: Final = "ad.clicks"
DWELL: Final = "ad.dwell"
VIEWS: Final = "ad.views"  # render beacons of served ads (`View`): what makes them impressions
CONVERSIONS: Final = "ad.conversions"
TOUCHES: Final = "ad.touches"  # touchpoints on channels outside adstream (`Touch`)
CATALOG: Final = "ad.catalog"
# campaigns (`Campaign`), keyed by campaign id: a topic of their own, since every topic carries one
# contract model (its consumers decode it by topic) and ad ids and campaign ids share no key space
CAMPAIGNS: Final = "ad.campaigns"
DLQ: Final = "ad.dlq"
TRAINING_EXAMPLES: Final = "ad.training-examples"
ADAPTER_DELTAS: Final = "ad.adapter-deltas"

# User-keyed topics share a partition count so the same user lands on the same partition number
# in each of them (co-partitioning for the label join). Catalog, campaigns, deltas and the DLQ
# are small.
TOPICS: Final[tuple[TopicSpec, ...]] = (
    TopicSpec(IMPRESSIONS, "user_id", 8),
    TopicSpec(CLICKS, "user_id", 8),
    TopicSpec(DWELL, "user_id", 8),
    TopicSpec(CONVERSIONS, "user_id", 8),
    TopicSpec(TOUCHES, "user_id", 8),
    TopicSpec(VIEWS, "user_id", 8),
    TopicSpec(CATALOG, "ad_id", 1),
    TopicSpec(CAMPAIGNS, "campaign_id", 1),
    TopicSpec(DLQ, "source_topic", 1),
    TopicSpec(TRAINING_EXAMPLES, "adapter_id", 4),
    TopicSpec(ADAPTER_DELTAS, "adapter_id", 1),
)

TOPICS_BY_NAME: Final[dict[str, TopicSpec]] = {t.name: t for t in TOPICS}

# The co-partitioned user topics the streams worker consumes, in merge tie-break order (an
# impression before its click, …): what `streams.pipeline.INPUTS` reads.
USER_INPUTS: Final[tuple[str, ...]] = (IMPRESSIONS, CLICKS, DWELL, CONVERSIONS, TOUCHES, VIEWS)


def topic_name(base: str, prefix: str = "") -> str:
    """The physical topic name for a contract topic, with an optional deployment/test prefix."""
    return f"{prefix}{base}"
