"""The framework floor of `POST /v1/ads`, for `benchmarks/serve.py`: the same Serve deployment
(options, FastAPI ingress, throughput-optimized direct ingress) and the same request edge as the
ad server (`serving.http.parse_ad_request`: media type, bounded body, duplicate keys, `AdRequest`
validation), answering one fixed, valid `AdResponse`, and nothing else: no state, no model.

What the ad server costs beyond it is adstream's own work (recall, rank, rerank, Redis, Kafka).

The model floor (`build_floor_app(settings, model=True)`) adds one thing to it: the rank forward
of `recall.k` candidates (the ad server's ranker, loaded and warmed the same way, one torch
thread, on the event loop) before the fixed answer. A one-replica server that ranks every request
with this model on its event loop, as the ad server does by default, cannot serve more than it
does; its capacity over the floor's is the highest capacity ratio the model allows on the machine
(`benchmarks/serve.py`: `capacity_bound_ratio`). (The ad server's deadline ladder could serve
more by skipping the model, from recall scores or popular ads: not the product being measured.)
"""

import json
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from ray import serve

from schemas.api import AdRequest, AdResponse, ServedAd, StageMs
from schemas.events import SLOTS
from schemas.settings import Settings
from serving.http import is_json, parse_ad_request, unsupported_media

floor_api = FastAPI(title="adstream serving floor", version="0.1.0")
FLOOR_VERSION = "floor"
MODEL_FLOOR_VERSION = "model-floor"
MODEL_FLOOR_CATEGORIES = 40  # category codes of the fixed candidates (the benchmark catalog's 40)


def fixed_response() -> AdResponse:
    """The one answer of the floor: ten ads, as the ad server's answers at k = 10."""
    ads = [
        ServedAd(ad_id=f"ad{i}", campaign_id=f"c{i}", score=1.0 - i / 10, pctr=0.02, price=0.5)
        for i in range(10)
    ]
    stage = StageMs(recall=0.0, rank=0.0, rerank=0.0)
    return AdResponse(
        request_id="0" * 32, ads=ads, degraded=False, stage_ms=stage, model_version=FLOOR_VERSION
    )


# defined before `FloorServer`: `@serve.ingress` freezes a copy of the class when it decorates it,
# and the copy's methods see only the module names defined by then
class ModelFloor:
    """The ad server's rank forward alone: its ranker (`serving.ranking.load_ranker`, the
    checkpoint under `model_dir`) in a `RankModel`, scoring `recall.k` fixed candidates (seeded
    ids across the embedding tables, a user vector, the request's slot) on the base rows, which
    cost what per-slot adapters cost (merged weights: `benchmarks/rank.py`)."""

    def __init__(self, settings: Settings, seed: int = 0) -> None:
        from serving.ranking import RankInput, RankModel, build_input, load_ranker
        from trainers.models.ranker import resolve_device

        torch.set_num_threads(1)  # as the ad server's replica
        device = resolve_device(settings.device)
        model, version = load_ranker(settings, device)
        self.rank = RankModel(model, version, settings, device)
        self.rank.warmup()
        cfg, k, dim = self.rank.config, settings.recall.k, settings.state_dim
        rng = np.random.default_rng(seed)
        buckets = (cfg.ad_buckets, cfg.advertiser_buckets, cfg.campaign_buckets, cfg.category_buckets)
        ids = np.stack([rng.integers(0, b, k) for b in buckets], axis=1).astype(np.int64)
        category = rng.integers(0, MODEL_FLOOR_CATEGORIES, k)
        vector = rng.standard_normal(dim).astype(np.float32)
        intents = rng.random(MODEL_FLOOR_CATEGORIES).astype(np.float32)
        self.inputs: dict[str, RankInput] = {
            slot: build_input(
                vector, intents, ids, category, slot, 12, dim, query_features=cfg.query_features
            )
            for slot in SLOTS  # at noon, no query
        }

    def score(self, slot: str) -> np.ndarray:
        """The pCTRs of the fixed candidates for `slot`."""
        return self.rank.score([self.inputs[slot]], True)[0]


@serve.ingress(floor_api)
class FloorServer:
    """Parses and validates each `AdRequest`, then answers the fixed `AdResponse` (with `model`:
    after ranking a fixed set of candidates for the request's slot)."""

    def __init__(self, settings_json: str, model: bool = False) -> None:
        settings = Settings(**json.loads(settings_json))
        self.limit = settings.serving.max_body_bytes
        self.body = fixed_response().model_dump_json().encode()
        self.ranker: ModelFloor | None = ModelFloor(settings) if model else None
        self.version = MODEL_FLOOR_VERSION if model else FLOOR_VERSION

    @floor_api.post("/v1/ads")
    async def ads(self, request: Request) -> Response:
        if not is_json(request.headers.get("content-type")):
            return unsupported_media()
        req = await parse_ad_request(request, self.limit)
        if not isinstance(req, AdRequest):
            return req
        if self.ranker is not None:
            self.ranker.score(req.slot)
        return Response(self.body, media_type="application/json")

    @floor_api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        return {"status": "ok", "model_version": self.version}


def build_floor_app(settings: Settings, model: bool = False) -> Any:
    """The floor as a bound Serve application, deployed with the ad server's options (`model`:
    the model floor, which also runs the rank forward)."""
    from serving.app import deployment_options, settings_payload

    deployment = serve.deployment(FloorServer, name="FloorServer", **deployment_options(settings))
    return deployment.bind(settings_payload(settings), model)  # type: ignore[attr-defined]
