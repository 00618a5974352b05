"""`adstream probe` as the compose healthcheck and the k8s liveness probe run it: a consumer whose
metrics still answer but whose consumed-records counter stopped while records wait fails; one
that progresses, or idles with nothing pending, passes; one whose metrics do not answer fails."""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from schemas.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(300)]  # ~20 s idle, 80 s loaded

ADSTREAM = str(Path(sys.executable).with_name("adstream"))


class Metrics:
    """A stand-in metrics page: the streams worker's consumed counter and lag gauge."""

    def __init__(self) -> None:
        self.consumed = 0.0
        self.lag = 0.0

    def text(self) -> bytes:
        return (
            f'adstream_streams_events_in_total{{topic="ad.impressions"}} {self.consumed}\n'
            f'adstream_streams_lag_events{{topic="ad.impressions"}} {self.lag}\n'
        ).encode()


@pytest.fixture
def page() -> Iterator[tuple[Metrics, int]]:
    metrics = Metrics()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = metrics.text()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield metrics, server.server_address[1]
    finally:
        server.shutdown()


def probe(port: int, state: Path, settings: Settings) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "ADSTREAM_KAFKA__BOOTSTRAP": settings.kafka.bootstrap,
           "ADSTREAM_TOPIC_PREFIX": settings.topic_prefix}  # fmt: skip
    argv = [ADSTREAM, "probe", "streams", "--port", str(port), "--stall-s", "2", "--state", str(state)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)


def test_probe_fails_a_stalled_consumer_and_passes_a_progressing_or_idle_one(
    page: tuple[Metrics, int], tmp_path: Path, stack: Settings
) -> None:
    metrics, port = page
    state = tmp_path / "probe.json"
    metrics.consumed, metrics.lag = 10, 50
    assert probe(port, state, stack).returncode == 0  # first look
    time.sleep(2.5)
    stalled = probe(port, state, stack)
    assert stalled.returncode == 1 and "no progress for" in stalled.stderr + stalled.stdout, stalled
    metrics.consumed = 11  # it moved again: alive, the clock restarts
    assert probe(port, state, stack).returncode == 0
    metrics.lag = 0  # nothing to consume: idle is not a hang
    time.sleep(2.5)
    idle = probe(port, state, stack)
    assert idle.returncode == 0 and "idle" in idle.stdout, idle


def test_probe_fails_when_the_metrics_do_not_answer(tmp_path: Path, stack: Settings) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    out = probe(free, tmp_path / "probe.json", stack)
    assert out.returncode == 1 and "does not answer" in out.stderr, out
