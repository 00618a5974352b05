"""The deployment files as data: docker-compose.yml interpolated as Compose does it, deploy/k8s
rendered as kustomize renders it, and each adstream container's command and environment.

Used by the checks of the files (tests/unit/deploy/) and by the runs that start every service's
own command as a local process (tests/integration/deploy/): what they run is what the files say.
"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from schemas.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
K8S_DIR = ROOT / "deploy" / "k8s"
OUR_IMAGE = re.compile(r"^adstream:\d+\.\d+\.\d+(-cuda)?$")

# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}, ${VAR:+alt}, ${VAR+alt}, $VAR, $$
_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class MissingVariable(ConfigError):
    """A `${VAR:?message}` (or `${VAR?message}`) whose variable is unset (or empty)."""


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """One string interpolated as the Compose specification says (`$$` is a literal `$`)."""

    def one(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        name = m["braced"] or m["bare"]
        op, arg = m["op"], m["arg"] or ""
        value = env.get(name)
        empty = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return arg if (value is None if op == "-" else empty) else str(value)
        if op in (":?", "?"):
            if value is None if op == "?" else empty:
                raise MissingVariable(f"required variable {name} is missing a value: {arg or name}")
            return str(value)
        if op in (":+", "+"):
            return "" if (value is None if op == "+" else empty) else arg
        return "" if value is None else str(value)

    return _VAR.sub(one, text)


def _interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_tree(v, env) for v in node]
    if isinstance(node, dict):
        return {k: _interpolate_tree(v, env) for k, v in node.items()}
    return node


@dataclass(frozen=True)
class ComposeService:
    """One compose service, interpolated: what `docker compose up` would run."""

    name: str
    image: str
    command: list[str]
    environment: dict[str, str]
    depends_on: dict[str, str]  # service → condition
    healthcheck: dict[str, Any] | None
    restart: str
    profiles: list[str]
    ports: list[str]
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def ours(self) -> bool:
        """Runs the adstream image (its command is adstream's or Ray's CLI)."""
        return bool(OUR_IMAGE.match(self.image))

    @property
    def one_shot(self) -> bool:
        """Runs to completion (`init`, the detached `serve` deploy) rather than for ever."""
        return self.restart in ("no", "on-failure")


def _env_dict(env: Any) -> dict[str, str]:
    if env is None:
        return {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def _depends(dep: Any) -> dict[str, str]:
    if dep is None:
        return {}
    if isinstance(dep, list):
        return dict.fromkeys(dep, "service_started")
    return {k: (v or {}).get("condition", "service_started") for k, v in dep.items()}


def load_compose(env: Mapping[str, str], path: Path = COMPOSE_FILE) -> dict[str, ComposeService]:
    """The compose file's services, interpolated with `env` (MissingVariable for a required one)."""
    doc = _interpolate_tree(yaml.safe_load(path.read_text()), env)
    services = {}
    for name, svc in doc["services"].items():
        command = svc.get("command") or []
        if isinstance(command, str):
            import shlex

            command = shlex.split(command)
        services[name] = ComposeService(
            name=name,
            image=str(svc.get("image", "")),
            command=[str(c) for c in command],
            environment=_env_dict(svc.get("environment")),
            depends_on=_depends(svc.get("depends_on")),
            healthcheck=svc.get("healthcheck"),
            restart=str(svc.get("restart", "no")),
            profiles=list(svc.get("profiles", [])),
            ports=[str(p) for p in svc.get("ports", [])],
            raw=svc,
        )
    return services


def start_order(services: Mapping[str, ComposeService]) -> list[list[str]]:
    """Waves of services whose dependencies are all in earlier waves (compose's start order);
    ConfigError on a cycle or an unknown dependency."""
    left = dict(services)
    done: set[str] = set()
    waves: list[list[str]] = []
    while left:
        for name, svc in left.items():
            unknown = set(svc.depends_on) - set(services)
            if unknown:
                raise ConfigError(f"{name} depends on unknown service(s) {sorted(unknown)}")
        wave = sorted(n for n, s in left.items() if set(s.depends_on) <= done)
        if not wave:
            raise ConfigError(f"dependency cycle among {sorted(left)}")
        waves.append(wave)
        done |= set(wave)
        for n in wave:
            del left[n]
    return waves


def published_binds(service: ComposeService) -> list[tuple[str, str, str]]:
    """(host address, host port, container port) of each published port ("" address: all)."""
    out = []
    for spec in service.ports:
        parts = spec.split(":")
        if len(parts) == 3:
            out.append((parts[0], parts[1], parts[2]))
        elif len(parts) == 2:
            out.append(("", parts[0], parts[1]))
        else:
            out.append(("", parts[0], parts[0]))
    return out


# -- Kubernetes ------------------------------------------------------------------------------
def _read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value
    return out


