"""`adstream dashboard` as a user runs it: a process serving the page for the settings' database."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_dashboard_sql import _database, insert_rows, seeded_rows, server_backend

from schemas.settings import Settings

pytestmark = [pytest.mark.clickhouse, pytest.mark.timeout(90)]

ADSTREAM = Path(sys.executable).with_name("adstream")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_command_serves_the_page_and_panels(stack: Settings) -> None:
    settings = _database(stack, "cli")
    gen = server_backend(settings)
    insert_rows(next(gen), seeded_rows(600))
    port = _free_port()
    env = {**os.environ, "ADSTREAM_CLICKHOUSE__URL": settings.clickhouse.url}
    proc = subprocess.Popen(
        [str(ADSTREAM), "dashboard", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 45
        while True:
            try:
                health = httpx.get(f"{base}/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else "exited"
                assert time.monotonic() < deadline, "adstream dashboard did not answer"
                time.sleep(0.2)
        assert health.json() == {"ok": True, "clickhouse": health.json()["clickhouse"]}
        assert "<title>adstream" in httpx.get(f"{base}/").text
        body = httpx.get(f"{base}/api/panels", timeout=30).json()
        assert body["no_data"] is False and body["database"] == settings.clickhouse.url.rsplit("/", 1)[1]
        assert httpx.post(f"{base}/api/panels").status_code == 405  # read-only
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        gen.close()


def test_a_bad_port_is_a_usage_error() -> None:
    from typer.testing import CliRunner

    from deploy.cli import app

    result = CliRunner().invoke(app, ["dashboard", "--port", "0"])
    assert result.exit_code == 2 and "--port" in result.output


def test_a_port_in_use_is_a_clear_error() -> None:
    from typer.testing import CliRunner

    from deploy.cli import app
    from schemas.errors import ConfigError

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        result = CliRunner().invoke(app, ["dashboard", "--port", str(port)])
    # `adstream` (deploy.cli.main) prints a ConfigError as "error: …" and exits 2
    assert isinstance(result.exception, ConfigError)
    assert f"--port {port}: cannot listen there" in str(result.exception)
