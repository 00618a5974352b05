"""docker-compose.yml, run for real without Docker: every adstream service's own `command` and
`environment` (interpolated from a fresh .env of required secrets) as a local process, in the
file's dependency order, each dependency gated on its own condition (its health check run as
written, or its exit code); then the closed loop against it.

Stand-ins (tests/integration/deploy/harness.py says what is mapped): the local stack for the
kafka / redis / clickhouse images; Prometheus and Grafana are other images and are not run here
(the scrape config's targets are fetched instead: each must answer with the process's metrics);
`ray-worker` is a second Ray node, which on one machine is the multi-node test's subject, so
the replicas run on the head node here.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.manifests import ComposeService, load_compose, start_order
from schemas.settings import Settings
from tests.integration.deploy.harness import LocalMap, LocalRun, get, wait_for
from tests.integration.deploy.loop import Isolation, closed_loop, run_cli, secrets_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.kafka,
    pytest.mark.redis,
    pytest.mark.clickhouse,
    pytest.mark.ray,
    pytest.mark.timeout(1500),
]

ROOT = Path(__file__).resolve().parents[3]
PORTS = {6380: 18201, 8265: 18202, 8080: 18205, 8000: 18210, 8001: 18211, 8002: 18212, 8003: 18213,
         8004: 18214, 9464: 18220, 9465: 18221, 8050: 18230}  # fmt: skip
RAY_PORTS = {"dashboard-port": 18202, "ray-client-server-port": 18203, "dashboard-agent-listen-port": 18204,
             "node-manager-port": 18206, "object-manager-port": 18207, "runtime-env-agent-port": 18208,
             "dashboard-agent-grpc-port": 18209}  # fmt: skip
STANDINS = {"kafka", "redis", "clickhouse"}  # the local stack
NOT_RUN = {"prometheus": "prom/prometheus image", "grafana": "grafana image", "ray-worker": "second Ray node"}


def _local_map(stack: Settings, iso: Isolation, ray_tmp: Path) -> LocalMap:
    from urllib.parse import urlparse

    redis = urlparse(stack.redis.url)
    return LocalMap(
        kafka=stack.kafka.bootstrap,
        redis_url=f"redis://{redis.hostname}:{redis.port or 6379}/{(redis.path or '/0').lstrip('/') or 0}",
        clickhouse_url=iso.clickhouse_url,
        ports=PORTS,
        ray_ports=RAY_PORTS,
        ray_worker_ports=(18260, 18279),
        tmp=iso.tmp,
        ray_tmp=ray_tmp,
    )


class ComposeRun:
    """Starts the services wave by wave; a dependency's condition is met before its dependant starts."""

    def __init__(
        self, services: dict[str, ComposeService], lmap: LocalMap, run: LocalRun, iso: Isolation
    ) -> None:
        self.services, self.lmap, self.run, self.iso = services, lmap, run, iso
        self.met: set[tuple[str, str]] = set()
        self.health_s: dict[str, float] = {}

    def env(self, name: str) -> dict[str, str]:
        return self.lmap.env(self.services[name].environment, self.iso.overrides())

    def ensure(self, dep: str, condition: str) -> None:
        if (dep, condition) in self.met or dep in STANDINS or dep in NOT_RUN:
            return
        svc = self.services[dep]
        if condition == "service_completed_successfully":
            code = self.run.wait_done(dep, 900)
            assert code == 0, f"{dep} exited {code}:\n{self.run.tail(dep)}"
        elif condition == "service_healthy":
            assert svc.healthcheck, f"{dep} is depended on as healthy but has no healthcheck"
            check = self.lmap.health(svc.healthcheck["test"])
            assert check is not None
            self.health_s[dep] = self.run.wait_healthy(dep, check, self.env(dep), 600)
        self.met.add((dep, condition))

    def up(self) -> None:
        for wave in start_order(self.services):
            for name in wave:
                if name in STANDINS or name in NOT_RUN:
                    continue
                svc = self.services[name]
                for dep, condition in svc.depends_on.items():
                    self.ensure(dep, condition)
                self.run.start(name, self.lmap.argv(svc.command), self.env(name))


