"""Run deployment files' services as local processes: each service's own command and environment,
with the container addresses mapped onto this machine (the local stack for Kafka, Redis and
ClickHouse, 127.0.0.1 and this suite's own ports for the rest), started in dependency order and
gated on their own health checks.

What the mapping changes, and nothing else:
* hosts: the stores' URLs point at the local stack (a test database, topic and Redis prefix of
  the run's own; the stand-ins have no TLS, SASL or passwords, so those settings are dropped);
  other service names and 0.0.0.0 become 127.0.0.1;
* ports: every container port the files use maps to one of this suite's (18200–18299), in
  arguments, environment values and health checks alike;
* Ray: a node started here also gets `--node-ip-address=127.0.0.1`, its own temp dir and fixed
  ports for the listeners Ray would otherwise put on shared defaults (10001, 52365, …), and a
  longer agent start-up timeout for a loaded 2-core machine;
* the models volume is a temporary folder.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

BIN = Path(sys.executable).parent


@dataclass
class LocalMap:
    """How container addresses become this machine's."""

    kafka: str
    redis_url: str
    clickhouse_url: str
    ports: dict[int, int]
    ray_ports: dict[str, int]  # extra `ray start` listeners → port
    ray_worker_ports: tuple[int, int]
    tmp: Path
    ray_tmp: Path  # short: Ray's socket paths must fit in 107 bytes
    hosts: tuple[str, ...] = ("ray-head", "ray-worker", "ray-worker-gpu", "prometheus", "dashboard")

    def port(self, container_port: int | str) -> int:
        p = int(container_port)
        if p not in self.ports:
            raise KeyError(f"container port {p} has no local mapping (add it to the run's port map)")
        return self.ports[p]

    def text(self, value: str) -> str:
        """Addresses in one string (a URL, host:port, an argument)."""
        v = value.replace("0.0.0.0", "127.0.0.1").replace("localhost", "127.0.0.1")
        for host in self.hosts:
            v = re.sub(rf"(?<![\w.-]){re.escape(host)}(?=:\d)", "127.0.0.1", v)
        v = re.sub(r"(?<=127\.0\.0\.1:)(\d+)", lambda m: str(self.port(m[1])), v)
        # the stores last: their stand-ins' addresses are this machine's already
        v = re.sub(r"\bkafka:9092\b", self.kafka, v)
        v = re.sub(r"rediss?://[^/\s]*redis[^/\s]*(:\d+)?/\d+", self.redis_url, v)
        return re.sub(r"clickhouse://[^/\s]*clickhouse[^/\s]*(:\d+)?/\w+", self.clickhouse_url, v)

    def argv(self, argv: Sequence[str]) -> list[str]:
        """A command line: addresses, and the port options' values."""
        out: list[str] = []
        port_opts = ("--port", "--metrics-port", "--metrics-export-port", "--dashboard-port")
        for i, arg in enumerate(argv):
            if i and argv[i - 1] in port_opts and arg.isdigit():
                out.append(str(self.port(arg)))
                continue
            m = re.match(r"^(--(?:port|metrics-port|metrics-export-port|dashboard-port))=(\d+)$", arg)
            out.append(f"{m[1]}={self.port(m[2])}" if m else self.text(arg))
        if argv[:2] == ["ray", "start"]:
            out = self.ray_node(out)
        return out

    def ray_node(self, argv: list[str]) -> list[str]:
        extra = [
            f"--{k}={v}" for k, v in self.ray_ports.items() if not any(a.startswith(f"--{k}") for a in argv)
        ]
        lo, hi = self.ray_worker_ports
        extra += ["--node-ip-address=127.0.0.1", "--disable-usage-stats", f"--temp-dir={self.ray_tmp}"]
        extra += [f"--min-worker-port={lo}", f"--max-worker-port={hi}"]
        return [*argv[:-1], *extra, argv[-1]] if argv[-1] == "--block" else [*argv, *extra]

    def env(self, env: Mapping[str, str], overrides: Mapping[str, str]) -> dict[str, str]:
        """A service's environment mapped, on top of this process's, with the run's overrides."""
        out = {k: v for k, v in os.environ.items() if not k.startswith(("ADSTREAM_", "RAY_"))}
        for key in ("ADSTREAM_KAFKA__SESSION_TIMEOUT_MS", "ADSTREAM_KAFKA__HEARTBEAT_INTERVAL_MS"):
            if key in os.environ:  # the suite's short group timeouts (tests/conftest.py)
                out[key] = os.environ[key]
        drop = ("PASSWORD", "SASL", "SECURITY_PROTOCOL", "CLICKHOUSE__SECURE", "CLICKHOUSE__USER")
        for key, value in env.items():
            if key.startswith("ADSTREAM_") and any(d in key for d in drop):
                continue  # the local stand-ins run without TLS, SASL or passwords
            port_valued = key.endswith(("_PORT", "__PORT")) and value.isdigit()
            out[key] = str(self.port(value)) if port_valued else self.text(value)
            stores = {"KAFKA__BOOTSTRAP": self.kafka, "REDIS__URL": self.redis_url,
                      "CLICKHOUSE__URL": self.clickhouse_url}  # fmt: skip
            for suffix, local in stores.items():
                if key == f"ADSTREAM_{suffix}":
                    out[key] = local  # the stand-in, whatever cluster address the file names
        out["PATH"] = f"{BIN}:{os.environ.get('PATH', '')}"
        out["RAY_agent_register_timeout_ms"] = "180000"
        return out | dict(overrides)

    def health(self, test: Sequence[str] | str) -> list[str] | None:
        """A compose healthcheck `test` as a local command (None: NONE / disabled)."""
        if isinstance(test, str):
            return ["sh", "-c", self.text(test)]
        if not test or test[0] == "NONE":
            return None
        if test[0] == "CMD-SHELL":
            return ["sh", "-c", self.text(test[1])]
        return self.argv(list(test[1:]))


