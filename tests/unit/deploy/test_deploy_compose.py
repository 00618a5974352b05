"""docker-compose.yml and the Dockerfile, checked offline: the compose spec's JSON Schema, pinned
images, commands that exist in the CLIs they call, health-gated start order, volumes, GPU profile."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.deploy.commands import CommandError, click_commands, parse

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "docker-compose.yml"
OUR_IMAGE = re.compile(r"^adstream:(?P<version>\d+\.\d+\.\d+)(-cuda)?$")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The file as compose reads it: interpolated with the required secrets set (as .env would)."""
    from deploy.manifests import _interpolate_tree

    env = {k: "s" * 40 for k in re.findall(r"\$\{(\w+):\?", COMPOSE.read_text())}
    data: dict[str, Any] = _interpolate_tree(yaml.safe_load(COMPOSE.read_text()), env)
    return data


def test_compose_file_validates_against_the_compose_spec_schema() -> None:
    checker = Path(sys.executable).with_name("check-jsonschema")
    out = subprocess.run(
        [str(checker), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_schema_check_catches_a_broken_file(tmp_path: Path) -> None:
    """The same check on a file with a misspelt key fails (so the test above can fail)."""
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(COMPOSE.read_text().replace("healthcheck:", "healthchek:", 1))
    checker = Path(sys.executable).with_name("check-jsonschema")
    out = subprocess.run(
        [str(checker), "--builtin-schema", "vendor.compose-spec", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "healthchek" in out.stdout + out.stderr


def test_every_image_is_pinned_to_a_version(compose: dict[str, Any]) -> None:
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for name, svc in compose["services"].items():
        image = svc.get("image")
        assert image, f"service {name} names no image"
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and "/" not in tag, f"{name}: image {image!r} is not pinned"
        assert re.search(r"\d+\.\d+", tag), f"{name}: tag {tag!r} of {image!r} is not a version"
        ours = OUR_IMAGE.match(image)
        if "build" in svc:
            assert ours and ours["version"] == version, f"{name}: built image {image!r} ≠ adstream:{version}"


def test_every_command_is_an_existing_cli_entry(compose: dict[str, Any]) -> None:
    groups = click_commands()
    seen: dict[str, str] = {}
    for name, svc in compose["services"].items():
        image = svc["image"]
        if not OUR_IMAGE.match(image):
            continue
        command = svc.get("command")
        assert isinstance(command, list) and command, f"{name}: our image needs an explicit command list"
        assert command[0] in groups, f"{name}: {command[0]!r} is neither adstream nor ray"
        seen[name] = parse(groups, command)
        test = svc.get("healthcheck", {}).get("test", [])
        if test and test[0] == "CMD" and test[1] in groups:
            parse(groups, test[1:])
    wanted = {"serve": "serve", "streams": "worker", "trainer": "trainer", "init": "init",
              "dashboard": "dashboard", "scheduler": "schedule"}  # fmt: skip
    assert {s: seen[s] for s in wanted} == wanted
    assert seen["ray-head"] == seen["ray-worker"] == "start"


def test_the_command_check_rejects_what_does_not_exist() -> None:
    groups = click_commands()
    with pytest.raises(CommandError, match="no command 'serv'"):
        parse(groups, ["adstream", "serv"])
    with pytest.raises(CommandError):
        parse(groups, ["adstream", "worker", "--engines", "aiokafka"])
    with pytest.raises(CommandError):
        parse(groups, ["adstream", "serve", "--replicas", "two"])
    with pytest.raises(CommandError):
        parse(groups, ["ray", "start", "--hed"])


def test_start_order_is_gated_on_health(compose: dict[str, Any]) -> None:
    services = compose["services"]
    # init runs once; serve deploys the app detached and exits (retried only if the deploy fails)
    one_shot = {n for n, s in services.items() if s.get("restart") in ("no", "on-failure")}
    assert one_shot == {"init", "serve"} and services["init"]["restart"] == "no"
    for name, svc in services.items():
        if name not in one_shot:
            assert "healthcheck" in svc, f"{name} has no healthcheck"
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            want = "service_completed_successfully" if dep in one_shot else "service_healthy"
            assert cond == {"condition": want}, f"{name} → {dep}: {cond}"
    for name in ("serve", "streams", "trainer"):
        deps = services[name]["depends_on"]
        assert {"kafka", "redis", "clickhouse", "init"} <= set(deps), name
    assert "ray-head" in services["serve"]["depends_on"]


def test_volumes_persistence_and_settings(compose: dict[str, Any]) -> None:
    services = compose["services"]
    declared = set(compose["volumes"])
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            source = vol.split(":", 1)[0]
            if source.startswith("."):
                continue  # bind mounts: checked below
            assert source in declared, f"{name}: volume {source} is not declared"
    assert "--appendonly" in services["redis"]["command"]  # Redis persists (AOF)
    kafka = services["kafka"]["environment"]
    assert kafka["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft, no ZooKeeper
    assert services["kafka"]["image"].startswith("apache/kafka:")
    from schemas.settings import env_name, leaf_fields

    env = services["streams"]["environment"]
    fields = {env_name(k) for k in leaf_fields()}
    for key in env:
        if key.startswith("ADSTREAM_"):
            assert key in fields, f"{key} is not a setting"


def test_grafana_is_provisioned_from_deploy_grafana(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    mounts = [v for v in grafana["volumes"] if v.startswith("./")]
    assert grafana["depends_on"]["prometheus"] == {"condition": "service_healthy"}
    assert mounts and all(m.startswith("./deploy/grafana/") for m in mounts)
    for mount in mounts:
        assert (ROOT / mount.split(":", 1)[0]).exists(), f"{mount}: deploy/grafana has no such path"
    assert "grafana-clickhouse-datasource" in grafana["environment"]["GF_PLUGINS_PREINSTALL_SYNC"]


def test_gpu_profile(compose: dict[str, Any]) -> None:
    gpu = {n: s for n, s in compose["services"].items() if "gpu" in s.get("profiles", [])}
    assert set(gpu) == {"ray-worker-gpu", "trainer-gpu"}
    for name, svc in gpu.items():
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"], name
        assert svc["build"]["args"]["TORCH_VARIANT"].startswith("cu"), name
        assert svc["environment"]["ADSTREAM_DEVICE"] == "cuda", name
    assert "--num-gpus=1" in gpu["ray-worker-gpu"]["command"]
    others = [s for n, s in compose["services"].items() if n not in gpu]
    assert not any("profiles" in s for s in others)  # everything else starts by default


def test_dockerfile_cpu_default_and_cuda_arg() -> None:
    text = (ROOT / "Dockerfile").read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.M))
    assert froms == ["${PYTHON_IMAGE}"] and re.match(r"python:3\.11\.\d+-slim", args["PYTHON_IMAGE"])
    assert args["TORCH_VARIANT"] == "cpu" and "download.pytorch.org/whl/${TORCH_VARIANT}" in text
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch=={args['TORCH_VERSION']}" in deps  # the image's torch is the one the project pins
    for package in ("schemas", "streams", "trainers", "serving", "attribution", "workloads", "deploy"):
        assert f"COPY {package} {package}" in text, package
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".adstream" in ignored and ".git" in ignored
