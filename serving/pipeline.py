"""The per-request pipeline without Ray: recall → (rank, done by the caller) → rerank → response.

`AdPipeline` owns the catalog, the recall index, the rank model and the stage-cost estimates;
the Ray Serve ingress (`serving.app`) is a thin async shell around it.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import NamedTuple

import numpy as np

from schemas.api import AdRequest, AdResponse, RankRequest, RankResponse, ServedAd, StageMs
from schemas.billing import PER_MILLE
from schemas.events import AbArm, AdCreative, Impression, Render
from schemas.ids import adapter_id_for, impression_event_id
from schemas.settings import Settings
from schemas.signing import click_token, event_key, impression_sig_of
from schemas.vectors import content_vector
from serving.adapters import CANDIDATE
from serving.arms import uses_adapters
from serving.catalog import Audience, Catalog
from serving.deadline import Deadline, Rung, StageCosts
from serving.explore import Explored, explore
from serving.index import ExactIndex, exact_search, exact_search_many
from serving.interests import CategoryCentroids, CentroidTable, interest_prior
from serving.ranking import RankInput, RankModel, build_input
from serving.recall_index import make_index
from serving.rerank import RerankResult, pacing_factor, rerank
from serving.text import join_matches, query_match, query_matches, text_match
from serving.towers import TowerSpace
from serving.variants import VariantSelector


@dataclass(frozen=True)
class UserView:
    """What serving reads of a user: the state vector and intent scores per category (decayed),
    and the per-user correction: a logit bias per category added to the ranker's logit
    (`streams.state`, `state.feedback_lr`)."""

    vector: np.ndarray
    intents: Mapping[str, float]
    bias: Mapping[str, float] = field(default_factory=dict)


@dataclass
class Recalled:
    """Recall's output for one request: candidate rows, their recall scores, the rank input."""

    rows: np.ndarray
    scores: np.ndarray
    rank_input: RankInput | None


def _by_code(by_name: Mapping[str, float], codes: Mapping[str, int]) -> np.ndarray:
    """Per-category values as an array indexed by the catalog's category codes (0 elsewhere;
    names the catalog does not know are left out)."""
    out = np.zeros(len(codes), dtype=np.float32)
    for name, value in by_name.items():
        code = codes.get(name)
        if code is not None:
            out[code] = value
    return out


def content_vectorizer(dim: int) -> Callable[[AdCreative], np.ndarray]:
    """Ad vectors in the shared content space (`schemas.vectors`), used until an ad tower exists."""

    def vec(ad: AdCreative) -> np.ndarray:
        return np.asarray(content_vector(ad.category, ad.title, dim), dtype=np.float32)

    return vec


def audience_of(req: AdRequest, now: datetime | None) -> Audience:
    """The request's audience for campaign schedules and targeting (`serving.catalog`)."""
    return Audience.of(now or datetime.now(UTC), req.geo, req.device, req.interests)


def recall_pctr(scores: np.ndarray, prior_ctr: float = 0.02) -> np.ndarray:
    """A pCTR from a recall (cosine-like) score, for the `recall_score` rung: logistic around the prior."""
    base = math.log(prior_ctr / (1 - prior_ctr))
    return 1.0 / (1.0 + np.exp(-(base + 2.0 * np.asarray(scores, dtype=np.float64))))


