"""`serving.app` builds nothing at import: `serve run serving.app:app_builder key=value` (a Ray
Serve application builder) reads the settings when Serve calls it, not when Python imports it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(120)


def test_importing_the_app_reads_no_settings() -> None:
    # a setting no Settings() accepts: an import that read the environment would raise
    env = {**os.environ, "ADSTREAM_SERVING__REPLICAS": "not-a-number", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", "import serving.app, deploy.serve_app"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_builder_reads_the_environment_and_its_args(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError
    from ray import serve

    from serving.app import app_builder

    # `serve run … serving.replicas=2` passes strings; they override the environment
    built = app_builder({"serving.replicas": "2", "serving.max_ongoing": "7"})
    assert isinstance(built, serve.Application)
    deployment = built._bound_deployment
    assert deployment.num_replicas == 2 and deployment.max_ongoing_requests == 7
    monkeypatch.setenv("ADSTREAM_SERVING__REPLICAS", "not-a-number")
    with pytest.raises(ValidationError, match="replicas"):
        app_builder({})
