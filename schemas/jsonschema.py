"""Generates the checked-in JSON Schema files of the contract: `python -m schemas.jsonschema`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import BaseModel

from schemas.api import AdapterInfo, AdRequest, AdResponse, RankRequest, RankResponse
from schemas.collect import EventBatch, EventsResult
from schemas.events import EVENT_MODELS
from schemas.settings import env_example

SCHEMA_DIR = Path(__file__).parent / "json"
MODELS: dict[str, type[BaseModel]] = {
    **EVENT_MODELS,
    "AdRequest": AdRequest,
    "AdResponse": AdResponse,
    "AdapterInfo": AdapterInfo,
    "RankRequest": RankRequest,
    "RankResponse": RankResponse,
    "EventBatch": EventBatch,
    "EventsResult": EventsResult,
}


def render(model: type[BaseModel]) -> str:
    """The JSON Schema of a model as it travels (serialization mode), stable text."""
    schema = model.model_json_schema(mode="serialization")
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def expected_files() -> dict[str, str]:
    """File name → content for every contract model."""
    return {f"{name}.schema.json": render(model) for name, model in MODELS.items()}


def main(argv: list[str]) -> int:
    """Write the schema files, or with --check report stale ones and exit 1."""
    check = "--check" in argv
    stale = []
    SCHEMA_DIR.mkdir(exist_ok=True)
    for name, text in expected_files().items():
        path = SCHEMA_DIR / name
        if path.exists() and path.read_text() == text:
            continue
        stale.append(name)
        if not check:
            path.write_text(text)
    env_path = Path(__file__).parent.parent / ".env.example"
    if not env_path.exists() or env_path.read_text() != env_example():
        stale.append(".env.example")
        if not check:
            env_path.write_text(env_example())
    if check and stale:
        print(f"stale JSON Schema files: {', '.join(stale)}; run `python -m schemas.jsonschema`")
        return 1
    print(f"{len(stale)} schema file(s) {'stale' if check else 'written'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
