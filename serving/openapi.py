"""The ad server's OpenAPI document with its security schemes, checked in as
`schemas/json/openapi.json`: `python -m serving.openapi` writes it, `--check` fails (exit 1)
when the routes drifted from the file (the unit test runs the check)."""

import copy
import json
import sys
from pathlib import Path
from typing import Any, Final

OPENAPI_FILE: Final = Path(__file__).resolve().parents[1] / "schemas" / "json" / "openapi.json"
SCHEMES: Final[dict[str, Any]] = {
    "ApiKey": {
        "type": "apiKey",
        "in": "header",
        "name": "X-Api-Key",
        "description": "A publisher key of `serving.api_keys` (none configured: the routes are open)",
    },
    "AdminToken": {
        "type": "http",
        "scheme": "bearer",
        "description": "`serving.admin_token` (or X-Admin-Token); weak or empty: admin routes off",
    },
}
PUBLISHER: Final[list[dict[str, list[str]]]] = [{"ApiKey": []}, {}]  # {}: open when no keys are configured
ADMIN: Final[list[dict[str, list[str]]]] = [{"AdminToken": []}]


def document() -> dict[str, Any]:
    """The OpenAPI of `serving.app.api` with `components.securitySchemes` and each route's security."""
    from serving.app import api

    doc = copy.deepcopy(api.openapi())
    doc.setdefault("components", {})["securitySchemes"] = SCHEMES
    for path, ops in doc["paths"].items():
        for op in ops.values():
            if path.startswith("/v1/adapters"):
                op["security"] = ADMIN
            elif path in ("/v1/ads", "/v1/events"):
                op["security"] = PUBLISHER
    return doc


def render() -> str:
    return json.dumps(document(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OPENAPI_FILE.exists() or OPENAPI_FILE.read_text() != text:
            print(f"{OPENAPI_FILE} is stale: run `python -m serving.openapi`")
            return 1
        return 0
    OPENAPI_FILE.write_text(text)
    print(f"wrote {OPENAPI_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
