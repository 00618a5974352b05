"""The ad server as an import path, for config-driven Serve deploys: KubeRay's RayService
(`deploy/k8s/rayservice.yaml`, `import_path: deploy.serve_app:build`) and `serve run`/`serve deploy`.

Unlike `serving.app:app_builder` (serving may not import streams, so it serves every user cold), this
builder passes streams' Redis user-record codec, exactly as `adstream serve` does. Settings come
from the environment (ConfigMap/Secret), overridden by the application's `args`.
"""

from __future__ import annotations

from typing import Any


def build(args: dict[str, Any]) -> Any:
    """Ray Serve application builder: `args` are settings overrides (`{"serving.replicas": 2}`)."""
    from schemas.settings import Settings, nested
    from serving.app import build_app
    from serving.io import UserRecordCodec

    settings = Settings(**nested(args))
    return build_app(settings, UserRecordCodec(settings.state))
