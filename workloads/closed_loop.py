"""The closed loop: ask a serving endpoint for ads, then play the user's response to what it served.

Only the HTTP contract is needed (`POST /v1/ads`, `schemas.api.AdRequest` → `AdResponse`), with
what a publisher says of each request: the user's declared interests, country and device, and a
search request's query (serving knows the market's campaigns and their targeting from
`Market.campaigns()` on `ad.campaigns` or in its catalog file).
Serving produces the Impression events itself, named `schemas.ids.impression_event_id(request_id,
position)`; the loop emits the clicks, dwell and conversions that reference them (plus organic
conversions and the catalog entries of ads that arrive mid-run), each when its simulated time
has come, and flushes what is still pending at the end.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import httpx
from pydantic import TypeAdapter, ValidationError

from schemas.api import SHADOW_HEADER, AdRequest, AdResponse
from schemas.codec import describe_validation_error
from schemas.events import SLOTS, Impression, Slot, View
from schemas.ids import impression_event_id
from workloads.entities import Event, UnknownEntityError
from workloads.market import Market

log = logging.getLogger(__name__)
_SHADOW: TypeAdapter[list[str]] = TypeAdapter(list[str])
VIEW_DELAY = timedelta(seconds=1)  # a served ad's render beacon follows it (half in view for 1 s)

Sink = Callable[[list[Event]], Awaitable[object]]


@dataclass
class ClosedLoopReport:
    """What a closed-loop run did: requests, served ads, emitted events and errors by reason."""

    requests: int = 0
    served: int = 0
    events: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    impressions: list[Impression] = field(default_factory=list)
    # client-side latency of every answered request, ms, in request order
    latencies_ms: list[float] = field(default_factory=list)
    # per response that carried a shadow slate (`ab.shadow_slates`), in request order
    shadows: list[ShadowSlate] = field(default_factory=list)


@dataclass(frozen=True)
class ShadowSlate:
    """One request served with adapters and its shadow slate (what it would have been served
    without them), both scored by the simulator's truth at the moment of serving: the expected
    clicks of each slate (the sum of its ads' true click probabilities at their positions)."""

    request_id: str
    user_id: str
    served_index: int  # impressions served before this request's (for before/after the drift)
    served: float  # expected clicks of the served slate
    shadow: float  # expected clicks of the shadow slate
    same: bool  # both slates are the same ads in the same order


def served_auc(report: ClosedLoopReport, market: Market) -> float:
    """AUC of the pCTR serving gave each impression of a closed-loop run (none given: 0), against
    the simulated users' clicks; nan when nothing was served."""
    from workloads.truth import auc

    if not report.impressions:
        return float("nan")
    served = [i.pctr if i.pctr is not None else 0.0 for i in report.impressions]
    _, labels = market.outcomes()
    return auc(served, labels)


def served_impressions(
    market: Market, request_user: str, slot: Slot, ts: datetime, resp: AdResponse
) -> list[Impression]:
    """The Impressions serving emitted for a response, rebuilt from the response and the catalog."""
    out = []
    for pos, ad in enumerate(resp.ads):
        advertiser = market.advertiser_id(_ad_index(market, ad.ad_id))
        out.append(
            Impression(
                event_id=impression_event_id(resp.request_id, pos),
                ts=ts,
                user_id=request_user,
                request_id=resp.request_id,
                ad_id=ad.ad_id,
                campaign_id=ad.campaign_id,
                advertiser_id=advertiser,
                slot=slot,
                position=pos,
                price=ad.price,
                pctr=ad.pctr,
                model_version=resp.model_version,
                adapter_version=resp.adapter_version,
            )
        )
    return out


def expected_clicks(market: Market, user_id: str, slot: Slot, ad_ids: Sequence[str]) -> float:
    """The expected clicks of a slate (ads in display order) shown to `user_id` now: the sum of
    each ad's true click probability at its position (no creative variant: a shadow slate has
    none, so both slates of a pair are scored alike)."""
    return float(sum(market.true_pctr(user_id, a, slot, pos) for pos, a in enumerate(ad_ids)))


def shadow_slate(
    market: Market, user_id: str, slot: Slot, resp: AdResponse, shadow: list[str], served_index: int
) -> ShadowSlate:
    """The pair of one response and its shadow slate (`ShadowSlate`)."""
    served = [ad.ad_id for ad in resp.ads]
    return ShadowSlate(
        resp.request_id, user_id, served_index, expected_clicks(market, user_id, slot, served),
        expected_clicks(market, user_id, slot, shadow), served == shadow,
    )  # fmt: skip


def _ad_index(market: Market, ad_id: str) -> int:
    ads = market.world.ads.ad_ids
    if ad_id.startswith("ad") and ad_id[2:].isdigit() and int(ad_id[2:]) < len(ads):
        return int(ad_id[2:])
    raise UnknownEntityError(f"served ad {ad_id!r} is not in this market's catalog")


def _expected_k(market: Market) -> float:
    cfg = market.config
    total = sum(cfg.slot_share.values())
    return sum(cfg.slot_share[s] / total * cfg.slot_k[s] for s in SLOTS)


class _Pending:
    """Simulated events waiting for their timestamp, released to the sink in time order."""

    def __init__(self, sink: Sink, report: ClosedLoopReport) -> None:
        self._heap: list[tuple[datetime, int, Event]] = []
        self._seq = 0
        self._sink = sink
        self._report = report

    def push(self, events: Iterable[Event]) -> None:
        for m in events:
            heapq.heappush(self._heap, (m.ts, self._seq, m))
            self._seq += 1

    async def release(self, until: datetime | None) -> None:
        """Send every event due by `until` (all of them when None)."""
        due = []
        while self._heap and (until is None or self._heap[0][0] <= until):
            due.append(heapq.heappop(self._heap)[2])
        if due:
            for m in due:
                self._report.events[m.kind] += 1
            await self._sink(due)


def _serve_outcome(
    market: Market, user_id: str, slot: Slot, now: datetime, resp: AdResponse, report: ClosedLoopReport
) -> list[Event]:
    """The served impressions of one response and the user's reactions to them."""
    try:
        imps = served_impressions(market, user_id, slot, now, resp)
    except UnknownEntityError as exc:
        log.warning("%s", exc)
        report.errors["unknown_ad"] += 1
        return []
    report.served += len(imps)
    report.impressions.extend(imps)
    # the simulated page shows every served ad: its render beacon a second later makes it an
    # impression (`schemas.billing`: what CPM campaigns pay for, attribution's views); a client's
    # views and clicks echo the token serving gave each ad (the worker drops them without it)
    out: list[Event] = []
    for imp, ad in zip(imps, resp.ads, strict=True):
        out.append(render_beacon(imp, ad.click_token))
        out += market.respond(imp, ad.click_token)
    return out


def render_beacon(imp: Impression, token: str | None) -> View:
    """The View a client sends once the served ad was in view (`VIEW_DELAY` after serving)."""
    return View(
        event_id=f"v/{imp.event_id}", ts=imp.ts + VIEW_DELAY, user_id=imp.user_id,
        impression_id=imp.event_id, ad_id=imp.ad_id, click_token=token,
    )  # fmt: skip


async def run_closed_loop(
    market: Market,
    base_url: str,
    n_requests: int,
    sink: Sink,
    *,
    rate: float = 0.0,
    timeout_s: float = 2.0,
    client: httpx.AsyncClient | None = None,
    report: ClosedLoopReport | None = None,
) -> ClosedLoopReport:
    """Send `n_requests` ad requests (at most `rate` per second when > 0) and emit the responses.

    Pass `report` to watch the run while it goes (it is filled in place and returned)."""
    # Change points given as fractions fall on the expected number of served impressions.
    market.plan(round(n_requests * _expected_k(market)))
    report = report if report is not None else ClosedLoopReport()
    pending = _Pending(sink, report)
    own = client is None
    http = client or httpx.AsyncClient(base_url=base_url, timeout=timeout_s)
    t0 = time.perf_counter()
    try:
        for i in range(n_requests):
            now = datetime.now(UTC)
            req = market.next_request(ts=now)
            pending.push(market.advance(now))
            report.requests += 1
            ask = AdRequest(
                user_id=req.user_id, slot=req.slot, k=req.k, interests=list(req.interests) or None,
                geo=req.geo, device=req.device, query=req.query,
            )  # fmt: skip
            resp, shadow = await _ask(http, ask, report)
            if resp is not None:
                if shadow is not None:
                    try:
                        pair = shadow_slate(market, req.user_id, req.slot, resp, shadow, report.served)
                        report.shadows.append(pair)
                    except UnknownEntityError as exc:
                        log.warning("shadow slate: %s", exc)
                        report.errors["unknown_shadow_ad"] += 1
                pending.push(_serve_outcome(market, req.user_id, req.slot, now, resp, report))
            pending.push(market.organic(req))
            await pending.release(datetime.now(UTC))
            if rate > 0:
                wait = t0 + (i + 1) / rate - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
        await pending.release(None)
    finally:
        if own:
            await http.aclose()
    return report


async def _ask(
    http: httpx.AsyncClient, request: AdRequest, report: ClosedLoopReport
) -> tuple[AdResponse | None, list[str] | None]:
    """POST one AdRequest: the response and its shadow slate's ads (`SHADOW_HEADER`; None
    without one); a transport error, non-200 or invalid body (or shadow header) is counted, not
    raised."""
    t0 = time.perf_counter()
    try:
        r = await http.post("/v1/ads", content=request.model_dump_json(exclude_none=True),
                            headers={"content-type": "application/json"})  # fmt: skip
    except httpx.HTTPError as exc:
        log.warning("ad request failed: %s", exc)
        report.errors["transport"] += 1
        return None, None
    if r.status_code != 200:
        report.errors[f"http_{r.status_code}"] += 1
        return None, None
    report.latencies_ms.append(1000 * (time.perf_counter() - t0))
    try:
        resp = AdResponse.model_validate_json(r.content)
    except ValidationError as exc:
        log.warning("invalid AdResponse: %s", describe_validation_error(exc))
        report.errors["invalid_response"] += 1
        return None, None
    header = r.headers.get(SHADOW_HEADER)
    if header is None:
        return resp, None
    try:
        return resp, _SHADOW.validate_json(header)
    except ValidationError as exc:
        log.warning("invalid %s header: %s", SHADOW_HEADER, describe_validation_error(exc))
        report.errors["invalid_shadow"] += 1
        return resp, None
