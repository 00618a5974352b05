"""Events a client reports about ads it was served: the click and the view (a dwell of the
impression), each naming the impression by `schemas.ids.impression_event_id` and echoing the
ad's click token; their event ids derive from the impression's, so a resent one counts once."""

from __future__ import annotations

from datetime import UTC, datetime

from schemas.api import AdResponse
from schemas.errors import SchemaError
from schemas.events import MAX_DWELL_MS, Click, Dwell
from schemas.ids import impression_event_id


def _served(resp: AdResponse, position: int) -> tuple[str, str]:
    if not 0 <= position < len(resp.ads):
        raise SchemaError(f"position {position} is not in the response ({len(resp.ads)} ads)")
    ad = resp.ads[position]
    if ad.click_token is None:
        raise SchemaError(f"ad {ad.ad_id!r} at position {position} carries no click token")
    return impression_event_id(resp.request_id, position), ad.click_token


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


def view_for(
    resp: AdResponse, position: int, user_id: str, dwell_ms: int, ts: datetime | None = None
) -> Dwell:
    """The view of the ad at `position`: a Dwell of its impression, `dwell_ms` in view."""
    iid, token = _served(resp, position)
    return Dwell(
        event_id=f"v/{iid}",
        ts=ts or datetime.now(UTC),
        user_id=user_id,
        impression_id=iid,
        ad_id=resp.ads[position].ad_id,
        dwell_ms=min(max(dwell_ms, 0), MAX_DWELL_MS),
        click_token=token,
    )