@dataclass
class RequestContext:
    """One `/v1/ads` request on its way down the ladder: what it asks, when, on which canary
    arm, which rung it is on, and what each stage has produced so far."""

    req: AdRequest
    request_id: str
    now: datetime
    arm: int = CANDIDATE
    ab_arm: AbArm = "learning"  # live learning's A/B arm (`serving.arms`)
    rung: Rung = "adapter"
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pctr: np.ndarray = field(default_factory=lambda: np.zeros(0))
    capped: list[str] = field(default_factory=list)
    # the time each stage took (ms, set by `serving.request`'s timing wrapper): redis (the user
    # read), recall, rank, rerank, record
    stage_ms: dict[str, float] = field(default_factory=dict)
    # the user's state vector (read for recall): the context of the creative variant choice
    user_vector: np.ndarray | None = None
    deadline: Deadline | None = None  # None: no deadline (tests, tools)
    canary_arm: str = "stable"  # the canary arm (`serving.canary.Arm`) the request counts for
    user: UserView | None = None  # the user's state as read (None: cold or not read)
    recalled: Recalled | None = None
    # what rank scored (the recalled input with its adapters' bank rows): the served ads are
    # scored again from it at their positions (`serving.request.RequestPath.at_positions`)
    scored: RankInput | None = None
    scored_adapters: bool = False  # whether rank scored `scored` with the adapters (the same flag again)
    # the user read did not answer within its share of the deadline (or failed): served without it
    read_missed: bool = False
    # `/v1/rank`: the caller's candidates the catalog does not hold, and those it may not show
    unknown: list[str] = field(default_factory=list)
    ineligible: list[str] = field(default_factory=list)
    # `ab.shadow_slates` (measurement only): the candidates' pCTR without adapters, and the ads
    # that pCTR would have served (`serving.request.RequestPath.rerank`)
    shadow_pctr: np.ndarray | None = None
    shadow_ads: list[str] | None = None


