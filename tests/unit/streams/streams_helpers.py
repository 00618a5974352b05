"""Valid contract events for streams tests (until/besides the workloads simulator)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from schemas.events import AdCreative, Click, Dwell, Impression

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def creative(ad_id: str = "ad1", category: str = "shoes", title: str = "Red running shoes") -> AdCreative:
    return AdCreative(
        event_id=f"cat-{ad_id}",
        ts=T0 - timedelta(days=1),
        ad_id=ad_id,
        campaign_id=f"camp-{ad_id}",
        advertiser_id=f"adv-{category}",
        category=category,
        title=title,
        bid=1.0,
        daily_budget=100.0,
        active=True,
    )


def impression(eid: str, t: float, user: str = "u1", ad: str = "ad1", slot: str = "feed") -> Impression:
    return Impression(
        event_id=eid,
        ts=at(t),
        user_id=user,
        request_id=f"req-{eid}",
        ad_id=ad,
        campaign_id=f"camp-{ad}",
        advertiser_id="adv-shoes",
        slot=slot,  # type: ignore[arg-type]
        position=0,
        price=0.5,
        pctr=0.1,
    )


def click(eid: str, t: float, imp: str, user: str = "u1", ad: str = "ad1") -> Click:
    return Click(event_id=eid, ts=at(t), user_id=user, impression_id=imp, ad_id=ad, campaign_id=f"camp-{ad}")


def dwell(eid: str, t: float, imp: str, ms: int, user: str = "u1", ad: str = "ad1") -> Dwell:
    return Dwell(event_id=eid, ts=at(t), user_id=user, impression_id=imp, ad_id=ad, dwell_ms=ms)
