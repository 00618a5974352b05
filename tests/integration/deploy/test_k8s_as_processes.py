"""deploy/k8s, run for real without a cluster: `kubectl kustomize` renders the manifests (with an
operator's secrets.env), and each container's own command and environment (ConfigMap + Secret
+ env, as the kubelet builds it) runs as a local process; the RayService's head pod runs the
`ray start` KubeRay makes from its rayStartParams, and its serveConfigV2 is deployed the way
KubeRay does it (Serve's REST API, here `serve deploy`). Then the closed loop, the probes as
written, and each CronJob's command once.

Stand-ins and deviations (harness.py says what is mapped): the local stack for the Kafka, Redis
and ClickHouse clusters the ConfigMap names (no TLS/SASL/passwords); the worker groups' pods
are further Ray nodes (the multi-node test's subject), so the head, which the file gives
`num-cpus: 0`, takes the replicas here; the Deployments run one replica each.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.manifests import K8S_DIR, Container, containers, ray_start_argv, render_kustomize
from schemas.settings import Settings
from tests.integration.deploy.harness import LocalMap, LocalRun, get, wait_for
from tests.integration.deploy.loop import Isolation, closed_loop, run_cli

pytestmark = [
    pytest.mark.slow,
    pytest.mark.kafka,
    pytest.mark.redis,
    pytest.mark.clickhouse,
    pytest.mark.ray,
    pytest.mark.timeout(1500),
]

PORTS = {6379: 18231, 8265: 18232, 10001: 18233, 8080: 18235, 8000: 18240, 8001: 18241, 8002: 18242,
         8003: 18243, 8004: 18244, 9464: 18250, 9465: 18251, 8050: 18252}  # fmt: skip
RAY_PORTS = {"dashboard-port": 18232, "ray-client-server-port": 18233, "dashboard-agent-listen-port": 18234,
             "node-manager-port": 18236, "object-manager-port": 18237, "runtime-env-agent-port": 18238,
             "dashboard-agent-grpc-port": 18239}  # fmt: skip


def _render(tmp: Path) -> list[dict[str, Any]]:
    k8s = tmp / "k8s"
    shutil.copytree(K8S_DIR, k8s, ignore=shutil.ignore_patterns("secrets.env"))
    body = (K8S_DIR / "secrets.env.example").read_text()
    filled = re.sub(r"(?m)^(\w+)=$", lambda m: f"{m[1]}={'k' * 48}", body)
    (k8s / "secrets.env").write_text(filled)
    return render_kustomize(k8s)


def _named_port(container: Container, probe: dict[str, Any]) -> int:
    port = probe["httpGet"]["port"]
    if isinstance(port, int):
        return port
    return int(next(p["containerPort"] for p in container.spec["ports"] if p["name"] == port))


def _check_argv(lmap: LocalMap, container: Container, probe: str) -> list[str]:
    spec = container.spec[probe]
    if "exec" in spec:
        return lmap.argv(spec["exec"]["command"])
    path = spec["httpGet"]["path"]
    return [
        "curl",
        "-fsS",
        "-o",
        "/dev/null",
        f"http://127.0.0.1:{lmap.port(_named_port(container, spec))}{path}",
    ]


def test_k8s_manifests_run_the_loop_as_processes(stack: Settings, tmp_path: Path) -> None:
    from urllib.parse import urlparse

    docs = _render(tmp_path)
    by = {c.workload: c for c in containers(docs)}
    iso = Isolation.make(stack, "k8s", tmp_path)
    ray_tmp = Path(tempfile.mkdtemp(prefix="adsray-", dir="/tmp"))
    redis = urlparse(stack.redis.url)
    lmap = LocalMap(
        kafka=stack.kafka.bootstrap,
        redis_url=f"redis://{redis.hostname}:{redis.port or 6379}/{(redis.path or '/0').lstrip('/') or 0}",
        clickhouse_url=iso.clickhouse_url, ports=PORTS, ray_ports=RAY_PORTS,
        ray_worker_ports=(18280, 18299), tmp=tmp_path, ray_tmp=ray_tmp,
    )  # fmt: skip
    run = LocalRun(tmp_path, ray_tmp)
    (rayservice,) = [d for d in docs if d["kind"] == "RayService"]
    head = by[f"RayService/{rayservice['metadata']['name']}/head"]
    params = dict(rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"])
    params |= {"num-cpus": "2", "port": "6379"}  # replicas on the head (see above); KubeRay's GCS port

    # KubeRay's authOptions (mode: token): it generates the token and gives every Ray pod both
    auth = rayservice["spec"]["rayClusterConfig"].get("authOptions", {}).get("mode") == "token"
    ray_auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "t" * 48} if auth else {}

    def env(c: Container) -> dict[str, str]:
        return lmap.env(c.env, iso.overrides() | (ray_auth if c is head else {}))

    try:
        # `kubectl apply -k`: everything at once; the init Job, and the pods that wait for it
        run.start("init", lmap.argv(by["Job/adstream-init"].command), env(by["Job/adstream-init"]))
        run.start("ray-head", lmap.argv(ray_start_argv(params, head=True)), env(head))
        trainer = by["Deployment/adstream-trainer"]
        run.start("trainer", lmap.argv(trainer.command), env(trainer))
        dashboard = by["Deployment/adstream-dashboard"]
        run.start("dashboard", lmap.argv(dashboard.command), env(dashboard))
        run.wait_healthy(
            "ray-head", ["ray", "health-check", f"--address=127.0.0.1:{PORTS[6379]}"], env(head), 600
        )
        # KubeRay hands serveConfigV2 to the head's Serve REST API once the head is up
        config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
        config["http_options"] |= {"host": "127.0.0.1", "port": PORTS[config["http_options"]["port"]]}
        (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
        run_cli(run, "serve-deploy", ["serve", "deploy", str(tmp_path / "serve.yaml"), "-a",
                f"http://127.0.0.1:{PORTS[8265]}"], env(head))  # fmt: skip
        proxy = f"http://127.0.0.1:{PORTS[8000]}"
        not_ready_while_init = []
        while run.procs["init"].popen.poll() is None:  # the app waits for the model: not ready
            try:
                not_ready_while_init.append(get(f"{proxy}/healthz", timeout=2).status_code)
            except Exception:  # refused: nothing serves yet
                not_ready_while_init.append(0)
            time.sleep(2)
        assert run.wait_done("init", 10) == 0, run.tail("init")
        assert 200 not in not_ready_while_init, not_ready_while_init
        streams = by["Deployment/adstream-streams"]
        run.start("streams", lmap.argv(streams.command), env(streams))
        health = wait_for("the RayService app", lambda: get(f"{proxy}/healthz").json(), 600, every_s=3)
        assert health["model_version"].startswith("ranker-"), health
        # the trainer waited for the init Job's model instead of failing
        assert "waiting for the base model" in run.tail("trainer", 400), run.tail("trainer")
        for name, c in (("trainer", trainer), ("streams", streams), ("dashboard", dashboard)):
            for probe in ("startupProbe", "readinessProbe"):
                if probe in c.spec:
                    run.wait_healthy(name, _check_argv(lmap, c, probe), env(c), 300)
        result = closed_loop(
            run, env(streams), iso.settings(stack), proxy,
            range(PORTS[8001], PORTS[8004] + 1), f"http://127.0.0.1:{PORTS[8050]}/",
        )  # fmt: skip
        assert result.applied > 0 and result.served > 0 and result.dashboard_status == 200, result
        # liveness on progress, as the kubelet runs it, after the loop: alive
        for name, c in (("trainer", trainer), ("streams", streams)):
            run.wait_healthy(name, _check_argv(lmap, c, "livenessProbe"), env(c), 120)
        # each CronJob's command once
        rollup = by["CronJob/adstream-rollup"]
        run_cli(run, "cron-rollup", lmap.argv(rollup.command), env(rollup))
        run.check_alive(["ray-head", "trainer", "streams", "dashboard"])
        assert auth, "the RayService runs Ray with token authentication"
        print(result, not_ready_while_init, "\n".join(run.events), sep="\n")
    finally:
        run.stop()
        iso.clean(stack)
