"""Fixtures of the trainers' integration tests."""

from __future__ import annotations

import uuid

import pytest

from schemas.settings import Settings


@pytest.fixture
def deployment(stack: Settings) -> Settings:
    """Own topics, Redis keys and consumer group for one test (a trainer deployment)."""
    from deploy.stack import create_topics

    tag = uuid.uuid4().hex[:6]
    s = stack.model_copy(
        update={
            "topic_prefix": f"{stack.topic_prefix}{tag}.",
            "redis_prefix": f"{stack.redis_prefix}{tag}:",
            "online": stack.online.model_copy(
                update={
                    "micro_batch": 64,
                    "micro_batch_s": 0.2,
                    "snapshot_every_s": 3600.0,
                    "group": f"g{tag}",
                    "hold_labels": False,
                }
            ),
        }
    )
    create_topics(s)
    return s