def resolve(argv: list[str]) -> list[str]:
    """The venv's adstream / ray / serve for the image's."""
    if argv and argv[0] in ("adstream", "ray", "serve") and (BIN / argv[0]).exists():
        return [str(BIN / argv[0]), *argv[1:]]
    return argv


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    argv: list[str]
    env: dict[str, str]
    restarted: bool = False


@dataclass
class LocalRun:
    """The processes of one run; `stop` ends exactly them (and Ray's, found by our temp dir)."""

    tmp: Path
    ray_tmp: Path
    procs: dict[str, Proc] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    def say(self, line: str) -> None:
        self.events.append(f"{time.monotonic() - self.t0:6.1f}s {line}")

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> Proc:
        log = self.tmp / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.say(f"start {name}: {' '.join(argv)}")
        with log.open("ab") as out:
            popen = subprocess.Popen(
                resolve(argv), env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.tmp,
            )  # fmt: skip
        self.procs[name] = Proc(name, popen, log, argv, env)
        return self.procs[name]

    def restart_ray_node(self, name: str) -> bool:
        """Start a Ray node again once when it died starting: `ray start` gives its raylet a fixed
        30 s to register (ray/_private/node.py), which a loaded 2-core machine can miss. What the
        failed attempt left running (found by this run's Ray temp dir) is stopped first."""
        proc = self.procs[name]
        if proc.argv[:2] != ["ray", "start"] or proc.restarted:
            return False
        self.say(f"{name} exited {proc.popen.returncode} while starting: once more")
        for pid in leftover_pids(str(self.ray_tmp)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(3)
        self.start(name, proc.argv, proc.env)
        self.procs[name].restarted = True
        return True

    def tail(self, name: str, n: int = 25) -> str:
        try:
            return "\n".join(self.procs[name].log.read_text(errors="replace").splitlines()[-n:])
        except (OSError, KeyError):
            return "(no log)"

    def check_alive(self, names: Sequence[str]) -> None:
        for name in names:
            code = self.procs[name].popen.poll()
            if code is not None:
                raise AssertionError(f"{name} exited with {code}:\n{self.tail(name)}")

    def wait_done(self, name: str, timeout_s: float) -> int:
        try:
            code = self.procs[name].popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still runs after {timeout_s:.0f}s:\n{self.tail(name)}") from None
        self.say(f"{name} exited {code}")
        return code

    def wait_healthy(self, name: str, check: list[str], env: dict[str, str], timeout_s: float) -> float:
        """Run the health check until it passes (the service must stay up meanwhile); seconds."""
        t0 = time.monotonic()
        last = ""
        while time.monotonic() - t0 < timeout_s:
            if name in self.procs and self.procs[name].popen.poll() is not None:
                if not self.restart_ray_node(name):
                    self.check_alive([name])
            try:
                out = subprocess.run(
                    resolve(check), env=env, capture_output=True, text=True, timeout=60, check=False
                )
            except subprocess.TimeoutExpired:  # the check itself hung: not healthy yet
                last = "health check timed out"
                continue
            if out.returncode == 0:
                self.say(f"{name} healthy after {time.monotonic() - t0:.1f}s ({' '.join(check[:4])}…)")
                return time.monotonic() - t0
            last = (out.stdout + out.stderr)[-400:]
            time.sleep(2)
        raise AssertionError(f"{name} not healthy after {timeout_s:.0f}s ({last}):\n{self.tail(name)}")

    def stop(self, grace_s: float = 40) -> None:
        """SIGTERM each process group (newest first), SIGKILL what is left, then any Ray process
        still running from this run's temp dir (Ray's workers leave the group)."""
        for proc in reversed(list(self.procs.values())):
            if proc.popen.poll() is None:
                try:
                    os.killpg(proc.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.popen.wait(10)
        for pid in leftover_pids(str(self.ray_tmp)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def leftover_pids(marker: str) -> list[int]:
    """Processes whose command line or environment names this run's Ray temp dir."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            pids.append(int(entry.name))
    return pids


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def get(url: str, **kw: Any) -> httpx.Response:
    return httpx.get(url, timeout=kw.pop("timeout", 5), **kw)


def wait_for(what: str, check: Any, timeout_s: float, every_s: float = 2.0) -> Any:
    """Poll `check()` until truthy; AssertionError naming `what` with its last value."""
    t0 = time.monotonic()
    value = None
    while time.monotonic() - t0 < timeout_s:
        try:
            value = check()
        except (httpx.HTTPError, OSError) as exc:
            value = exc
        else:
            if value:
                return value
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f}s (last: {value!r})")


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
