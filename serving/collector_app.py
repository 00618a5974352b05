"""The event collector as its own small Serve deployment, for those who run it apart from
ranking (`adstream collector`): `POST /v1/events`, `GET /adstream.js`, `/healthz`, `/metrics`.
The ad server answers the same routes itself (`serving.app`); both go through
`serving.collector_http.EventCollector`."""

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from ray import serve

from schemas.settings import Settings
from serving.admin import api_key_digests
from serving.collector_http import EVENTS_ROUTE, SNIPPET_ROUTE, EventCollector, snippet
from serving.cors import PublisherCors

collector_api = FastAPI(
    title="adstream event collector",
    description="Events over HTTP (impressions as served, clicks, dwells, conversions, touches), "
    "validated by the contract and produced to Kafka with acks=all.",
    version="0.1.0",
)
collector_api.add_middleware(PublisherCors)


@serve.ingress(collector_api)
class CollectorServer:
    """One collector replica: its own producer, rate-limit buckets and metrics."""

    def __init__(self, settings_json: str, api_keys: frozenset[str] = frozenset()) -> None:
        self.registry = CollectorRegistry()
        settings = Settings(**json.loads(settings_json))
        self.collector = EventCollector(settings, api_keys, self.registry)
        PublisherCors.configure(settings.collector.cors_origins)

    async def __del__(self) -> None:
        await self.collector.stop()

    @collector_api.post("/v1/events", **EVENTS_ROUTE)
    async def events(self, request: Request) -> Response:
        """A batch of events of any accepted kind (`schemas.collect.EventBatch`)."""
        return await self.collector.handle(request)

    @collector_api.get("/adstream.js", **SNIPPET_ROUTE)
    async def adstream_js(self) -> Response:
        """The web snippet (fetch ads, view and click beacons)."""
        return snippet()

    @collector_api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        return {"status": "ok", "role": "collector"}

    @collector_api.get("/metrics", response_class=Response)
    async def metrics_route(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


def build_collector_app(settings: Settings) -> Any:
    """The bound collector application (`collector` replicas of `CollectorServer`)."""
    from serving.app import deployment_options, settings_payload

    options = deployment_options(settings)
    deployment = serve.deployment(CollectorServer, name="EventCollector", **options)
    return deployment.bind(settings_payload(settings), api_key_digests(settings.serving.api_keys))  # type: ignore[attr-defined]
