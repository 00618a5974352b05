"""The deployment files are safe and observable by default, checked offline: required secrets
(compose `:?`, a generated k8s Secret that must be supplied), loopback binds, every command a
real CLI command, Prometheus scraping every process on its own port, an operations dashboard on
metric names the code exports, liveness on progress, scheduled rollups and attribution runs."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from deploy.manifests import (
    COMPOSE_FILE,
    K8S_DIR,
    MissingVariable,
    containers,
    interpolate,
    load_compose,
    published_binds,
    render_kustomize,
)
from schemas.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
REQUIRED = re.findall(r"\$\{(\w+):\?", COMPOSE_FILE.read_text())
SECRETS = {k: "s" * 40 for k in REQUIRED}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return {n: s for n, s in load_compose(SECRETS).items()}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    k8s = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S_DIR, k8s, ignore=shutil.ignore_patterns("secrets.env"))
    body = (K8S_DIR / "secrets.env.example").read_text()
    (k8s / "secrets.env").write_text(re.sub(r"(?m)^(\w+)=$", r"\1=secret-value-of-\1", body))
    return render_kustomize(k8s)


def test_interpolation_follows_the_compose_spec() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("a$$b ${SET} $SET ${UNSET}", env) == "a$b v v "
    assert interpolate("${EMPTY:-d} ${EMPTY-d} ${UNSET-d} ${SET:-d}", env) == "d  d v"
    assert interpolate("${SET:+alt} ${EMPTY:+alt} ${EMPTY+alt}", env) == "alt  alt"
    assert interpolate("${EMPTY?m}", env) == ""
    with pytest.raises(MissingVariable, match=r"EMPTY.*set it"):
        interpolate("${EMPTY:?set it}", env)
    with pytest.raises(MissingVariable, match="UNSET"):
        interpolate("${UNSET?}", env)


def test_every_secret_is_required_and_none_has_a_default() -> None:
    text = COMPOSE_FILE.read_text()
    must = {"ADSTREAM_SERVING__ADMIN_TOKEN", "ADSTREAM_DELTA_SIGNING_KEY", "ADSTREAM_EVENT_SIGNING_KEY",
            "ADSTREAM_REDIS__PASSWORD", "RAY_AUTH_TOKEN", "GRAFANA_ADMIN_PASSWORD"}  # fmt: skip
    assert must <= set(REQUIRED)
    secretish = re.compile(r"TOKEN|PASSWORD|KEY|SECRET")
    for name, op in re.findall(r"\$\{(\w+)(:?[-?+])?", text):
        if secretish.search(name):
            assert op == ":?", f"${{{name}}} must be required (:?), not {op or 'optional'}"
    for missing in REQUIRED:
        env = {k: v for k, v in SECRETS.items() if k != missing}
        with pytest.raises(MissingVariable, match=missing):
            load_compose(env)


def test_published_ports_bind_loopback_unless_asked(compose: dict[str, Any]) -> None:
    for name, svc in compose.items():
        for host, _, _ in published_binds(svc):
            assert host == "127.0.0.1", f"{name} publishes on {host or 'every address'}"
    public = load_compose(SECRETS | {"PUBLISH_HOST": "0.0.0.0"})
    opened = {(n, c) for n, s in public.items() for h, _, c in published_binds(s) if h == "0.0.0.0"}
    assert opened == {("ray-head", "8000"), ("dashboard", "8050"), ("grafana", "3000")}  # never Ray's API


def _cli_commands(argv: list[str]) -> list[str]:
    """`adstream a b --opt` → the command path ['a', 'b'] (options and values dropped)."""
    import typer.main

    from deploy.cli import app

    node: Any = typer.main.get_command(app)
    path = []
    for arg in argv[1:]:
        sub = getattr(node, "commands", {}).get(arg)
        if sub is None:
            break
        path.append(arg)
        node = sub
    return path


def _all_commands(compose: dict[str, Any], rendered: list[dict[str, Any]]) -> set[tuple[str, ...]]:
    lines = [s.command for s in compose.values() if s.ours]
    lines += [
        s.healthcheck["test"][1:]
        for s in compose.values()
        if s.healthcheck and s.healthcheck["test"][0] == "CMD"
    ]
    for c in containers(rendered):
        lines.append(c.command)
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            if "exec" in c.spec.get(probe, {}):
                lines.append(c.spec[probe]["exec"]["command"])
    return {tuple(_cli_commands(argv)) for argv in lines if argv and argv[0] == "adstream"}


def test_every_adstream_command_in_the_files_answers_help(
    compose: dict[str, Any], rendered: list[dict[str, Any]]
) -> None:
    from deploy.cli import app

    commands = _all_commands(compose, rendered)
    assert {("init",), ("serve",), ("worker",), ("trainer",), ("probe",), ("schedule",),
            ("attribution", "rollup"), ("attribution",), ("dashboard",), ("status",)} <= commands  # fmt: skip
    runner = CliRunner()
    for path in sorted(commands):
        out = runner.invoke(app, [*path, "--help"])
        assert out.exit_code == 0 and "Usage" in out.output, (path, out.output)
    assert runner.invoke(app, ["nope", "--help"]).exit_code != 0  # the check can fail


def test_scheduled_rollups_and_attribution_use_existing_commands(
    compose: dict[str, Any], rendered: list[dict[str, Any]]
) -> None:
    from deploy.cli_ops import parse_job

    cmd = compose["scheduler"].command
    jobs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--job"]
    parsed = {tuple(argv[:2]): every for every, argv in map(parse_job, jobs)}
    assert parsed == {("attribution", "rollup"): 3600.0, ("attribution", "--by"): 86400.0}
    crons = {d["metadata"]["name"]: d for d in rendered if d["kind"] == "CronJob"}
    assert set(crons) == {"adstream-rollup", "adstream-attribution"}
    for cron in crons.values():
        assert cron["spec"]["concurrencyPolicy"] == "Forbid"


def _code_metric_names() -> set[str]:
    names = set()
    for room in ("streams", "trainers", "serving"):
        for path in (ROOT / room).rglob("*.py"):
            names |= set(re.findall(r"\"(adstream_[a-z_]+)\"", path.read_text()))
    return names


def test_operations_dashboard_uses_metric_names_the_code_exports() -> None:
    import json

    doc = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "adstream-operations.json").read_text())
    exported = _code_metric_names()
    used = set()
    for panel in doc["panels"]:
        assert panel["datasource"]["uid"] == "adstream-prometheus"
        for target in panel["targets"]:
            for name in re.findall(r"\b(adstream_[a-z_]+)", target["expr"]):
                used.add(re.sub(r"_(bucket|sum|count)$", "", name))
    assert used - exported == set(), f"not exported by the code: {used - exported}"
    titles = " ".join(p["title"].lower() for p in doc["panels"])
    for topic in (
        "lag per group",
        "p50 / p99 per stage",
        "shed per qos class",
        "adapter staleness",
        "guard resets",
    ):
        assert topic in titles, topic
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert ds["datasources"][0]["uid"] == "adstream-prometheus"


def test_prometheus_scrapes_every_process_on_its_own_port(compose: dict[str, Any]) -> None:
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}

    def covered(job: str) -> set[tuple[str, int]]:
        return {(n, sd["port"]) for sd in jobs[job].get("dns_sd_configs", []) for n in sd["names"]}

    assert ("streams", int(compose["streams"].environment["ADSTREAM_METRICS__PORT"])) in covered("streams")
    trainer_port = int(compose["trainer"].command[compose["trainer"].command.index("--metrics-port") + 1])
    assert {("trainer", trainer_port), ("trainer-gpu", trainer_port)} <= covered("trainer")
    env = compose["ray-head"].environment
    lo, hi = (
        int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]),
        int(env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]),
    )
    nodes = [n for n, s in compose.items() if s.command[:2] == ["ray", "start"]]
    assert {(n, p) for n in nodes for p in range(lo, hi + 1)} == covered("serving")  # every replica port
    for node in nodes:
        assert "--metrics-export-port=8080" in compose[node].command, node
        assert (node, 8080) in covered("ray")
    mounts = compose["prometheus"].raw["volumes"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts


def test_liveness_is_on_progress(compose: dict[str, Any], rendered: list[dict[str, Any]]) -> None:
    for name in ("streams", "trainer", "trainer-gpu"):
        test = compose[name].healthcheck["test"]
        assert test[1:4] == ["adstream", "probe", name.split("-")[0]], (name, test)
    by_name = {c.workload: c for c in containers(rendered)}
    for workload, role in (
        ("Deployment/adstream-streams", "streams"),
        ("Deployment/adstream-trainer", "trainer"),
    ):
        live = by_name[workload].spec["livenessProbe"]
        assert live["exec"]["command"][:3] == ["adstream", "probe", role], workload
    # the trainer waits for the model before its port opens: startup allows the whole wait
    startup = by_name["Deployment/adstream-trainer"].spec["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900


def test_k8s_needs_the_operators_secrets(tmp_path: Path, rendered: list[dict[str, Any]]) -> None:
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S_DIR, k8s, ignore=shutil.ignore_patterns("secrets.env"))
    for use_kubectl in (True, False):
        with pytest.raises(ConfigError, match=r"secrets\.env"):
            render_kustomize(k8s, use_kubectl=use_kubectl)
    (secret,) = [d for d in rendered if d["kind"] == "Secret"]
    assert secret["metadata"]["name"] == "adstream-secrets"
    assert not (K8S_DIR / "secret.yaml").exists()  # no placeholder Secret to apply by mistake


def test_own_renderer_matches_kubectl_kustomize(tmp_path: Path, rendered: list[dict[str, Any]]) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: nothing to compare the renderer with")
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S_DIR, k8s, ignore=shutil.ignore_patterns("secrets.env"))
    shutil.copy(K8S_DIR / "secrets.env.example", k8s / "secrets.env")
    theirs = render_kustomize(k8s, use_kubectl=True)
    ours = render_kustomize(k8s, use_kubectl=False)
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, theirs)) == sorted(map(key, ours))
    assert {key(d): d for d in theirs} == {key(d): d for d in ours}


def test_init_job_and_rayservice_start_the_loop_from_nothing(rendered: list[dict[str, Any]]) -> None:
    by_name = {c.workload: c for c in containers(rendered)}
    init = by_name["Job/adstream-init"]
    assert init.command == ["adstream", "init"]
    assert {m["mountPath"] for m in init.spec["volumeMounts"]} == {"/var/lib/adstream/models"}
    (ray,) = [d for d in rendered if d["kind"] == "RayService"]
    spec = ray["spec"]
    assert "deploymentUnhealthySecondThreshold" not in spec and "serviceUnhealthySecondThreshold" not in spec
    assert spec["upgradeStrategy"] == {"type": "NewCluster"}
    (app,) = yaml.safe_load(spec["serveConfigV2"])["applications"]
    assert app["args"]["wait_for_model_s"] >= 300
