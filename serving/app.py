"""The Ray Serve application: one FastAPI ingress deployment that runs recall, rank and rerank
in-process (no handle hops: on 2 cores every hop costs milliseconds), with concurrent requests
batched by the replica's own micro-batcher (`serving.batching`) and ranked in one forward pass.

`build_app(settings, user_codec)` returns the bound application (`deploy.cli_serving` passes
streams' record format as the codec). Nothing is built at import: `serve run
serving.app:app_builder [key=value …]` builds it from the environment's settings and no user-state
codec (every user cold); `deploy.serve_app:build` is the same builder with streams' codec.
"""

import asyncio
import gc
import json
import logging
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import SecretStr
from ray import serve
from ray.serve.config import BackpressureConfig

from schemas.api import (
    SHADOW_HEADER,
    AdapterInfo,
    AdRequest,
    AdResponse,
    QosClass,
    RankRequest,
    RankResponse,
)
from schemas.errors import AdapterError
from schemas.settings import Settings, leaf_fields
from serving.adapters import CANDIDATE, STABLE
from serving.admin import api_key_digests, check_admin, check_api_key, token_digest
from serving.arms import ab_arm_for
from serving.batching import MicroBatcher
from serving.canary import Arm, Canary, arm_for
from serving.catalog import Catalog
from serving.collector_http import EVENTS_ROUTE, SNIPPET_ROUTE, EventCollector, snippet
from serving.cors import PublisherCors
from serving.deadline import Deadline
from serving.hotswap import DeltaApplier
from serving.http import BodyAdmission, error, is_json, overloaded, unsupported_media
from serving.io import ImpressionSink, RedisIO, UserCodec
from serving.loops import ReplicaLoops
from serving.metrics import ServingMetrics
from serving.pipeline import AdPipeline, RequestContext, content_vectorizer, utcnow
from serving.qos import Admission, class_of
from serving.qos import policies as qos_policies
from serving.ranking import RankInput, RankModel, load_ranker
from serving.request import RequestPath
from serving.towers import TowerSpace
from trainers.models.ranker import resolve_device

log = logging.getLogger(__name__)
api = FastAPI(
    title="adstream serving",
    description="Ranked ads per user and slot: recall → rank (+LoRA) → rerank, with deadlines.",
    version="0.1.0",
)
api.add_middleware(PublisherCors)  # CORS of /v1/ads and /v1/events for web pages: collector.cors_origins


_error = error


def _route(model: type[AdRequest]) -> dict[str, Any]:
    """The OpenAPI of a ranking route: its request body and every error status."""
    return {
        "openapi_extra": {
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": model.model_json_schema()}},
            }
        },
        "responses": {
            400: _detail("client disconnected before the body ended"),
            413: _detail("body over max_body_bytes (64 KiB)"),
            415: _detail("Content-Type is not application/json"),
            401: _detail("`serving.api_keys` are set and X-Api-Key is missing or unknown"),
            422: {"description": "invalid request: `detail` lists each field (`loc`) and why"},
            503: _detail("overloaded; retry after Retry-After seconds"),
        },
    }


def _detail(description: str) -> dict[str, Any]:
    """An OpenAPI response entry whose body is `{"detail": "<why>"}`."""
    schema = {"type": "object", "properties": {"detail": {"type": "string"}}, "required": ["detail"]}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


ADMIN_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: _detail("admin token missing or malformed"),
    403: _detail("wrong admin token, or admin routes disabled (no strong token configured)"),
    404: _detail("unknown adapter"),
}


class _MetricsRecorder:
    """The request path's reports as the replica's Prometheus metrics."""

    def __init__(self, metrics: ServingMetrics) -> None:
        self.spent = metrics.spent
        self._stage = metrics.stage
        self._served_by = metrics.served_by

    def stage_ms(self, stage: str, ms: float) -> None:
        self._stage.labels(stage).observe(ms / 1000)

    def served_by(self, rung: str) -> None:
        self._served_by.labels(rung).inc()