def _prometheus_targets(lmap: LocalMap, running: set[str]) -> dict[str, list[str]]:
    """deploy/prometheus/prometheus.yml's targets among the running services, mapped here."""
    doc = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    out: dict[str, list[str]] = {}
    for job in doc["scrape_configs"]:
        targets = []
        for sd in job.get("dns_sd_configs", []):
            for name in sd["names"]:
                if name in running:
                    targets.append(f"127.0.0.1:{lmap.port(sd['port'])}")
        out[job["job_name"]] = targets
    return out


def test_compose_file_runs_the_loop_as_processes(stack: Settings, tmp_path: Path) -> None:
    env_file = secrets_env()
    services = {n: s for n, s in load_compose(env_file).items() if not s.profiles}
    iso = Isolation.make(stack, "compose", tmp_path)
    ray_tmp = Path(tempfile.mkdtemp(prefix="adsray-", dir="/tmp"))
    lmap = _local_map(stack, iso, ray_tmp)
    run = LocalRun(tmp_path, ray_tmp)
    compose = ComposeRun(services, lmap, run, iso)
    figures: dict[str, Any] = {}
    try:
        compose.up()
        # the one-shots finished: init made a base model, serve deployed detached and exited 0
        assert run.wait_done("serve", 600) == 0, run.tail("serve")
        origin = (tmp_path / "models" / "base_model.json").read_text()
        assert '"source": "cold-start"' in origin, origin
        proxy = f"http://127.0.0.1:{PORTS[8000]}"
        health = wait_for("the detached app through the balancer", lambda: get(f"{proxy}/healthz").json(), 60)
        assert health["model_version"].startswith("ranker-"), health  # the init's model, not untrained
        # every long-running service passes its own health check
        for name, svc in services.items():
            if name in STANDINS or name in NOT_RUN or svc.one_shot:
                continue
            compose.ensure(name, "service_healthy")
        running = {n for n, p in run.procs.items() if p.popen.poll() is None}
        result = closed_loop(
            run, compose.env("streams"), iso.settings(stack), proxy,
            range(PORTS[8001], PORTS[8004] + 1), f"http://127.0.0.1:{PORTS[8050]}/",
        )  # fmt: skip
        assert result.applied > 0 and result.served > 0 and result.dashboard_status == 200, result
        # Prometheus' targets: every streams worker, trainer, replica and Ray node answers on its own
        targets = _prometheus_targets(lmap, running | {"ray-head"})
        prefixes = {"streams": "adstream_streams_", "trainer": "adstream_trainers_", "ray": "ray_"}
        for job, prefix in prefixes.items():
            assert targets[job], job
            for target in targets[job]:
                assert prefix in get(f"http://{target}/metrics", timeout=10).text, (job, target)
        serving = {f"http://{t}" for t in targets["serving"]}
        assert set(result.replicas) <= serving, (result.replicas, serving)
        for url in result.replicas:
            assert "adstream_serving_requests_total" in get(f"{url}/metrics").text
        # the scheduler ran its jobs at start: the rollup succeeded
        sched = run.tail("scheduler", 40)
        assert "$ adstream attribution rollup" in sched and "exit 0" in sched, sched
        # the app outlives its deploy container; stopping it is an explicit `serve shutdown`
        run.check_alive(["ray-head", "streams", "trainer", "dashboard", "scheduler"])
        run_cli(run, "serve-shutdown", ["serve", "shutdown", "-a", f"http://127.0.0.1:{PORTS[8265]}", "-y"],
                compose.env("serve"))  # fmt: skip
        wait_for("the app gone after serve shutdown", lambda: _down(f"{proxy}/healthz"), 60)
        figures = {"health_s": compose.health_s, "loop": result, "events": run.events}
    finally:
        run.stop()
        iso.clean(stack)
    print("\n".join(run.events))
    print(figures.get("loop"))


def _down(url: str) -> bool:
    try:
        get(url, timeout=2)
    except Exception:  # refused: nothing serves there any more
        return True
    time.sleep(1)
    return False
