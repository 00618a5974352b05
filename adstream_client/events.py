"""Events a client reports about ads it was served: the render beacon (a `View`: the ad was in
view, which makes the served ad an impression), the click, and the dwell (time on the landing
page), each naming the impression by `schemas.ids.impression_event_id` and echoing the ad's click
token; their event ids derive from the impression's, so a resent one counts once."""

from __future__ import annotations

from datetime import UTC, datetime

from schemas.api import AdResponse
from schemas.errors import SchemaError
from schemas.events import MAX_DWELL_MS, Click, Dwell, View
from schemas.ids import impression_event_id


def _served(resp: AdResponse, position: int) -> tuple[str, str]:
    if not 0 <= position < len(resp.ads):
        raise SchemaError(f"position {position} is not in the response ({len(resp.ads)} ads)")
    ad = resp.ads[position]
    if ad.click_token is None:
        raise SchemaError(f"ad {ad.ad_id!r} at position {position} carries no click token")
    return impression_event_id(resp.request_id, position), ad.click_token


def view_for(resp: AdResponse, position: int, user_id: str, ts: datetime | None = None) -> View:
    """The render beacon of the ad at `position` of `resp` (served to `user_id`): send it when
    the ad is in view (the web snippet: half of it visible for a second). Until it arrives the
    served ad is no impression: CPM campaigns pay for it and attribution counts it only then."""
    iid, token = _served(resp, position)
    return View(
        event_id=f"v/{iid}",
        ts=ts or datetime.now(UTC),
        user_id=user_id,
        impression_id=iid,
        ad_id=resp.ads[position].ad_id,
        click_token=token,
    )


def click_for(resp: AdResponse, position: int, user_id: str, ts: datetime | None = None) -> Click:
    """The Click of the ad at `position` of `resp` (served to `user_id`)."""
    iid, token = _served(resp, position)
    ad = resp.ads[position]
    return Click(
        event_id=f"c/{iid}",
        ts=ts or datetime.now(UTC),
        user_id=user_id,
        impression_id=iid,
        ad_id=ad.ad_id,
        campaign_id=ad.campaign_id,
        click_token=token,
    )


def dwell_for(
    resp: AdResponse, position: int, user_id: str, dwell_ms: int, ts: datetime | None = None
) -> Dwell:
    """The Dwell of the ad at `position`: `dwell_ms` spent on its landing page after the click."""
    iid, token = _served(resp, position)
    return Dwell(
        event_id=f"d/{iid}",
        ts=ts or datetime.now(UTC),
        user_id=user_id,
        impression_id=iid,
        ad_id=resp.ads[position].ad_id,
        dwell_ms=min(max(dwell_ms, 0), MAX_DWELL_MS),
        click_token=token,
    )
