"""Parsing service addresses out of the settings' URLs, and a plain TCP reachability check."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from urllib.parse import urlparse

from schemas.errors import ConfigError

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass(frozen=True)
class Endpoint:
    """A host and port; `local` when `adstream up` may start a service there."""

    host: str
    port: int

    @property
    def local(self) -> bool:
        return self.host in LOOPBACK

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def kafka_endpoint(bootstrap: str) -> Endpoint:
    """The first broker of a bootstrap list `host:port[,host:port…]`."""
    first = bootstrap.split(",")[0].strip()
    host, sep, port = first.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"kafka.bootstrap: expected host:port, got {bootstrap!r}")
    return Endpoint(host, int(port))


def url_endpoint(url: str, field: str, default_port: int) -> Endpoint:
    """Host and port of a service URL (redis://, clickhouse://)."""
    parsed = urlparse(url)
    if not parsed.hostname:
        raise ConfigError(f"{field}: no host in {url!r}")
    try:
        port = parsed.port or default_port
    except ValueError as exc:
        raise ConfigError(f"{field}: bad port in {url!r}") from exc
    return Endpoint(parsed.hostname, port)


def port_open(ep: Endpoint, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections at `ep`."""
    try:
        with socket.create_connection((ep.host, ep.port), timeout=timeout):
            return True
    except OSError:
        return False
