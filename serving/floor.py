"""The framework floor of `POST /v1/ads`, for `benchmarks/serve.py`: the same Serve deployment
(options, FastAPI ingress, throughput-optimized direct ingress) and the same request edge as the
ad server (`serving.http.parse_ad_request`: media type, bounded body, duplicate keys, `AdRequest`
validation), answering one fixed, valid `AdResponse`, and nothing else: no state, no model.

What the ad server costs beyond it is adstream's own work (recall, rank, rerank, Redis, Kafka).
"""

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from ray import serve

from schemas.api import AdRequest, AdResponse, ServedAd, StageMs
from schemas.settings import Settings
from serving.http import is_json, parse_ad_request, unsupported_media

floor_api = FastAPI(title="adstream serving floor", version="0.1.0")
FLOOR_VERSION = "floor"


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


@serve.ingress(floor_api)
class FloorServer:
    """Parses and validates each `AdRequest`, then answers the fixed `AdResponse`."""

    def __init__(self, settings_json: str) -> None:
        self.limit = Settings(**json.loads(settings_json)).serving.max_body_bytes
        self.body = fixed_response().model_dump_json().encode()

    @floor_api.post("/v1/ads")
    async def ads(self, request: Request) -> Response:
        if not is_json(request.headers.get("content-type")):
            return unsupported_media()
        req = await parse_ad_request(request, self.limit)
        if not isinstance(req, AdRequest):
            return req
        return Response(self.body, media_type="application/json")

    @floor_api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        return {"status": "ok", "model_version": FLOOR_VERSION}


def build_floor_app(settings: Settings) -> Any:
    """The floor as a bound Serve application, deployed with the ad server's options."""
    from serving.app import deployment_options, settings_payload

    deployment = serve.deployment(FloorServer, name="FloorServer", **deployment_options(settings))
    return deployment.bind(settings_payload(settings))  # type: ignore[attr-defined]