@serve.ingress(api)
class AdServer:
    """The ingress replica: HTTP API, pipeline, adapter bank, hot swap and canary (its start-up
    loading and background loops are `self.loops`, a `serving.loops.ReplicaLoops`)."""

    async def __init__(  # type: ignore[misc]  # Serve awaits async constructors
        self,
        settings_json: str,
        user_codec: UserCodec | None = None,
        admin_digest: str | None = None,
        api_keys: frozenset[str] = frozenset(),
    ) -> None:
        # secrets never travel in the actor's init args: the admin token and the API keys as
        # SHA-256 digests, the delta signing key from this process' environment or key file
        s = self.settings = Settings(**json.loads(settings_json))
        self.admin_digest = admin_digest
        self.api_keys = frozenset(api_keys)  # digests of serve_api_keys; empty: /v1/ads is open
        torch.set_num_threads(1)
        if s.serving.gil_switch_interval_ms > 0:  # see ServingSettings.gil_switch_interval_ms
            sys.setswitchinterval(s.serving.gil_switch_interval_ms / 1000)
        self.metrics = ServingMetrics()
        device = resolve_device(s.device)
        model, version = load_ranker(s, device)
        self.rank = RankModel(model, version, s, device)
        self.towers = TowerSpace.load(s.model_dir, s.serving.title_cache_size)
        if self.towers is not None:
            self.catalog = Catalog(
                self.towers.dim,
                model.config,
                self.towers.ad_vector,
                max_ads=s.serving.catalog_max_ads,
                text_dim=s.recall.text_dim,
            )
        else:
            self.catalog = Catalog(
                s.state_dim,
                model.config,
                content_vectorizer(s.state_dim),
                max_ads=s.serving.catalog_max_ads,
                text_dim=s.recall.text_dim,
            )
        self.pipe = AdPipeline(
            s,
            self.rank,
            self.catalog,
            self.towers,
            lambda outcome, n: self.metrics.interests.labels(outcome).inc(n),
        )
        self.applier = DeltaApplier.for_replica(self.rank.bank, version, s)
        self.canary = Canary(
            s.canary.share,
            s.canary,
            cooldown_s=s.canary.cooldown_s,
        )
        self.redis = RedisIO(s, user_codec)
        self.sink = ImpressionSink(
            s,
            lambda outcome, n: self.metrics.impressions.labels(outcome).inc(n),
            lambda seconds: self.metrics.spent("impressions", seconds),
        )
        self.path = RequestPath(
            self.pipe,
            self.redis,
            self._score,
            self.sink.emit,
            self.canary.served,
            _MetricsRecorder(self.metrics),
        )
        self.bodies = BodyAdmission(s.serving.admission_limit, s.slots.names)
        self.collector = EventCollector(s, self.api_keys, self.metrics.registry)  # POST /v1/events
        PublisherCors.configure(s.collector.cors_origins)
        self.gate = Admission(s.qos.slots, qos_policies(s))
        self.loops = ReplicaLoops(
            s,
            self.metrics,
            rank=self.rank,
            catalog=self.catalog,
            pipe=self.pipe,
            towers=self.towers,
            applier=self.applier,
            canary=self.canary,
            redis=self.redis,
        )
        self.ready = False
        self.loops.load_catalog_file()
        self.rank.warmup()
        self._rank_pool = (
            ThreadPoolExecutor(1, thread_name_prefix="adstream-rank") if s.serving.rank_thread else None
        )
        if self._rank_pool is not None:  # the thread's own torch state (inference mode, allocator)
            self._rank_pool.submit(self.rank.warmup, 512, 1).result()
        # two batches at once: one waits on Redis while the other ranks
        self.batcher = MicroBatcher(self._serve_batch, s.serving.batch_max, s.serving.batch_wait_ms / 1000, 2)
        await self.sink.start()
        await self.loops.start()  # snapshots and pins, before any delta lands or request is served
        gc.collect()
        gc.freeze()  # what start-up allocated (catalog, model, Ray) is never scanned again
        self.ready = True
        log.info("ad server ready: model %s on %s, %d ads", version, device, self.catalog.n)

    async def __del__(self) -> None:
        """Serve's graceful shutdown: stop the background loops, then write what is pending
        (frequency caps and spend to Redis, queued impressions to Kafka) before the replica goes."""
        await self.loops.stop(flush_timeout_s=2.0)
        await self.sink.stop(timeout_s=5.0)
        await self.collector.stop()
        await self.redis.close()
        pool = getattr(self, "_rank_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)

    # -- the request path (batched across concurrent requests) ---------------------------
    async def _serve_batch(self, batch: list[RequestContext]) -> list[AdResponse | Exception]:
        """Requests that arrived together (`self.batcher`) go down `serving.request.RequestPath`
        as one batch; if the batch fails, each request is tried alone, so a bad one fails only
        itself."""
        try:
            return list(await self.path.serve(batch))
        except Exception:
            if len(batch) == 1:
                raise
            out: list[AdResponse | Exception] = []
            for ctx in batch:
                ctx.stage_ms.clear()
                ctx.shadow_pctr, ctx.shadow_ads = None, None
                try:
                    out.extend(await self.path.serve([ctx]))
                except Exception as exc:
                    out.append(exc)
            return out

    async def _score(self, items: list[tuple[RankInput, bool]]) -> list[np.ndarray]:
        if self._rank_pool is None:
            return self._score_batch(items)
        # on the rank thread: the loop parses and reranks other batches meanwhile (torch releases
        # the GIL in its kernels); one thread, so forwards never run side by side
        return await asyncio.get_running_loop().run_in_executor(self._rank_pool, self._score_batch, items)

    def _score_batch(self, items: list[tuple[RankInput, bool]]) -> list[np.ndarray]:
        """Scores of a batch: one forward pass with adapters, one without (the bank's `reading`
        keeps the buffers a pass reads still while the loop swaps in deltas)."""
        out: list[np.ndarray | None] = [None] * len(items)
        for flag in (True, False):
            idx = [i for i, (_, use) in enumerate(items) if use is flag]
            if idx:
                for i, p in zip(idx, self.rank.score([items[i][0] for i in idx], flag), strict=True):
                    out[i] = p
        return [p if p is not None else np.zeros(0) for p in out]

    # -- HTTP ---------------------------------------------------------------------------
    @api.post("/v1/ads", response_model=AdResponse, **_route(AdRequest))
    async def ads(self, request: Request) -> Response:
        """Ranked ads for one user and slot (see `AdRequest` / `AdResponse`)."""
        return await self._answer(request, AdRequest)

    @api.post("/v1/rank", response_model=RankResponse, **_route(RankRequest))
    async def rank_candidates(self, request: Request) -> Response:
        """The caller's own candidates ranked for one user and slot (see `RankRequest` /
        `RankResponse`): the same ranker, adapters, deadlines, QoS, pacing and caps as `/v1/ads`."""
        return await self._answer(request, RankRequest)

    async def _answer(self, request: Request, model: type[AdRequest]) -> Response:
        """A ranking request's way through the edge: key, media type, admission, body, QoS gate,
        the request path, the response."""
        t0 = time.perf_counter()
        denied = check_api_key(request.headers.get("x-api-key"), self.api_keys)
        if denied is not None:
            return self._status(401, _error(401, denied))
        if not is_json(request.headers.get("content-type")):
            return self._status(415, unsupported_media())
        if self.bodies.full() or not self.ready:
            self.metrics.shed.inc()
            return self._status(503, _error(503, "overloaded, retry later", {"Retry-After": "1"}))
        # from the first byte to its class: a slow body holds its admission slot
        req = await self.bodies.parse(request, self.settings.serving.max_body_bytes, model)
        if not isinstance(req, AdRequest):
            return self._status(req.status_code, req)
        t_gate = time.perf_counter()
        self.metrics.spent("parse", t_gate - t0)
        cls = class_of(req.qos, req.slot, self.settings.qos.slot_class, self.settings.qos.default_class)
        outcome = await self.gate.enter(cls)
        if outcome != "run":
            return self._shed(cls, outcome)
        wait_s = time.perf_counter() - t_gate
        self.metrics.spent("gate", wait_s)
        arm = arm_for(req.user_id, self.canary.share(time.time()))
        try:
            resp, shadow = await self._serve(req, arm, cls, t0)
        except Exception:
            log.exception("request failed")
            self.canary.request(arm, (time.perf_counter() - t0) * 1000, True, time.time())
            return self._status(500, _error(500, "internal error"))
        finally:
            self.gate.release()
        t = time.perf_counter()
        out = Response(resp.model_dump_json(), media_type="application/json")
        if shadow is not None:  # measurement only (`ab.shadow_slates`)
            out.headers[SHADOW_HEADER] = json.dumps(shadow)
        done = time.perf_counter()
        self.metrics.spent("respond", done - t)
        ms = (done - t0) * 1000
        if not req.preview:
            self.canary.request(arm, ms, False, time.time())
        self.metrics.latency.observe(ms / 1000)
        self.metrics.qos_served(cls, ms / 1000, wait_s)
        return self._status(200, out)

    def _shed(self, cls: QosClass, outcome: str) -> Response:
        """503 + Retry-After for a request the QoS gate refused (queue full, waited too long, or
        gave way to a higher class)."""
        self.metrics.shed.inc()
        self.metrics.qos_requests.labels(cls, outcome).inc()
        return self._status(503, overloaded(cls, outcome, self.gate.retry_after(cls)))

    def _status(self, code: int, resp: Response) -> Response:
        self.metrics.requests.labels(str(code)).inc()
        return resp

    async def _serve(
        self, req: AdRequest, arm_name: Arm, cls: QosClass, t0: float
    ) -> tuple[AdResponse, list[str] | None]:
        """One request on the canary arm `ads` chose for it (once: latency, errors and
        impressions are all counted for that arm, even if the share moves meanwhile), down the
        ladder adapter → base model → recall score → popular as its deadline allows; with the
        ads of its shadow slate where `ab.shadow_slates` asked for one (else None)."""
        ctx = RequestContext(
            req,
            uuid.uuid4().hex,
            utcnow(),
            CANDIDATE if arm_name == "candidate" else STABLE,
            ab_arm_for(req.user_id, self.settings.ab),
            # the budget runs from the request's first byte (parsing and the gate's queue count)
            deadline=Deadline(float(req.deadline_ms or self.gate.policies[cls].deadline_ms), start=t0),
            canary_arm=arm_name,
        )
        out = await self.batcher.submit(ctx)
        if isinstance(out, Exception):
            raise out
        return out, ctx.shadow_ads

    # -- events over HTTP and the web snippet (serving.collector_http; the same routes run apart
    # as serving.collector_app) --------------------------------------------------------------
    @api.post("/v1/events", **EVENTS_ROUTE)
    async def events(self, request: Request) -> Response:
        """A batch of events of any accepted kind, validated by the contract and produced to
        Kafka (acks=all) before the answer (`schemas.collect.EventBatch` / `EventsResult`)."""
        return await self.collector.handle(request)

    @api.get("/adstream.js", **SNIPPET_ROUTE)
    async def adstream_js(self) -> Response:
        """The dependency-free web snippet: fetch ads, view and click beacons."""
        return snippet()

    @api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        """Liveness and the model version every response names anyway (counts and devices are
        on the admin-only `/v1/adapters` and on `/metrics`)."""
        return {"status": "ok" if self.ready else "starting", "model_version": self.rank.version}

    def check_health(self) -> None:
        if not self.ready:
            raise RuntimeError("not warmed up yet")

    @api.get(
        "/metrics",
        response_class=Response,
        responses={200: {"description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST: {}}}},
    )
    async def metrics_route(self) -> Response:
        """Prometheus metrics of this replica."""
        self.metrics.staleness.set(self.applier.max_staleness_s())
        self.metrics.adapters.set(len(self.rank.bank.meta))
        self.metrics.swaps.set(self.rank.bank.swaps)
        self.metrics.catalog.set(self.catalog.n)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @api.get("/v1/adapters", response_model=list[AdapterInfo], responses=ADMIN_RESPONSES)
    async def adapters(self, request: Request) -> Response:
        """Versions, staleness and rejected deltas of every adapter this replica holds (admin
        token: adapter ids name advertisers)."""
        if (denied := self._admin(request)) is not None:
            return denied
        body = "[" + ",".join(i.model_dump_json() for i in self.applier.infos()) + "]"
        return Response(body, media_type="application/json")

    def _admin(self, request: Request) -> JSONResponse | None:
        """None when the request carries the admin token, else the 401/403 answer."""
        denied = check_admin(
            request.headers.get("authorization"), request.headers.get("x-admin-token"), self.admin_digest
        )
        if denied is None:
            return None
        status, why = denied
        return _error(status, why, {"WWW-Authenticate": "Bearer"} if status == 401 else None)

    # `:path`: slot+advertiser adapter ids (`feed/adv:x`) hold a slash
    @api.post(
        "/v1/adapters/{adapter_id:path}/rollback",
        response_model=AdapterInfo,
        responses={
            **ADMIN_RESPONSES,
            409: _detail("no previous version, or it changed meanwhile"),
            503: _detail("pins unavailable (Redis)"),
        },
    )
    async def rollback(self, adapter_id: str, request: Request) -> Response:
        """Serve an adapter's previous version again and pin it there on every replica until
        `/unpin` (admin token: `Authorization: Bearer …`)."""
        if (denied := self._admin(request)) is not None:
            return denied
        if adapter_id not in self.rank.bank.meta:
            return _error(404, f"unknown adapter {adapter_id!r}")
        if adapter_id not in self.applier.pinned:
            try:  # held from here: no delta lands while the pin is stored, so `seq` stays the target
                seq = self.applier.hold(adapter_id)
            except AdapterError as exc:
                return _error(409, str(exc))
            try:  # the pin is shared first: a rollback other replicas don't follow is half a rollback
                await self.redis.set_pin(adapter_id, seq, self.applier.previous_snapshot(adapter_id))
            except Exception as exc:
                self.applier.release(adapter_id)
                log.warning("could not store the pin of %r: %s", adapter_id, exc)
                return _error(
                    503, "adapter pins are unavailable (Redis); nothing changed", {"Retry-After": "1"}
                )
            if adapter_id not in self.applier.pinned:  # housekeeping may have followed the pin meanwhile
                try:
                    self.applier.rollback(adapter_id, expect_seq=seq)
                except AdapterError as exc:
                    return _error(409, str(exc))
            else:
                self.applier.release(adapter_id)
        return Response(self.applier.info(adapter_id).model_dump_json(), media_type="application/json")

    @api.post(
        "/v1/adapters/{adapter_id:path}/unpin",
        response_model=AdapterInfo,
        responses={**ADMIN_RESPONSES, 503: _detail("pins unavailable (Redis)")},
    )
    async def unpin(self, adapter_id: str, request: Request) -> Response:
        """Lift an admin rollback: the adapter re-syncs from its latest snapshot and follows deltas again."""
        if (denied := self._admin(request)) is not None:
            return denied
        if adapter_id not in self.rank.bank.meta:
            return _error(404, f"unknown adapter {adapter_id!r}")
        try:
            await self.redis.clear_pin(adapter_id)
        except Exception as exc:
            log.warning("could not clear the pin of %r: %s", adapter_id, exc)
            return _error(503, "adapter pins are unavailable (Redis); nothing changed", {"Retry-After": "1"})
        await self.loops.unpinned(adapter_id)  # answered with the re-synced version
        return Response(self.applier.info(adapter_id).model_dump_json(), media_type="application/json")


def deployment_options(settings: Settings) -> dict[str, Any]:
    """The Serve deployment options of the ingress (the ad server and the framework floor)."""
    return {
        "num_replicas": settings.serving.replicas,
        "max_ongoing_requests": settings.serving.max_ongoing,
        "max_queued_requests": settings.serving.max_queued,
        # Serve's own queue limit answers like our admission check: 503 + Retry-After
        "backpressure_config": BackpressureConfig(status_code=503, retry_after_s=1),
        "ray_actor_options": {"num_cpus": 0},
        "health_check_period_s": 5,
    }


def build_app(settings: Settings, user_codec: UserCodec | None = None) -> Any:
    """The bound Serve application (one ingress deployment)."""
    deployment = serve.deployment(AdServer, name="AdServer", **deployment_options(settings))
    return deployment.bind(  # type: ignore[attr-defined]
        settings_payload(settings),
        user_codec,
        token_digest(settings.serving.admin_token),
        api_key_digests(settings.serving.api_keys),
    )


def settings_payload(settings: Settings) -> str:
    """Settings as JSON for the replicas, without secrets (Ray stores and shows actor arguments):
    replicas get the admin token's digest separately and read the delta signing key themselves."""
    data = json.loads(settings.model_dump_json())
    for name, field in leaf_fields().items():
        if field.annotation is SecretStr:
            *groups, leaf = name.split(".")
            owner = data
            for g in groups:
                owner = owner.get(g, {})
            owner.pop(leaf, None)
    return json.dumps(data)


def app_builder(args: dict[str, Any]) -> Any:
    """Ray Serve application builder: `serve run serving.app:app_builder [serving.replicas=2 …]`.

    Settings come from the environment (`ADSTREAM_*`), overridden by `args` (dotted names, as
    `deploy.serve_app:build` takes them); no user-state codec (serving may not import streams),
    so every user is served cold. Importing this module reads no settings and builds nothing.
    """
    from schemas.settings import nested

    return build_app(Settings(**nested(args)))
