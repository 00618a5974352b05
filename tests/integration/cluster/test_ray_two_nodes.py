"""A two-node Ray cluster on one box: the Serve app's replicas on both, one node killed mid-load.

`ray start --head` and a second `ray start --address` (own ports 18830–18899, own temp dir, a
token of their own), `adstream serve --detach --replicas 2` deployed onto them, the replicas
checked to sit on different nodes, then `POST /v1/ads` through the balancer from a few client
threads while every process of the second node (raylet, agents, its replica) is killed with
SIGKILL, as a machine failing. The load goes on afterwards; requests are counted before, in the
seconds after the kill and after recovery (no client retries), and the figures printed.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from deploy.cluster import (
    HEAD_PORTS,
    WORKER_PORTS,
    RayNode,
    kill_ray_node,
    ray_node_argv,
    session_pids,
    start_ray_node_up,
)
from schemas.settings import Settings

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[3]
BIN = ROOT / ".venv" / "bin"
GCS_PORT, HTTP_PORT = 18830, 18850
HEAD_INGRESS, WORKER_INGRESS = (18851, 18854), (18855, 18858)


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, alive: Callable[[], None]) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive()
        try:
            value = check()
        except Exception:  # not up yet
            value = None
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"{what}: not within {timeout_s:.0f}s")


def _env(stack: Settings, token: str, ingress: tuple[int, int]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ADSTREAM_", "RAY_"))}
    env.update({
        "PATH": f"{BIN}:{env.get('PATH', '')}",
        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_HAPROXY_NBTHREAD": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(ingress[0]),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(ingress[1]),
        "RAY_worker_niceness": "0", "RAY_agent_register_timeout_ms": "180000",
        "RAY_raylet_start_wait_time_s": "120",
        "ADSTREAM_TOPIC_PREFIX": stack.topic_prefix, "ADSTREAM_REDIS_PREFIX": f"{stack.redis_prefix}mn:",
        "ADSTREAM_REDIS__URL": stack.redis.url, "ADSTREAM_CLICKHOUSE__URL": stack.clickhouse.url,
        "ADSTREAM_KAFKA__BOOTSTRAP": stack.kafka.bootstrap, "ADSTREAM_STATE_DIR": str(stack.state_dir),
        "ADSTREAM_MODEL_DIR": str(stack.model_dir),
    })  # fmt: skip
    return env


class Load:
    """Client threads posting /v1/ads through the balancer; each outcome logged with its time."""

    def __init__(self, url: str, threads: int = 3) -> None:
        self.url, self.stop = url, threading.Event()
        self.log: list[tuple[float, str]] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=10.0) as http:
            n = 0
            while not self.stop.is_set():
                n += 1
                body = {"user_id": f"mn-{i}-{n % 50}", "slot": "feed", "k": 3}
                try:
                    r = http.post("/v1/ads", json=body)
                    outcome = "2xx" if r.status_code < 300 else str(r.status_code)
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                self.log.append((time.monotonic(), outcome))

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(15)

    def count(self, lo: float, hi: float) -> Counter[str]:
        return Counter(o for t, o in self.log if lo <= t < hi)


@pytest.fixture
def two_nodes(stack: Settings, tmp_path: Path) -> Iterator[dict[str, Any]]:
    token = secrets.token_hex(24)
    temp = Path("/tmp/ray-mn")
    nodes: list[RayNode] = []

    def alive() -> None:
        for n in nodes:
            assert n.proc.poll() is None, f"{n.name} exited:\n{n.log.read_text()[-2000:]}"

    head_env = _env(stack, token, HEAD_INGRESS)
    try:
        ray = str(BIN / "ray")
        head_argv = ray_node_argv(ray, HEAD_PORTS, temp, head_port=GCS_PORT)
        nodes.append(start_ray_node_up("head", head_argv, head_env, tmp_path))
        worker_argv = ray_node_argv(ray, WORKER_PORTS, temp, address=f"127.0.0.1:{GCS_PORT}")
        nodes.append(start_ray_node_up("worker", worker_argv, _env(stack, token, WORKER_INGRESS), tmp_path))
        yield {"nodes": nodes, "env": head_env, "alive": alive, "tmp": tmp_path}
    finally:
        for n in reversed(nodes):
            kill_ray_node(n)
        time.sleep(2)
        for n in nodes:  # what was still starting (a worker spawned mid-kill)
            kill_ray_node(n)
        leftover = [p for n in nodes for p in session_pids(n.proc.pid)]
        assert not leftover, leftover


def test_serve_survives_losing_a_node(two_nodes: dict[str, Any]) -> None:
    env, alive = two_nodes["env"], two_nodes["alive"]
    # `adstream serve --detach --replicas 2` with at most one replica per node (deploy.cluster)
    script = f"from deploy.cluster import deploy_spread; print(deploy_spread(2, {HTTP_PORT}))"
    deploy = subprocess.run(
        [str(BIN / "python"), "-c", script], env=env | {"RAY_ADDRESS": f"127.0.0.1:{GCS_PORT}"},
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
    proxy = f"http://127.0.0.1:{HTTP_PORT}"
    wait_for(
        "the app through the balancer", lambda: httpx.get(f"{proxy}/healthz").status_code == 200, 180, alive
    )
    env = env | {"RAY_ADDRESS": f"127.0.0.1:{GCS_PORT}"}
    first = wait_for(
        "2 replicas", lambda: (c := cluster_view(env)) and len(c["replicas"]) == 2 and c, 180, alive
    )
    print("cluster before the kill:", first)
    assert len(first["nodes"]) == 2, first
    assert sorted(first["replicas"]) == sorted(first["nodes"]), f"replicas not on both nodes: {first}"
    try:
        with Load(proxy) as load:
            t0 = time.monotonic()
            time.sleep(15)
            t_kill = time.monotonic()
            killed = kill_ray_node(two_nodes["nodes"][1])
            time.sleep(30)
            t_end = time.monotonic()
        before, during, after = (
            load.count(t0, t_kill),
            load.count(t_kill, t_kill + 15),
            load.count(t_kill + 15, t_end),
        )
        status = cluster_view(env)
        print(f"killed {len(killed)} processes of the worker node; requests before: {dict(before)}")
        print(f"0–15 s after the kill: {dict(during)}, 15–30 s after: {dict(after)}; cluster after: {status}")
        assert before["2xx"] > 0 and sum(before.values()) == before["2xx"], before
        assert after["2xx"] > 0, after  # traffic continues through the balancer
        assert after["2xx"] / sum(after.values()) >= 0.95, after
    finally:
        shutdown = "import ray; from ray import serve; ray.init(); serve.shutdown()"
        subprocess.run([str(BIN / "python"), "-c", shutdown], env=env, timeout=180, check=False)


VIEW = """
import json, ray
from ray import serve
ray.init(logging_level="WARNING", log_to_driver=False)
nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
actors = ray._private.state.actors().values()  # the GCS's actor table (no dashboard here)
replicas = [a["Address"]["NodeID"] for a in actors if a["State"] == "ALIVE"
            and "ServeReplica" in a["ActorClassName"] and "AdServer" in a["ActorClassName"]]
app = serve.status().applications.get("adstream")
print("VIEW" + json.dumps({"nodes": nodes, "replicas": replicas, "app": app and str(app.status)}))
"""


def cluster_view(env: dict[str, str]) -> dict[str, Any] | None:
    """Alive nodes, the node of each alive AdServer replica and the app's status, read by a
    driver of its own (a subprocess: the test process stays out of the cluster)."""
    argv = [str(BIN / "python"), "-c", VIEW]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    line = next((x for x in out.stdout.splitlines() if x.startswith("VIEW")), None)
    return json.loads(line[4:]) if line else None