def render_kustomize(directory: Path = K8S_DIR, use_kubectl: bool = True) -> list[dict[str, Any]]:
    """The manifests `kubectl apply -k DIRECTORY` would apply: rendered by `kubectl kustomize`
    when kubectl is on the PATH (and `use_kubectl`), else by this module's renderer of the
    features kustomization.yaml uses (resources, secretGenerator from env files, generator
    options). ConfigError when rendering fails (a missing secrets.env, say)."""
    kubectl = shutil.which("kubectl") if use_kubectl else None
    if kubectl:
        out = subprocess.run(
            [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120
        )
        if out.returncode != 0:
            raise ConfigError(f"kubectl kustomize {directory}: {out.stderr.strip()}")
        return [d for d in yaml.safe_load_all(out.stdout) if d]
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    allowed = {"apiVersion", "kind", "resources", "secretGenerator", "generatorOptions"}
    if set(kust) - allowed:
        raise ConfigError(f"kustomization uses {sorted(set(kust) - allowed)}: render it with kubectl")
    docs: list[dict[str, Any]] = []
    for gen in kust.get("secretGenerator", []):
        data: dict[str, str] = {}
        for name in gen.get("envs", []):
            path = directory / name
            if not path.exists():
                raise ConfigError(f"secretGenerator {gen['name']}: {path} does not exist")
            data |= _read_env_file(path)
        labels = (gen.get("options") or {}).get("labels") or {}
        meta: dict[str, Any] = {"name": gen["name"]} | ({"labels": labels} if labels else {})
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        docs.append(
            {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque", "data": encoded}
        )
    if not (kust.get("generatorOptions") or {}).get("disableNameSuffixHash") and docs:
        raise ConfigError("hash-suffixed generated names need kubectl kustomize")
    for name in kust.get("resources", []):
        docs += [d for d in yaml.safe_load_all((directory / name).read_text()) if d]
    return docs


@dataclass(frozen=True)
class Container:
    """One container of a rendered workload: the command it runs and its whole environment."""

    workload: str  # Kind/name
    name: str
    image: str
    command: list[str]
    env: dict[str, str]
    spec: dict[str, Any] = field(repr=False, default_factory=dict)


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    kind = doc.get("kind")
    spec = doc.get("spec", {})
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return spec["template"]["spec"]  # type: ignore[no-any-return]
    if kind == "CronJob":
        return spec["jobTemplate"]["spec"]["template"]["spec"]  # type: ignore[no-any-return]
    return None


def config_sources(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, str]]:
    """(kind, name) → data of every ConfigMap and Secret (Secret data base64-decoded)."""
    out: dict[tuple[str, str], dict[str, str]] = {}
    for d in docs:
        if d.get("kind") == "ConfigMap":
            out[("ConfigMap", d["metadata"]["name"])] = {k: str(v) for k, v in (d.get("data") or {}).items()}
        elif d.get("kind") == "Secret":
            data = {k: base64.b64decode(v).decode() for k, v in (d.get("data") or {}).items()}
            data |= {k: str(v) for k, v in (d.get("stringData") or {}).items()}
            out[("Secret", d["metadata"]["name"])] = data
    return out


def container_env(
    container: dict[str, Any], sources: Mapping[tuple[str, str], dict[str, str]]
) -> dict[str, str]:
    """A container's environment as the kubelet builds it: envFrom in order, then env."""
    env: dict[str, str] = {}
    for ref in container.get("envFrom", []):
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key in ref:
                name = ref[key]["name"]
                if (kind, name) not in sources and not ref[key].get("optional"):
                    raise ConfigError(f"{container['name']}: {kind} {name} is not in the rendered manifests")
                env |= sources.get((kind, name), {})
    for item in container.get("env", []):
        env[item["name"]] = str(item.get("value", ""))
    return env


def containers(docs: list[dict[str, Any]]) -> list[Container]:
    """Every container of the rendered workloads (init containers first), RayService pods included
    (their command is KubeRay's `ray start`, made from rayStartParams: `ray_start_argv`)."""
    sources = config_sources(docs)
    out = []
    for d in docs:
        pods: list[tuple[str, dict[str, Any]]] = []
        if (spec := _pod_spec(d)) is not None:
            pods.append((f"{d['kind']}/{d['metadata']['name']}", spec))
        elif d.get("kind") == "RayService":
            cluster = d["spec"]["rayClusterConfig"]
            pods.append(
                (f"RayService/{d['metadata']['name']}/head", cluster["headGroupSpec"]["template"]["spec"])
            )
            for group in cluster.get("workerGroupSpecs", []):
                pods.append(
                    (f"RayService/{d['metadata']['name']}/{group['groupName']}", group["template"]["spec"])
                )
        for workload, spec in pods:
            for c in [*spec.get("initContainers", []), *spec["containers"]]:
                env = container_env(c, sources)
                out.append(Container(workload, c["name"], c["image"], list(c.get("command", [])), env, c))
    return out


def ray_start_argv(params: Mapping[str, str], head: bool, address: str = "") -> list[str]:
    """`ray start` as KubeRay builds it from a group's rayStartParams (--key=value, --block)."""
    argv = ["ray", "start", "--head"] if head else ["ray", "start", f"--address={address}"]
    argv += [f"--{k}={v}" for k, v in params.items()]
    return [*argv, "--block"]