class AdPipeline:
    """Recall and rerank over the replica's catalog, with the rank model and adapter ids at hand."""

    def __init__(
        self,
        settings: Settings,
        rank: RankModel,
        catalog: Catalog,
        towers: TowerSpace | None = None,
        on_interests: Callable[[str, int], None] | None = None,
    ) -> None:
        self.settings = settings
        # every impression is signed and every served ad carries its click token (M10)
        self.event_key = event_key(settings)
        # slots rendered on the server: their ads are shown when served (`schemas.billing`)
        self.shown_on_serve = frozenset(settings.serving.shown_on_serve)
        self.towers = towers
        self.rank = rank
        self.catalog = catalog
        self.index = make_index(settings, catalog.vectors, catalog.n)
        self.costs = StageCosts()
        self.params = settings.rerank
        self._popular: np.ndarray = np.zeros(0, dtype=np.int64)
        self._popular_version = -1
        self._centroid = np.zeros(catalog.dim, dtype=np.float32)
        # per (slot, arm): (stamp, bank row per advertiser code, the row they all share or None)
        self._adapter_tables: dict[tuple[str, int], tuple[tuple[int, int], np.ndarray, int | None]] = {}
        # each row's content vector in the user-state space, for declared interests' centroids
        # (the catalog's vectors may be another space: the two-tower model's, or given by a caller)
        self._interest_table = CentroidTable(settings.state_dim)
        self.interest_counts: Counter[str] = Counter()  # declared interests: used / faded / unknown
        self._on_interests = on_interests
        # creative variants of the ads that have them (`AdCreative.variants`): a contextual bandit
        self.variants = VariantSelector.from_settings(settings)

    # -- catalog ------------------------------------------------------------------------
    def add_ad(self, ad: AdCreative, vector: np.ndarray | None = None) -> None:
        """A new or updated ad enters the catalog and the index (live)."""
        row = self.catalog.upsert(ad, vector)
        self.index.update(self.catalog.vectors, self.catalog.n)
        self.index.upsert(row, ad.active)
        dim = self.settings.state_dim
        self._interest_table.put(row, ad.category, np.asarray(content_vector(ad.category, ad.title, dim)))
        if ad.variants:
            self.variants.register(ad.ad_id, [v.variant_id for v in ad.variants])

    # -- declared interests (cold start) ------------------------------------------------
    def centroids(self) -> CategoryCentroids:
        """Each catalog category's mean content vector, in the user-state space (kept as ads arrive)."""
        return self._interest_table.centroids()

    def with_interests(
        self, user: UserView | None, interests: Sequence[str] | None, weight: float | None = None
    ) -> UserView | None:
        """The user's view with the prior of their declared interests added (`serving.interests`):
        the whole state of a brand-new user (None), fading to nothing as their evidence grows.
        `weight`: pseudo-clicks per category (default `settings.serving.interest_weight`)."""
        weight = self.settings.serving.interest_weight if weight is None else weight
        if not interests or weight <= 0:
            return user
        evidence = 0.0 if user is None else float(sum(user.intents.values()))
        prior = interest_prior(interests, self.centroids(), weight, evidence)
        for outcome in ("used", "faded", "unknown"):
            n = getattr(prior, outcome)
            if n:
                self.interest_counts[outcome] += n
                if self._on_interests is not None:
                    self._on_interests(outcome, n)
        if not prior.used:
            return user
        if user is None:
            return UserView(prior.vector, prior.intents)
        dim = self.settings.state_dim
        vec = np.zeros(dim, dtype=np.float32)
        own = np.asarray(user.vector, dtype=np.float32)[:dim]
        vec[: own.shape[0]] = own
        intents = dict(user.intents)
        for c, w in prior.intents.items():
            intents[c] = intents.get(c, 0.0) + w
        return UserView(vec + prior.vector, intents, user.bias)

    def popular(self, k: int) -> np.ndarray:
        """Cached popular rows (refreshed when the catalog changed)."""
        if self._popular_version != self.catalog.version or self._popular.shape[0] < k:
            self._popular = self.catalog.popular(max(k, 100))
            vecs = self.catalog.vectors[self._popular[:50]]
            c = vecs.mean(axis=0) if vecs.shape[0] else self._centroid
            self._centroid = c / (np.linalg.norm(c) or 1.0)
            self._popular_version = self.catalog.version
        return self._popular[:k]

    # -- recall -------------------------------------------------------------------------
    def query(
        self, user: UserView | None, context: Mapping[str, object] | None, slot: str = "feed", hour: int = 0
    ) -> np.ndarray:
        """The recall query: the user tower on the user's state (or, without a two-tower model, the
        state vector itself); cold users get context and popularity priors."""
        dim = self.settings.state_dim
        warm = user is not None and float(np.abs(user.vector).sum()) > 0
        if self.towers is not None:
            state = user.vector if user is not None and warm else np.zeros(dim, dtype=np.float32)
            q = self.towers.query(state, slot, hour)
            if not warm:  # cold: the tower's slot/hour prior, pulled towards what is popular
                self.popular(1)
                q = q + self._centroid
            return q
        if user is not None and float(np.abs(user.vector).sum()) > 0:
            q = np.zeros(dim, dtype=np.float32)
            v = np.asarray(user.vector, dtype=np.float32)[:dim]
            q[: v.shape[0]] = v
            return q
        self.popular(1)
        q = self._centroid.copy()
        if context:
            cat = str(context.get("category", ""))
            text = " ".join(str(v) for k, v in context.items() if isinstance(v, str) and k != "category")
            if cat or text:
                q = q + 2.0 * np.asarray(content_vector(cat or "any", text or cat, dim), dtype=np.float32)
        return q

    def recall(
        self,
        req: AdRequest,
        user: UserView | None,
        capped: list[str],
        hour: int,
        now: datetime | None = None,
    ) -> Recalled:
        """Top `recall.k` servable, not frequency-capped ads by inner product with the query."""
        cat = self.catalog
        allowed = cat.servable(audience_of(req, now))
        for ad_id in capped:
            row = cat.row_of.get(ad_id)
            if row is not None:
                allowed[row] = False
        user = self.with_interests(user, req.interests)
        query = self.query(user, req.context, req.slot, hour)
        k, match = self.settings.recall.k, self.match(req)
        if match is None:
            rows, scores = self.index.search(query, k, allowed)
        elif isinstance(self.index, ExactIndex):
            rows, scores = exact_search(cat.vectors[: cat.n], query, k, allowed, match)
        else:
            rows, scores = join_matches(
                self.index.search(query, k, allowed), match, cat.vectors, query, k, allowed
            )
        return self._recalled(req, user, rows, scores, hour)

    def match(self, req: AdRequest, rows: np.ndarray | None = None) -> np.ndarray | None:
        """How well the request's `query` names each catalog row (or each of `rows`), weighted
        (`serving.text`); None without a query."""
        cat, recall = self.catalog, self.settings.recall
        if not recall.text_dim:
            return None
        return query_match(cat.text, cat.n, req.query, recall.text_weight, rows)

    def recall_many(
        self,
        reqs: Sequence[AdRequest],
        users: Sequence[UserView | None],
        capped: Sequence[list[str]],
        hour: int,
        now: datetime | None = None,
    ) -> list[Recalled]:
        """`recall` of a batch of requests: the queries scored against the catalog in one matmul
        (the exact index; other indexes are probed per query), then each request's rank input."""
        cat = self.catalog
        if not isinstance(self.index, ExactIndex) or len(reqs) == 1:
            return [self.recall(r, u, c, hour, now) for r, u, c in zip(reqs, users, capped, strict=True)]
        now = now or datetime.now(UTC)  # one time for the batch: requests of one audience share a mask
        allowed = cat.servable_many([audience_of(r, now) for r in reqs])
        for i, ads in enumerate(capped):
            for ad_id in ads:
                row = cat.row_of.get(ad_id)
                if row is not None:
                    allowed[i, row] = False
        views = [self.with_interests(u, r.interests) for r, u in zip(reqs, users, strict=True)]
        queries = np.stack(
            [
                np.asarray(self.query(u, r.context, r.slot, hour), dtype=np.float32)
                for r, u in zip(reqs, views, strict=True)
            ]
        )
        index = self.index
        recall = self.settings.recall
        texts: list[str | None] = [r.query if recall.text_dim else None for r in reqs]
        matches = query_matches(cat.text, cat.n, texts, recall.text_weight)
        found = exact_search_many(index.vectors[: index.n], queries, self.settings.recall.k, allowed, matches)
        return [
            self._recalled(r, u, rows, scores, hour)
            for r, u, (rows, scores) in zip(reqs, views, found, strict=True)
        ]

    def candidates(
        self, req: RankRequest, capped: Sequence[str], now: datetime
    ) -> tuple[np.ndarray, list[str], list[str]]:
        """A `/v1/rank` request's candidates as catalog rows, in the caller's order: those this
        request may be shown (active, budget left, in their campaign's schedule and audience, not
        frequency-capped), and the ids the catalog does not hold and those it may not show."""
        cat = self.catalog
        allowed = cat.servable(audience_of(req, now))
        capped_ids = set(capped)
        rows: list[int] = []
        unknown: list[str] = []
        ineligible: list[str] = []
        for ad_id in req.candidates:
            row = cat.row_of.get(ad_id)
            if row is None:
                unknown.append(ad_id)
            elif not allowed[row] or ad_id in capped_ids:
                ineligible.append(ad_id)
            else:
                rows.append(row)
        return np.asarray(rows, dtype=np.int64), unknown, ineligible

    def recall_candidates(
        self, req: AdRequest, user: UserView | None, rows: np.ndarray, hour: int
    ) -> Recalled:
        """The caller's candidate rows in place of recall: their recall scores (the query's inner
        product, for the `recall_score` rung) and rank input, as `recall` gives its own."""
        user = self.with_interests(user, req.interests)
        query = np.asarray(self.query(user, req.context, req.slot, hour), dtype=np.float32)
        scores = self.catalog.vectors[rows] @ query
        match = self.match(req, rows)
        if match is not None:
            scores = scores + match
        return self._recalled(req, user, rows, scores, hour)

    def _recalled(
        self, req: AdRequest, user: UserView | None, rows: np.ndarray, scores: np.ndarray, hour: int
    ) -> Recalled:
        """Recall's rows and scores with the rank input of their candidates (item columns
        gathered from the catalog's arrays, the user's columns broadcast)."""
        if rows.shape[0] == 0:
            return Recalled(rows, scores, None)
        cat = self.catalog
        codes = cat.codes["category"]
        intents = _by_code(user.intents if user is not None else {}, codes)
        bias = _by_code(user.bias, codes) if user is not None and user.bias else None
        vec = user.vector if user is not None else np.zeros(self.settings.state_dim, dtype=np.float32)
        config = self.rank.config
        inp = build_input(
            vec,
            intents,
            cat.ids[rows],
            cat.category[rows],
            req.slot,
            hour,
            self.settings.state_dim,
            bias,
            config.slot_buckets,
            config.query_features,
            text_match(cat.text, req.query, rows) if config.query_features else None,
        )
        return Recalled(rows, scores, inp)

    def adapter_rows(self, slot: str, rows: np.ndarray, arm: int) -> np.ndarray:
        """Bank row of each candidate's adapter (slot and/or advertiser) in an arm, vectorized:
        a per-(slot, arm) table over advertiser codes, rebuilt when adapters or advertisers change."""
        out: np.ndarray = self._adapter_table(slot, arm)[1][self.catalog.advertiser[rows]]
        return out

    def shared_adapter_row(self, slot: str, arm: int) -> int | None:
        """The bank row every candidate of `slot` gets in `arm`, where all get one (the slot
        scheme, or no advertiser with an adapter of its own); None where it depends on the ad.
        `RankInput.row`: the rank model takes the slot's folded model without checking each row."""
        return self._adapter_table(slot, arm)[2]

    def _adapter_table(self, slot: str, arm: int) -> tuple[tuple[int, int], np.ndarray, int | None]:
        cat, bank = self.catalog, self.rank.bank
        advertisers = cat.codes["advertiser"]
        key = (slot, arm)
        stamp = (len(bank.meta), len(advertisers))
        cached = self._adapter_tables.get(key)
        if cached is None or cached[0] != stamp:
            scheme = self.settings.adapter_scheme
            table = np.empty(max(len(advertisers), 1), dtype=np.int64)
            for adv, code in advertisers.items():
                table[code] = bank.row(adapter_id_for(slot, adv, scheme), arm)
            known = table[: len(advertisers)]
            shared = int(known[0]) if known.size and bool((known == known[0]).all()) else None
            cached = self._adapter_tables[key] = (stamp, table, shared)
        return cached

    def adapter_versions(self, slot: str, rows: np.ndarray, arm: int = CANDIDATE) -> list[str | None]:
        """The version of each row's adapter in the arm that served it (for the few ads actually
        served): the live version on the candidate arm, the last promoted one on the stable arm
        (None where the stable arm has none yet)."""
        metas, scheme = self.rank.bank.meta, self.settings.adapter_scheme
        out: list[str | None] = []
        for r in rows:
            meta = metas.get(adapter_id_for(slot, self.catalog.rows[int(r)].advertiser_id, scheme))
            if meta is None:
                out.append(None)
            else:
                out.append(meta.version if arm == CANDIDATE else (meta.stable_version or None))
        return out

    # -- rerank -------------------------------------------------------------------------
    def variant_picks(
        self, rows: np.ndarray, vector: np.ndarray | None
    ) -> list[tuple[str | None, float | None]]:
        """(variant id, its selection probability) of each served row, for the user's state
        vector (`serving.variants`: one batch call; (None, None) for ads without variants)."""
        if not self.variants.row_of:
            return _no_variants(rows.shape[0])
        ad_ids = [self.catalog.rows[int(r)].ad_id for r in rows]
        vec = np.zeros(self.settings.state_dim) if vector is None else np.asarray(vector, dtype=np.float64)
        return self.variants.choose(ad_ids, vec)

    def choose(self, ctx: RequestContext, pctr: np.ndarray | None = None) -> Choice:
        """Rerank a request's candidates (caps, pacing, diversity) on their position-0 pCTR
        (`pctr`, default the request's own) and fill its positions (exploration, drawn from the
        request's own random stream): which candidates are served, in display order."""
        req, rows = ctx.req, ctx.rows
        now = ctx.now
        cat = self.catalog
        day_fraction = (now.hour * 3600 + now.minute * 60 + now.second) / 86400.0
        pacing = pacing_factor(
            cat.spend_of(rows), cat.budget_of(rows), day_fraction, self.params.pacing_slack
        )
        eps, top_m = self.settings.explore.epsilon, self.settings.explore.top_m
        cpm_rows = cat.cpm_of(rows)  # the auction prices CPM bids per thousand shown, CPC per click
        res = rerank(
            ctx.pctr if pctr is None else pctr,
            cat.bid[rows],
            cat.advertiser[rows],
            cat.category[rows],
            pacing,
            cat.impressions[rows],
            req.k + top_m - 1 if eps > 0 else req.k,  # the greedy list and what exploration draws from
            self.params,
            cpm_rows,
        )
        # seeded by the request id: the same request explores the same way (tests, replays)
        rng = request_rng(ctx.request_id) if eps > 0 else _GREEDY_RNG  # greedy draws nothing
        ex = explore(res.order.shape[0], req.k, eps, top_m, rng)
        return Choice(res, ex, res.order[ex.picks], cpm_rows)

    def finish(
        self, ctx: RequestContext, choice: Choice | None = None, at_position: np.ndarray | None = None
    ) -> Served:
        """Sign what `choice` (default: `choose(ctx)`) serves: the ads and their impression
        events. `at_position`: each chosen ad's pCTR at the position it is served at
        (`serving.request.RequestPath.at_positions`), what its impression logs (the per-user
        correction learns from it); None: its position-0 pCTR, as ranked (the rungs without the
        model). Reads `ctx`, changes nothing in it; the response is `respond(ctx, served)`. (The
        models are validated: pydantic's `model_construct` is Python and costs more than its
        validation in Rust.)
        """
        req, request_id, rows, pctr, rung = ctx.req, ctx.request_id, ctx.rows, ctx.pctr, ctx.rung
        now = ctx.now
        cat = self.catalog
        res, ex, order, cpm_rows = choice if choice is not None else self.choose(ctx)
        chosen = rows[order]
        chosen_pctr = np.clip(pctr[order] if at_position is None else at_position, 0.0, 1.0)
        model_version = self.rank.version
        with_adapters = rung == "adapter" and uses_adapters(ctx.ab_arm)
        versions = self.adapter_versions(req.slot, chosen, ctx.arm) if with_adapters else [None] * len(chosen)
        ads, imps = [], []
        infos = cat.rows
        user_id, slot, key = req.user_id, req.slot, self.event_key
        ts = now.timestamp()
        picks = self.variant_picks(chosen, ctx.user_vector)
        prices, scores = res.prices[ex.picks], res.scores[ex.picks]
        ab_arm, propensities, explored = ctx.ab_arm, ex.propensity.tolist(), ex.explored.tolist()
        render: Render = "server" if slot in self.shown_on_serve else "client"
        chosen_cpm = cpm_rows[order]
        cpm = chosen_cpm.tolist()
        # the ranker's query feature of each served ad, logged whatever rung served it (training
        # featurizes every impression): the value the ranker read, or would have read
        matched = text_match(cat.text, req.query, chosen)
        query = [None] * len(chosen) if matched is None else matched.tolist()
        for pos, (row, p, score, price) in enumerate(
            zip(
                chosen.tolist(),
                chosen_pctr.tolist(),
                scores.tolist(),
                prices.tolist(),
                strict=True,
            )
        ):
            info = infos[row]
            iid = impression_event_id(request_id, pos)
            token = click_token(key, iid, user_id, info.ad_id)
            ads.append(
                ServedAd(
                    ad_id=info.ad_id, campaign_id=info.campaign_id, score=score, pctr=p, price=price,
                    click_token=token, variant_id=picks[pos][0],
                )
            )  # fmt: skip
            fields = {
                "event_id": iid, "ts": now, "user_id": user_id, "request_id": request_id,
                "ad_id": info.ad_id, "campaign_id": info.campaign_id, "advertiser_id": info.advertiser_id,
                "slot": slot, "position": pos, "price": price, "pctr": p, "model_version": model_version,
                "adapter_version": versions[pos], "variant_id": picks[pos][0],
                "variant_propensity": picks[pos][1], "ab_arm": ab_arm, "propensity": propensities[pos],
                "explored": explored[pos], "bid_type": "cpm" if cpm[pos] else "cpc", "render": render,
                "query_match": query[pos],
            }  # fmt: skip
            # signed before it is built: one validation, no copy to add the signature
            imps.append(Impression(**fields, sig=impression_sig_of(fields, key, ts)))
        top_adapter = imps[0].adapter_version if imps and with_adapters else None
        expected = np.where(chosen_cpm, prices / PER_MILLE, chosen_pctr * prices)
        return Served(ads, imps, chosen, expected, top_adapter)

    def respond(self, ctx: RequestContext, served: Served) -> AdResponse:
        """The response of a served request, with the time each stage took (`ctx.stage_ms`:
        `recall` counts the user read too)."""
        ms = ctx.stage_ms
        stage = StageMs(
            recall=round(max(ms.get("redis", 0.0) + ms.get("recall", 0.0), 0.0), 3),
            rank=round(max(ms.get("rank", 0.0), 0.0), 3),
            rerank=round(max(ms.get("rerank", 0.0), 0.0), 3),
        )
        resp = AdResponse(
            request_id=ctx.request_id,
            ads=served.ads,
            degraded=ctx.rung != "adapter",
            served_by=ctx.rung,
            stage_ms=stage,
            model_version=self.rank.version,
            adapter_version=served.adapter_version,
        )
        if isinstance(ctx.req, RankRequest):
            return RankResponse(**dict(resp), unknown=ctx.unknown, ineligible=ctx.ineligible)
        return resp


