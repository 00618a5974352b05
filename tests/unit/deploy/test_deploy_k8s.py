"""deploy/k8s, checked offline: core resources against the Kubernetes 1.37 schemas
(kubernetes-validate, strict), the RayService's serveConfigV2 by Ray's own ServeDeploySchema and
its pod templates as core PodTemplates, replicas = partitions, commands that exist, settings
keys that are settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from schemas import topics
from schemas.settings import Settings, env_name, leaf_fields, nested
from tests.unit.deploy.commands import click_commands, parse

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.37.0"


def load(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def core_manifests() -> list[str]:
    skip = ("kustomization.yaml", "rayservice.yaml")
    return sorted(p.name for p in K8S.glob("*.yaml") if p.name not in skip)


@pytest.fixture(scope="module")
def rayservice() -> dict[str, Any]:
    (doc,) = load("rayservice.yaml")
    return doc


def kube_validate(doc: dict[str, Any]) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", core_manifests())
def test_core_manifests_validate_against_the_kubernetes_schemas(name: str) -> None:
    docs = load(name)
    assert docs, name
    for doc in docs:
        kube_validate(doc)


def test_the_validator_rejects_a_broken_manifest() -> None:
    import kubernetes_validate

    (doc,) = load("streams.yaml")
    doc["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kube_validate(doc)
    (doc,) = load("streams.yaml")
    doc["spec"]["replicas"] = "eight"
    with pytest.raises(kubernetes_validate.ValidationError):
        kube_validate(doc)


def test_kustomization_lists_every_manifest() -> None:
    (kust,) = load("kustomization.yaml")
    assert sorted(kust["resources"]) == sorted([*core_manifests(), "rayservice.yaml"])
    # the Secret comes from the operator's secrets.env (no placeholder Secret in the tree)
    (gen,) = kust["secretGenerator"]
    assert gen["name"] == "adstream-secrets" and gen["envs"] == ["secrets.env"]
    assert "secrets.env" in (K8S / ".gitignore").read_text().split()


def test_replicas_are_the_partitions_each_role_can_own() -> None:
    (streams,) = load("streams.yaml")
    (trainer,) = load("trainer.yaml")
    user_topics = [topics.IMPRESSIONS, topics.CLICKS, topics.DWELL, topics.CONVERSIONS]
    partitions = {topics.TOPICS_BY_NAME[t].partitions for t in user_topics}
    assert partitions == {streams["spec"]["replicas"]}  # one consumer group over co-partitioned topics
    assert trainer["spec"]["replicas"] == topics.TOPICS_BY_NAME[topics.TRAINING_EXAMPLES].partitions


def test_container_commands_exist_and_settings_keys_are_settings() -> None:
    groups = click_commands()
    fields = {env_name(k): v for k, v in leaf_fields().items()}
    from deploy.manifests import _read_env_file

    (config,) = load("configmap.yaml")
    secret_keys = list(_read_env_file(K8S / "secrets.env.example"))
    for key in [*config["data"], *secret_keys]:
        assert key in fields, key
    for key in secret_keys:
        annotation = str(fields[key].annotation)
        assert "SecretStr" in annotation, f"{key} is in the Secret but is not a SecretStr setting"
    Settings(**nested(config["data"]))  # valid values
    seen = set()
    for name in ("streams.yaml", "trainer.yaml", "init-job.yaml", "cronjobs.yaml"):
        for doc in load(name):
            spec = doc["spec"].get("jobTemplate", doc)["spec"]["template"]["spec"]
            for container in spec.get("initContainers", []) + spec["containers"]:
                seen.add(" ".join(container["command"][1:3]))
                parse(groups, container["command"])
                refs = {next(iter(r.values()))["name"] for r in container["envFrom"]}
                assert refs == {"adstream-settings", "adstream-secrets"}, name
    assert seen == {
        "worker --engine",
        "trainer --metrics-port",
        "init",
        "attribution rollup",
        "attribution --by",
    }


def test_serve_config_parses_with_rays_schema_and_imports(rayservice: dict[str, Any]) -> None:
    import importlib

    from ray.serve.schema import ServeDeploySchema

    assert (rayservice["apiVersion"], rayservice["kind"]) == ("ray.io/v1", "RayService")
    config = ServeDeploySchema.model_validate(yaml.safe_load(rayservice["spec"]["serveConfigV2"]))
    (app,) = config.applications
    assert app.route_prefix == "/"
    module, _, attr = app.import_path.partition(":")
    builder = getattr(importlib.import_module(module), attr)
    built = builder({**(app.args or {}), "serving.consume_deltas": False, "wait_for_model_s": 0})
    names = {built._bound_deployment.name}
    for dep in app.deployments:
        assert dep.name in names, f"serveConfigV2 configures {dep.name}, the app has {names}"
        assert dep.num_replicas == "auto"
        auto = dep.autoscaling_config
        assert auto["min_replicas"] >= 2 and auto["max_replicas"] > auto["min_replicas"]


def test_ray_cluster_structure(rayservice: dict[str, Any]) -> None:
    import ray

    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__  # the image's Ray must be the operator's rayVersion
    assert cluster["enableInTreeAutoscaling"] is True
    head = cluster["headGroupSpec"]
    assert set(head) == {"rayStartParams", "template"}
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())  # KubeRay wants strings
    templates = {"head": head["template"]}
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"cpu", "gpu"}
    for name, group in groups.items():
        keys = {"groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template"}
        assert keys == set(group), name
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], name
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), name
        templates[name] = group["template"]
    gpu = groups["gpu"]
    assert gpu["rayStartParams"]["num-gpus"] == "1"
    (gpu_container,) = gpu["template"]["spec"]["containers"]
    assert gpu_container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert gpu_container["image"].endswith("-cuda")
    for name, template in templates.items():  # each pod template is a valid core PodTemplate
        meta = {"name": f"adstream-{name}"}
        kube_validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": meta, "template": template})
        claims = {v["persistentVolumeClaim"]["claimName"] for v in template["spec"]["volumes"]}
        assert claims == {"adstream-models"}, name
