"""Tiny hand-made TrainingExamples for the trainer unit tests (no simulator, no services)."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from schemas.events import SLOTS, TrainingExample

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def make_examples(
    n: int, seed: int = 0, dim: int = 8, adapters: tuple[str, ...] = ("feed",)
) -> list[TrainingExample]:
    """`n` examples whose click depends on user_vector[0] and the category (learnable signal)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        vec = [rng.gauss(0, 1) for _ in range(dim)]
        cat = rng.choice(["a", "b", "c"])
        logit = 2.0 * vec[0] * (1 if cat == "a" else -1) + (0.5 if cat == "b" else -1.0)
        p = 1 / (1 + pow(2.718281828, -logit))
        ts = T0 + timedelta(seconds=i)
        adapter = adapters[i % len(adapters)]
        out.append(
            TrainingExample(
                event_id=f"te{seed}-{i}",
                ts=ts,
                adapter_id=adapter,
                impression_id=f"imp{seed}-{i}",
                impression_ts=ts,
                user_id=f"u{rng.randrange(50)}",
                ad_id=f"ad{rng.randrange(20)}",
                campaign_id=f"c{rng.randrange(5)}",
                advertiser_id=f"v{rng.randrange(3)}",
                category=cat,
                slot=adapter if adapter in SLOTS else rng.choice(SLOTS),
                position=rng.randrange(5),
                hour=ts.hour,
                user_vector=vec,
                intent_score=rng.random(),
                recall_score=rng.random() if i % 2 else None,
                click=rng.random() < p,
            )
        )
    return out
