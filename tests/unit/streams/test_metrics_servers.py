"""The worker's and the trainer's metrics servers listen on loopback unless told otherwise (L2)."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest

from schemas.settings import Settings


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _outside_address() -> str | None:
    """An address of this machine that is not loopback (where a stranger would connect)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent for UDP connect
            addr = str(sock.getsockname()[0])
        except OSError:
            return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _streams_serve(port: int) -> None:
    from streams import metrics

    metrics.serve(port)


def _trainers_serve(port: int) -> None:
    from trainers import telemetry

    telemetry.serve(port)


@pytest.mark.parametrize("serve", [_streams_serve, _trainers_serve], ids=["worker", "trainer"])
def test_metrics_listen_on_loopback_by_default(serve: Callable[[int], None]) -> None:
    outside = _outside_address()
    if outside is None:
        pytest.skip("this machine has no non-loopback IPv4 address to test from")
    port = _free_port()
    serve(port)
    assert _reachable("127.0.0.1", port)
    assert not _reachable(outside, port), f"metrics reachable on {outside}:{port}"


def test_metrics_host_is_a_setting_defaulting_to_loopback() -> None:
    assert Settings().metrics.host == "127.0.0.1"
    assert Settings(metrics={"host": "0.0.0.0"}).metrics.host == "0.0.0.0"
