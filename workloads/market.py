"""A seeded ad market whose truth is known: who clicks, how long they stay, what converts and why.

Public API (names are stable; other rooms build test streams and benchmarks on them):

- `MarketConfig(seed=…, n_users=…, n_ads=…, drift_at=…, drift_share=…, new_ads_at=…, rate=…)`
- `Market(config, signing_key=None)` (with the stack's event key: impressions signed, clicks
  with their tokens, see `schemas.signing`); `market.catalog()` → the initial `AdCreative`s
  (`catalog(include_new=True)` adds the ads that arrive mid-stream)
- `market.open_loop(n_impressions)` → an iterator of contract messages in time order: the
  catalog first, then `Impression`/`Click`/`Dwell`/`Conversion`, and new-ad `AdCreative`s when
  they arrive (cold start); a logging policy (`config.policy`) picks the ads.
- `market.declared_interests(user_id)` → the categories the user declared (their true top
  `declared_interests` ones, each swapped with probability `declared_error`); every `Request`
  carries them, and the user's country and device; search requests carry a query text.
- `market.campaigns()` → a `Campaign` entry per campaign, some targeting countries or devices
  (`workloads.audience`), a `cpm_share` of them paying per thousand shown impressions (their
  creatives bid per mille: `market.bid(ad)`, `market.bid_type(ad)`); the rest pay per click.
- `market.oracle_pctr(impression_or_event_id)` → the true click probability of an emitted
  impression; `market.true_pctr(user_id, ad_id, slot, position)` for any pair, now.
- `market.next_request()` / `market.respond(impression)` / `market.organic(request)` drive the
  closed loop (see `workloads.closed_loop`); `market.true_channel_credit()` → each channel's
  share of the touch-caused conversions, exact in expectation; `market.summary()`.

The true model: p(click) = σ(scale·interest[user, category(ad)] + quality[ad]
+ advertiser_effect + slot_effect[slot] + position_bias[position] + bias). A clicked ad gets a
dwell: a bounce under 2 s (likelier for poor matches) or a lognormal stay. Every impression in
channel c causes a conversion with probability lift[c] after an exponential delay, and each
request converts organically with probability `base_conversion`: the hazard is additive, so the
channel credit is lift[c]·touches[c] / Σ. At `drift_at` a `drift_share` of users redraw their
tastes (`drift_mode="redraw"`) or follow a shared trend (`"trend"`: interest in `trend_up`
categories rises by `trend_delta`, in `trend_down` falls by it) or see one season hand over to
the next (`"handover"`: `trend_up` categories in season before, `trend_up` others after); at
`new_ads_at` `n_new_ads` new
creatives arrive. Users arrive in sessions (a few
requests seconds apart; see `next_request`) at `rate` requests per simulated second on average.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta

import numpy as np

from schemas.billing import PER_MILLE
from schemas.errors import AdstreamError
from schemas.events import SLOTS, AdCreative, BidType, Campaign, Click, Conversion, Dwell, Impression
from schemas.signing import click_token, sign_impression
from schemas.vectors import content_vector
from workloads import truth
from workloads.audience import campaigns, cpm_campaigns, draw_audience, search_query
from workloads.config import MarketConfig, resolve_at
from workloads.entities import Event, Request, UnknownEntityError, index_of
from workloads.policy import make_policy
from workloads.summary import Summary, summarize
from workloads.variants import (
    VariantWorld,
    build_variant_world,
    state_vectors,
    variant_creatives,
    variant_index,
)
from workloads.world import build_world

__all__ = ["Event", "Market", "Request", "UnknownEntityError"]


class Market:
    """A simulated ad market; see the module docstring for the model and the API."""

    def __init__(self, config: MarketConfig | None = None, *, signing_key: bytes | None = None) -> None:
        self.config = cfg = config or MarketConfig()
        # the stack's event key (`schemas.signing.event_key`): a logged history is the operator's
        # own, so its impressions are signed and its clicks carry their tokens, as served ones do
        self.signing_key = signing_key
        self.world = build_world(cfg)
        self.variants: VariantWorld | None = None
        if cfg.n_variants:
            self.variants = build_variant_world(
                cfg.seed, self.world.interests, len(self.world.ads.ad_ids), cfg.n_variants,
                cfg.n_segments, cfg.variant_effect_sd, cfg.variant_own_sd, cfg.variant_main_sd,
            )  # fmt: skip
        traffic, response = np.random.SeedSequence([cfg.seed, 1]).spawn(2)
        self._traffic = np.random.default_rng(traffic)
        self._resp = np.random.default_rng(response)
        # the audience and search text draw from streams of their own (`workloads.audience`)
        self.audience = draw_audience(cfg)
        self.cpm = cpm_campaigns(cfg)  # which (advertiser, campaign) pays per mille shown
        self._bids: dict[int, float] = {}
        self._queries = np.random.default_rng(np.random.SeedSequence([cfg.seed, 4]))
        self._policy = make_policy(cfg.policy, len(self.world.ads.ad_ids), cfg.epsilon)
        self._interest = self.world.interests.copy()
        self._active = np.arange(cfg.n_ads)
        activity = np.exp(np.random.default_rng([cfg.seed, 2]).normal(0.0, 1.0, cfg.n_users))
        self._user_cdf = np.cumsum(activity) / activity.sum()
        shares = np.array([cfg.slot_share[s] for s in SLOTS], dtype=float)
        self._slot_cdf = np.cumsum(shares) / shares.sum()
        self._pos_bias = np.asarray(cfg.position_bias)
        self._start = cfg.start
        self._counter = 0
        self._requests = 0
        self._sessions: list[tuple[int, int, int, int]] = []  # (next request µs, seq, user, left)
        self._next_session_us = 0
        self._oracle = array("d")  # by event counter; NaN for non-impressions
        self._foreign_oracle: dict[str, float] = {}
        self._labels = array("b")
        self._scores = array("d")
        self._frozen = array("d")  # pre-drift truth of each impression after the drift
        self.counts: Counter[str] = Counter()
        self.touches: Counter[str] = Counter()
        self.caused: Counter[str] = Counter()  # realised touch-caused conversions per channel
        self.organic_conversions = 0
        self.n_impressions = 0
        self._drift_index: int | None = None
        self._new_ads_index: int | None = None
        self.drift_ts: datetime | None = None
        self.drift_impression: int | None = None
        self.new_ads_ts: datetime | None = None
        self.plan(None)

    # -- identities --------------------------------------------------------------------
    def user_id(self, user: int) -> str:
        return f"u{user:06d}"

    def declared_interests(self, user_id: str) -> tuple[str, ...]:
        """The categories `user_id` declared (their true top ones, some swapped: `declared_error`)."""
        user = index_of(user_id, "u", self.config.n_users, "user")
        return tuple(self.world.categories[int(c)] for c in self.world.declared[user])

    def advertiser_id(self, ad: int) -> str:
        return f"adv{int(self.world.ads.advertiser[ad]):03d}"

    def campaign_id(self, ad: int) -> str:
        a = self.world.ads
        return f"cmp{int(a.advertiser[ad]):03d}_{int(a.campaign[ad])}"

    def _event_id(self, pctr: float = math.nan) -> str:
        n = self._counter
        self._counter += 1
        self._oracle.append(pctr)
        return f"{self.config.prefix}{n:09d}"

    def _ts(self, us: int) -> datetime:
        return self._start + timedelta(microseconds=us)

    def _us(self, ts: datetime) -> int:
        return (ts - self._start) // timedelta(microseconds=1)

    # -- catalog -------------------------------------------------------------------------
    def creative(self, ad: int, ts: datetime | None = None) -> AdCreative:
        """The catalog entry of ad index `ad`."""
        a = self.world.ads
        return AdCreative(
            event_id=f"{self.config.prefix}cat-{a.ad_ids[ad]}",
            ts=ts or self._start,
            ad_id=a.ad_ids[ad],
            campaign_id=self.campaign_id(ad),
            advertiser_id=self.advertiser_id(ad),
            category=self.world.categories[int(a.category[ad])],
            title=a.titles[ad],
            bid=self.bid(ad),
            daily_budget=float(a.daily_budget[ad]),
            active=True,
            variants=() if self.variants is None else variant_creatives(self.variants, ad, a.titles[ad]),
        )

    def ad_vector(self, ad_id: str, dim: int) -> list[float]:
        """The shared content vector of an ad (`schemas.vectors.content_vector`)."""
        ad = index_of(ad_id, "ad", len(self.world.ads.ad_ids), "ad")
        category = self.world.categories[int(self.world.ads.category[ad])]
        return content_vector(category, self.world.ads.titles[ad], dim)

    def catalog(self, include_new: bool = False) -> list[AdCreative]:
        """The ads live at the start (and, with `include_new`, those that arrive later)."""
        n = len(self.world.ads.ad_ids) if include_new else self.config.n_ads
        return [self.creative(i) for i in range(n)]

    def campaigns(self, include_new: bool = False) -> list[Campaign]:
        """The `Campaign` entries of the catalog's campaigns, some with targeting
        (`workloads.audience.campaigns`)."""
        return campaigns(self.config, self.world, include_new, self._start, self.cpm)

    def bid_type(self, ad: int) -> BidType:
        """How the campaign of ad index `ad` pays: "cpm" per thousand shown, "cpc" per click."""
        a = self.world.ads
        return "cpm" if self.cpm[int(a.advertiser[ad]), int(a.campaign[ad])] else "cpc"

    def bid(self, ad: int) -> float:
        """The bid of ad index `ad` in its campaign's unit: the drawn per-click bid, or for a CPM
        campaign what that bid is worth per thousand impressions at the ad's click rate in the
        population (before any drift, atop the feed): the same expected value per impression,
        so the auction weighs CPM and CPC ads by what they are worth, not by their unit."""
        a = self.world.ads
        cpc = float(a.bid[ad])
        if self.bid_type(ad) == "cpc":
            return cpc
        if ad not in self._bids:
            cfg = self.config
            interest = self.world.interests[:2000, int(a.category[ad])]  # a fixed sample of users
            logit = truth.click_logit(
                interest,  # type: ignore[arg-type]  # elementwise over the users
                interest_scale=cfg.interest_scale,
                ad_quality=float(a.quality[ad]),
                advertiser_effect=float(self.world.advertiser_effect[int(a.advertiser[ad])]),
                slot_effect=cfg.slot_effect["feed"],
                position_bias=float(self._pos_bias[0]),
                bias=cfg.bias,
            )
            ctr = float(np.mean(1.0 / (1.0 + np.exp(-np.asarray(logit)))))
            self._bids[ad] = round(cpc * ctr * PER_MILLE, 4) + 0.0001
        return self._bids[ad]

    # -- truth ---------------------------------------------------------------------------
    def _pctr(
        self, user: int, ad: int, slot: str, position: int, frozen: bool = False, variant: int | None = None
    ) -> float:
        logit = self._logit(user, ad, slot, position, frozen)
        if variant is not None and self.variants is not None:
            logit += float(self.variants.effects(np.array([user]), np.array([ad]))[0, variant])
        return truth.sigmoid(logit)

    def _logit(self, user: int, ad: int, slot: str, position: int, frozen: bool = False) -> float:
        """The true click logit of a user-ad pair without a variant's effect."""
        cfg, a = self.config, self.world.ads
        pos = self._pos_bias[min(position, len(self._pos_bias) - 1)]
        interest = self.world.interests if frozen else self._interest
        return truth.click_logit(
            float(interest[user, int(a.category[ad])]),
            interest_scale=cfg.interest_scale,
            ad_quality=float(a.quality[ad]),
            advertiser_effect=float(self.world.advertiser_effect[int(a.advertiser[ad])]),
            slot_effect=cfg.slot_effect[slot],
            position_bias=float(pos),
            bias=cfg.bias,
        )

    def population_pctr(self, ad_id: str, slot: str, position: int) -> float:
        """The click probability of `ad_id` here for a user of average taste (the population's
        mean interest in its category, now): the best score without knowing who the user is.
        Comparing a model's AUC with this and with the oracle's separates what it learned about
        ads, slots and positions from what it learned about each user."""
        ad = index_of(ad_id, "ad", len(self.world.ads.ad_ids), "ad")
        cfg, a = self.config, self.world.ads
        pos = self._pos_bias[min(position, len(self._pos_bias) - 1)]
        logit = truth.click_logit(
            float(self._interest[:, int(a.category[ad])].mean()),
            interest_scale=cfg.interest_scale,
            ad_quality=float(a.quality[ad]),
            advertiser_effect=float(self.world.advertiser_effect[int(a.advertiser[ad])]),
            slot_effect=cfg.slot_effect[slot],
            position_bias=float(pos),
            bias=cfg.bias,
        )
        return truth.sigmoid(logit)

    def true_pctr(
        self, user_id: str, ad_id: str, slot: str, position: int, variant_id: str | None = None
    ) -> float:
        """The true click probability of showing `ad_id` (its variant `variant_id`, when the
        market has variants) to `user_id` now (after any drift)."""
        user = index_of(user_id, "u", self.config.n_users, "user")
        ad = index_of(ad_id, "ad", len(self.world.ads.ad_ids), "ad")
        return self._pctr(user, ad, slot, position, variant=self._variant(variant_id))

    def _variant(self, variant_id: str | None) -> int | None:
        if variant_id is None:
            return None
        n = self.config.n_variants
        v = variant_index(variant_id, n)
        if v is None:
            raise UnknownEntityError(f"variant {variant_id!r} is not one of this market's {n} variants (v0…)")
        return v

    def true_variant_pctrs(self, users: np.ndarray, ads: np.ndarray, slot: str, position: int) -> np.ndarray:
        """The true click probability of every variant, (len(users), n_variants), for user-ad
        index pairs now: the truth of a variant-selection policy (its regret, its value)."""
        if self.variants is None:
            raise AdstreamError("this market has no variants (MarketConfig.n_variants = 0)")
        base = np.array(
            [self._logit(int(u), int(a), slot, position) for u, a in zip(users, ads, strict=True)]
        )
        z = base[:, None] + self.variants.effects(users, ads)
        out: np.ndarray = 1.0 / (1.0 + np.exp(-z))
        return out

    def user_states(self, dim: int) -> np.ndarray:
        """Every user's state vector (n_users, dim) as the streams worker comes to hold it
        (`workloads.variants.state_vectors`, from the tastes before any drift)."""
        return state_vectors(self.world.interests, self.world.categories, dim)

    def oracle_pctr(self, impression: Impression | str) -> float:
        """The true click probability an emitted (or responded-to) impression had when shown."""
        event_id = impression if isinstance(impression, str) else impression.event_id
        if event_id in self._foreign_oracle:
            return self._foreign_oracle[event_id]
        prefix = self.config.prefix
        tail = event_id[len(prefix) :]
        if event_id.startswith(prefix) and tail.isdigit() and int(tail) < len(self._oracle):
            value = self._oracle[int(tail)]
            if not math.isnan(value):
                return value
        raise UnknownEntityError(f"event {event_id!r} is not an impression this market emitted")

    def true_channel_credit(self) -> dict[str, float]:
        """Each channel's share of touch-caused conversions over the impressions so far (exact
        in expectation: lift[c]·touches[c] / Σ)."""
        return truth.channel_credit(self.touches, self.config.channel_lift)

    # -- change points -------------------------------------------------------------------
    def plan(self, n_impressions: int | None) -> None:
        """Place drift and new-ad arrival for a run of `n_impressions` (fractions need it)."""
        cfg = self.config
        for attr, at in (("_drift_index", cfg.drift_at), ("_new_ads_index", cfg.new_ads_at)):
            if at is not None and at < 1 and n_impressions is None:
                setattr(self, attr, None)
            else:
                setattr(self, attr, resolve_at(at, n_impressions or 0))

    def advance(self, ts: datetime) -> list[Event]:
        """Apply the drift or new-ad arrival if due by now (closed loop); returns arriving ads."""
        return self._advance(self._us(ts))

    def _advance(self, ts_us: int) -> list[Event]:
        """Apply change points that are due; returns the catalog events of arriving ads."""
        out: list[Event] = []
        if (
            self._drift_index is not None
            and self.drift_ts is None
            and self.n_impressions >= self._drift_index
        ):
            mask = self.world.drift_users
            self._interest[mask] = self.world.interests_after[mask]
            self.drift_ts, self.drift_impression = self._ts(ts_us), self.n_impressions
        due = self._new_ads_index is not None and self.n_impressions >= self._new_ads_index
        if due and self.new_ads_ts is None and self.config.n_new_ads > 0:
            self.new_ads_ts = self._ts(ts_us)
            self._active = np.arange(len(self.world.ads.ad_ids))
            for ad in range(self.config.n_ads, len(self.world.ads.ad_ids)):
                out.append(self.creative(ad, self.new_ads_ts))
        self.counts["ad"] += len(out)
        return out

    # -- traffic -------------------------------------------------------------------------
    def next_request(self, ts: datetime | None = None) -> Request:
        """The next ad request, in simulated time unless `ts` is given (closed loop).

        Users come in sessions: sessions start as a Poisson process (user by activity), make a
        geometric number of requests (mean `session_requests`) spaced by exponential gaps (mean
        `session_gap_s`); the overall request rate is `rate`. Each request picks a slot by share.
        """
        cfg, rng = self.config, self._traffic
        if self._sessions and self._sessions[0][0] < self._next_session_us:
            t_us, _, user, left = heapq.heappop(self._sessions)
        else:
            t_us = self._next_session_us
            u = int(np.searchsorted(self._user_cdf, rng.random(), side="right"))
            user, left = min(u, cfg.n_users - 1), int(rng.geometric(1.0 / cfg.session_requests))
            mean_start_gap = cfg.session_requests / cfg.rate
            self._next_session_us += 1 + int(rng.exponential(mean_start_gap) * 1e6)
        if left > 1:
            gap = 1 + int(rng.exponential(cfg.session_gap_s) * 1e6)
            heapq.heappush(self._sessions, (t_us + gap, self._requests, user, left - 1))
        slot = SLOTS[min(int(np.searchsorted(self._slot_cdf, rng.random(), side="right")), 2)]
        self._requests += 1
        uid = self.user_id(user)
        geo, device = self.audience.of(user)
        query = search_query(self._queries, self.world, user) if slot == "search" else None
        return Request(uid, user, slot, cfg.slot_k[slot], ts or self._ts(t_us), self.declared_interests(uid),
                       geo, device, query)  # fmt: skip

    def _outcomes(
        self, imp: Impression, user: int, ad: int, p: float, token: str | None = None
    ) -> tuple[bool, list[Event]]:
        """Click, dwell and caused conversion of one impression, drawn from the true model; the
        click and dwell carry `token` (the served ad's click token)."""
        cfg, rng = self.config, self._resp
        out: list[Event] = []
        clicked = bool(rng.random() < p)
        t = self._us(imp.ts)
        if clicked:
            t_click = t + 1 + int(rng.exponential(cfg.click_delay_s) * 1e6)
            out.append(
                Click(
                    event_id=self._event_id(),
                    ts=self._ts(t_click),
                    user_id=imp.user_id,
                    impression_id=imp.event_id,
                    ad_id=imp.ad_id,
                    campaign_id=imp.campaign_id,
                    click_token=token,
                )
            )
            match = truth.match_score(float(self._interest[user, int(self.world.ads.category[ad])]))
            dwell = truth.sample_dwell_ms(
                rng,
                match,
                median_ms=cfg.dwell_median_ms,
                sigma=cfg.dwell_sigma,
                bounce_prob_max=cfg.bounce_prob_max,
            )
            out.append(
                Dwell(
                    event_id=self._event_id(),
                    ts=self._ts(t_click + dwell * 1000),
                    user_id=imp.user_id,
                    impression_id=imp.event_id,
                    ad_id=imp.ad_id,
                    dwell_ms=dwell,
                    click_token=token,
                )
            )
        self.touches[imp.slot] += 1
        if rng.random() < cfg.channel_lift[imp.slot]:
            self.caused[imp.slot] += 1
            out.append(self._conversion(user, ad, t))
        self._labels.append(int(clicked))
        self._scores.append(p)
        if self.drift_impression is not None:
            self._frozen.append(self._pctr(user, ad, imp.slot, imp.position, frozen=True))
        self.n_impressions += 1
        return clicked, out

    def _conversion(self, user: int, ad: int, t_us: int) -> Conversion:
        cfg, rng = self.config, self._resp
        delay = 1 + int(rng.exponential(cfg.conversion_delay_s) * 1e6)
        value = round(float(rng.exponential(cfg.conversion_value_mean)), 2)
        return Conversion(
            event_id=self._event_id(),
            ts=self._ts(t_us + delay),
            user_id=self.user_id(user),
            campaign_id=self.campaign_id(ad),
            advertiser_id=self.advertiser_id(ad),
            value=value,
        )

    def organic(self, request: Request) -> list[Event]:
        """An organic conversion (no ad caused it) for a campaign in the user's top category."""
        if self._resp.random() >= self.config.base_conversion:
            return []
        top = int(np.argmax(self._interest[request.user]))
        cands = self._active[self.world.ads.category[self._active] == top]
        pool = cands if len(cands) else self._active
        ad = int(pool[int(self._resp.integers(len(pool)))])
        self.organic_conversions += 1
        return [self._conversion(request.user, ad, self._us(request.ts))]

    def respond(self, impression: Impression, click_token: str | None = None) -> list[Event]:
        """The user's reaction to a served impression: click, dwell and caused conversion events
        (timestamps after the impression's); the click and dwell echo `click_token`, the served
        ad's (`ServedAd.click_token`). Records the impression's oracle pCTR."""
        user = index_of(impression.user_id, "u", self.config.n_users, "user")
        ad = index_of(impression.ad_id, "ad", len(self.world.ads.ad_ids), "ad")
        variant = self._variant(impression.variant_id)
        p = self._pctr(user, ad, impression.slot, impression.position, variant=variant)
        self._foreign_oracle[impression.event_id] = p
        _, out = self._outcomes(impression, user, ad, p, click_token)
        for m in out:
            self.counts[m.kind] += 1
        return out

    # -- open loop -----------------------------------------------------------------------
    def open_loop(self, n_impressions: int) -> Iterator[Event]:
        """The whole stream of a logged run, in time order, `n_impressions` impressions long."""
        if n_impressions < 0:
            raise ValueError(f"n_impressions must be >= 0, got {n_impressions}")
        if self._requests or self.n_impressions:
            raise AdstreamError("a Market runs once: make a new Market(config) for another stream")
        self.plan(n_impressions)
        for creative in self.catalog():
            self.counts["ad"] += 1
            yield creative
        heap: list[tuple[int, int, Event]] = []
        seq = 0
        cfg = self.config
        model_version = f"logging-{cfg.policy}"
        key = self.signing_key
        while self.n_impressions < n_impressions:
            req = self.next_request()
            t = self._us(req.ts)
            while heap and heap[0][0] <= t:
                msg = heapq.heappop(heap)[2]
                self.counts[msg.kind] += 1
                yield msg
            yield from self._advance(t)
            k = min(req.k, n_impressions - self.n_impressions, len(self._active))
            for pos, ad in enumerate(self._policy.choose(self._traffic, self._active, k)):
                if pos:  # change points fall on their exact impression index
                    yield from self._advance(t)
                ad = int(ad)
                # variants: a uniformly random one, recorded with its propensity (off-policy logs)
                variant = int(self._traffic.integers(cfg.n_variants)) if cfg.n_variants else None
                p = self._pctr(req.user, ad, req.slot, pos, variant=variant)
                imp = Impression(
                    event_id=self._event_id(p), ts=req.ts, user_id=req.user_id,
                    request_id=f"{self.config.prefix}r{self._requests - 1:09d}",
                    ad_id=self.world.ads.ad_ids[ad], campaign_id=self.campaign_id(ad),
                    advertiser_id=self.advertiser_id(ad), slot=req.slot, position=pos,
                    price=round(self.bid(ad) * 0.8, 4), model_version=model_version,
                    variant_id=None if variant is None else f"v{variant}",
                    variant_propensity=None if variant is None else 1.0 / cfg.n_variants,
                    # a market with CPM campaigns says how each pays (billed as shown, `render`
                    # None); without, as before: no bid type
                    bid_type=self.bid_type(ad) if cfg.cpm_share else None,
                )  # fmt: skip
                token = None
                if key is not None:
                    imp = sign_impression(imp, key)
                    token = click_token(key, imp.event_id, imp.user_id, imp.ad_id)
                self.counts["impression"] += 1
                yield imp
                clicked, outs = self._outcomes(imp, req.user, ad, p, token)
                self._policy.update(ad, clicked)
                for m in outs:
                    heapq.heappush(heap, (self._us(m.ts), seq, m))
                    seq += 1
            for m in self.organic(req):
                heapq.heappush(heap, (self._us(m.ts), seq, m))
                seq += 1
        while heap:
            msg = heapq.heappop(heap)[2]
            self.counts[msg.kind] += 1
            yield msg

    def outcomes(self) -> tuple[np.ndarray, np.ndarray]:
        """(oracle pCTR, clicked) of every impression emitted or responded to, in order."""
        scores = np.frombuffer(self._scores, dtype=np.float64) if len(self._scores) else np.zeros(0)
        labels = np.frombuffer(self._labels, dtype=np.int8) if len(self._labels) else np.zeros(0, np.int8)
        return scores.copy(), labels.astype(bool)

    def frozen_pctr_after_drift(self) -> np.ndarray:
        """For each impression since the drift, the click probability the pre-drift truth gives
        it: the best a model frozen at the drift can do (compare with `outcomes()[0]`)."""
        return np.frombuffer(self._frozen, dtype=np.float64).copy() if len(self._frozen) else np.zeros(0)

    def summary(self) -> Summary:
        """Counts by kind, CTR, oracle AUC, channel credit and change points of the run so far."""
        return summarize(self)
