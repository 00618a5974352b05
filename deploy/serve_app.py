"""The ad server as an import path, for config-driven Serve deploys: KubeRay's RayService
(`deploy/k8s/rayservice.yaml`, `import_path: deploy.serve_app:build`) and `serve run`/`serve deploy`.

Unlike `serving.app:app_builder` (serving may not import streams, so it serves every user cold), this
builder passes streams' Redis user-record codec, exactly as `adstream serve` does. Settings come
from the environment (ConfigMap/Secret), overridden by the application's `args`.
"""

from __future__ import annotations

from typing import Any


def build(args: dict[str, Any]) -> Any:
    """Ray Serve application builder: `args` are settings overrides (`{"serving.replicas": 2}`),
    plus `wait_for_model_s` (default 900): how long to wait for the base model that the init Job
    writes. Meanwhile the application stays DEPLOYING (KubeRay keeps the Service not ready), and
    after it the deploy fails naming what is missing, instead of serving an untrained ranker."""
    import logging

    from deploy.bootstrap import wait_for_model
    from schemas.settings import Settings, nested
    from serving.app import build_app
    from serving.io import UserRecordCodec

    overrides = dict(args)
    wait_s = float(overrides.pop("wait_for_model_s", 900))
    settings = Settings(**nested(overrides))
    if wait_s > 0:
        wait_for_model(settings, wait_s, logging.getLogger("adstream.serve_app").warning)
    return build_app(settings, UserRecordCodec(settings.state))
