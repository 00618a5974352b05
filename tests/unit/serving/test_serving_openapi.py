"""The checked-in OpenAPI document (`schemas/json/openapi.json`) is what the ad server serves:
a route, status or model that changes without regenerating it fails here."""

from __future__ import annotations

import json

from serving.openapi import OPENAPI_FILE, document, render


def test_openapi_file_matches_the_app() -> None:
    assert OPENAPI_FILE.read_text() == render(), "stale: run `python -m serving.openapi`"


def test_events_route_documents_every_status_and_its_security() -> None:
    doc = document()
    op = doc["paths"]["/v1/events"]["post"]
    assert set(op["responses"]) == {"200", "207", "400", "401", "413", "415", "422", "429", "503"}
    assert op["security"] == [{"ApiKey": []}, {}]
    assert doc["components"]["securitySchemes"]["ApiKey"]["name"] == "X-Api-Key"
    assert doc["paths"]["/v1/adapters"]["get"]["security"] == [{"AdminToken": []}]
    # self-contained: no reference into a model's own `$defs` (they would point at the root)
    assert "#/$defs/" not in json.dumps(doc)
    kinds = {b["properties"]["kind"]["const"] for b in _batch_items(op)}
    assert kinds == {"impression", "view", "click", "dwell", "conversion", "touch"}


def _batch_items(op: dict) -> list[dict]:  # type: ignore[type-arg]
    schema = op["requestBody"]["content"]["application/json"]["schema"]
    items = schema["properties"]["events"]["items"]
    return list(items["oneOf"])
