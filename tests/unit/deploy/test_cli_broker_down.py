"""A command that needs Kafka, started while nothing answers at `kafka.bootstrap`, ends with one
clear line naming the broker and exit code 2, not a traceback (issue 17, item 3: `BrokerError`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _adstream(args: list[str], env: dict[str, str], stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    cmd = [sys.executable, "-c", "from deploy.cli import main; main()", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, input=stdin, capture_output=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "stdin"),
    [
        (["worker"], b""),
        (["worker", "--engine", "aiokafka"], b""),
        (["produce", "ad.clicks", "-"], b"{}\n"),
        (["trainer"], b""),
    ],
    ids=["worker-faust", "worker-aiokafka", "produce", "trainer"],
)
def test_kafka_down_is_one_clear_line(args: list[str], stdin: bytes, tmp_path: Path) -> None:
    port = _closed_port()
    env = {
        **os.environ,
        "ADSTREAM_KAFKA__BOOTSTRAP": f"127.0.0.1:{port}",
        "ADSTREAM_STATE_DIR": str(tmp_path),
        "ADSTREAM_KAFKA__CONNECT_TIMEOUT_S": "5",
        "PYTHONPATH": str(REPO),
    }
    done = _adstream(args, env, stdin)
    out = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode == 2, out
    assert "Traceback" not in out, out
    assert f"error: Kafka at 127.0.0.1:{port}" in out, out
    assert "Unclosed" not in out, out  # no client left open on the way out


def test_engine_is_a_choice(tmp_path: Path) -> None:
    env = {**os.environ, "ADSTREAM_STATE_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    done = _adstream(["worker", "--engine", "kafka-streams"], env)
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 2, err
    assert "faust" in err and "aiokafka" in err, err  # the choices are listed, not hand-checked