class Choice(NamedTuple):
    """What `AdPipeline.choose` picked for one request: the rerank's result, exploration's
    picks, the served candidates (indices into the request's rows, in display order) and which
    of the request's candidates bid per thousand shown (CPM)."""

    rerank: RerankResult
    explored: Explored
    order: np.ndarray
    cpm: np.ndarray


@dataclass
class Served:
    """What `AdPipeline.finish` chose for one request: the ads, their signed impressions, the
    catalog rows served and the expected spend of each once shown (CPM: price / 1000, what it
    pays when shown; CPC: pCTR × price, its expected click cost; nothing is billed at serving,
    `schemas.billing`), and the version of the
    top ad's adapter (None without adapters)."""

    ads: list[ServedAd]
    impressions: list[Impression]
    rows: np.ndarray
    spend: np.ndarray
    adapter_version: str | None = None


# never drawn from: exploration off (epsilon 0) takes every greedy ad without a draw
_GREEDY_RNG = np.random.default_rng(0)


def request_rng(request_id: str) -> np.random.Generator:
    """The request's own random stream (exploration), seeded by its id: replayable.

    >>> request_rng("r1").random() == request_rng("r1").random()
    True
    """
    return np.random.default_rng(int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest()))


def _no_variants(n: int) -> list[tuple[str | None, float | None]]:
    return [(None, None)] * n


def utcnow() -> datetime:
    return datetime.now(UTC)
