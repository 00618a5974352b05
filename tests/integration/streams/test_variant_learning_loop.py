"""Clicks teach serving's creative variant bandit through the real loop: signed impressions that
name their variant and clicks on one variant go through the broker to the streams worker, whose
label join puts the variant on each TrainingExample; a replica's follower of
`ad.training-examples` (`serving.variant_feedback`) learns them, and the replica's choice
probabilities move to the clicked variant. A replay of the whole topic changes nothing."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
import redis
from streams_it import Worker, produce, wait_for
from test_streams_worker import all_applied, end_offsets

from schemas.codec import encode, key_of, topic_of
from schemas.events import AdCreative, Click, CreativeVariant, Impression, Message
from schemas.ids import impression_event_id
from schemas.settings import Settings
from schemas.signing import event_key, seal, sign_impression
from serving.variant_feedback import VariantFeedback
from serving.variants import VariantSelector

pytestmark = [
    pytest.mark.kafka,
    pytest.mark.redis,
    pytest.mark.clickhouse,
    pytest.mark.slow,
    pytest.mark.timeout(240),
]

USERS = 40


def records(events: list[Message]) -> list[tuple[str, bytes | None, bytes]]:
    return [(topic_of(e), key_of(e), encode(e)) for e in events]


def variant(vid: str, headline: str) -> CreativeVariant:
    return CreativeVariant(
        variant_id=vid, locale="en", headline=headline, body="Mesh upper, cushioned sole.",
        cta="Shop now", disclosure="Ad", emphasis="benefit",
    )  # fmt: skip


def traffic(key: bytes, now: datetime) -> tuple[AdCreative, list[Impression], list[Click]]:
    """One ad with variants a and b; each user served it once (a or b, propensity 0.5); every
    impression of b clicked, none of a."""
    ad = AdCreative(
        event_id="cat-ad-v", ts=now - timedelta(hours=1), ad_id="ad-v", campaign_id="camp-v",
        advertiser_id="adv-v", category="shoes", title="Light running shoes", bid=1.0,
        daily_budget=100.0, active=True,
        variants=(variant("a", "Light running shoes"), variant("b", "Run cooler this summer")),
    )  # fmt: skip
    imps, clicks = [], []
    for u in range(USERS):
        rid = f"req-v{u}"
        imp = sign_impression(
            Impression(
                event_id=impression_event_id(rid, 0), ts=now + timedelta(seconds=u), user_id=f"u-v{u}",
                request_id=rid, ad_id="ad-v", campaign_id="camp-v", advertiser_id="adv-v", slot="feed",
                position=0, price=0.5, pctr=0.05, variant_id="ab"[u % 2], variant_propensity=0.5,
            ),
            key,
        )  # fmt: skip
        imps.append(imp)
        if u % 2:
            clicks.append(
                seal(
                    Click(
                        event_id=f"k-v{u}", ts=imp.ts + timedelta(seconds=2), user_id=imp.user_id,
                        impression_id=imp.event_id, ad_id="ad-v", campaign_id="camp-v",
                    ),
                    key,
                )
            )  # fmt: skip
    return ad, imps, clicks


async def learn_until(fb: VariantFeedback, done: object, timeout_s: float) -> None:
    """Run the replica's follower until `done()` holds (or the timeout)."""
    task = asyncio.get_running_loop().create_task(fb.follow())
    try:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not done() and asyncio.get_running_loop().time() < deadline:  # type: ignore[operator]
            await asyncio.sleep(0.2)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    fb.flush()


def test_clicks_on_one_variant_move_servings_choice(deployment: Settings, tmp_path: Path) -> None:
    s = deployment.model_copy(
        update={"variants": deployment.variants.model_copy(update={"learn_interval_s": 0.2})}
    )
    key = event_key(s)
    assert key is not None
    ad, imps, clicks = traffic(key, datetime.now(UTC).replace(microsecond=0))
    selector = VariantSelector.from_settings(s, seed=0)
    selector.register(ad.ad_id, [v.variant_id for v in ad.variants])
    zero = np.zeros(s.state_dim)  # a new user's state: every user here is one
    assert selector.shares("ad-v", zero) == pytest.approx({"a": 0.5, "b": 0.5})

    produce(s, records([ad]))
    produce(s, records(imps))
    produce(s, records(clicks))
    ends = end_offsets(s)
    worker = Worker(s, tmp_path / "worker.log", "aiokafka")
    worker.start()
    try:
        r = redis.Redis.from_url(s.redis.url)
        wait_for(lambda: all_applied(r, s, ends), 120, "every record applied", worker)
        fb = VariantFeedback(s, selector)
        # the default label mode learns every impression at once as a non-click and each click as
        # a correction: USERS + USERS / 2 labels
        want = USERS + USERS // 2
        asyncio.run(learn_until(fb, lambda: fb.counts["learned"] >= want, 60))
    finally:
        worker.stop()
    assert fb.counts["learned"] == want, (fb.counts, worker.tail())
    after = selector.shares("ad-v", zero)
    assert after["b"] > 0.9 > 0.1 > after["a"], after
    picks = [v for v, _ in selector.choose(["ad-v"] * 200, np.zeros((200, s.state_dim)))]
    assert picks.count("b") > 150

    # a replica that reconnects without its positions replays the topic: nothing is learned twice
    learned = (selector.state.precision.copy(), selector.state.target.copy())
    fb.positions.clear()
    asyncio.run(learn_until(fb, lambda: fb.counts["duplicate"] >= want, 60))
    assert fb.counts["duplicate"] == want and fb.counts["learned"] == want
    assert np.array_equal(selector.state.precision, learned[0])
    assert np.array_equal(selector.state.target, learned[1])
