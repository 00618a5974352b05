"""Installs that work everywhere (issue 36 item 5): the declared Python range, extras that keep
benchmark and test tools out of the runtime, the LICENSE, the image's torch build args; and, slow
(`make check-install`, in CI): a wheel whose `adstream bench` works without the source tree, and
the pinned dependencies resolving for each supported Python (needs the package index)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
SUPPORTED = ("3.11", "3.12", "3.13")
# what the runtime must not pull, directly or through its dependencies
TOOLS = {
    "pytest", "pytest-asyncio", "pytest-timeout", "hypothesis", "ruff", "mypy", "import-linter", "deptry",
    "playwright", "check-jsonschema", "kubernetes-validate", "schemathesis", "chdb", "vowpalwabbit", "river",
    "obp",
}  # fmt: skip


def _extras() -> dict[str, list[Requirement]]:
    return {k: [Requirement(r) for r in v] for k, v in PROJECT["optional-dependencies"].items()}


def _pins() -> dict[str, str]:
    """constraints.txt: canonical name → pinned version."""
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_license_is_the_apache_2_text_pyproject_names() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text
    assert len(text.split()) > 1500  # the full text, not a header


def test_python_range_is_3_11_to_3_13_and_the_classifiers_say_so() -> None:
    spec = SpecifierSet(PROJECT["requires-python"])
    assert [v for v in ("3.10", *SUPPORTED, "3.14") if f"{v}.0" in spec] == list(SUPPORTED)
    listed = [c.rsplit(" ", 1)[1] for c in PROJECT["classifiers"] if c.startswith("Programming Language")]
    assert listed == list(SUPPORTED)
    # the gates check the lowest supported version's syntax and types
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py311"
    assert PYPROJECT["tool"]["mypy"]["python_version"] == "3.11"


def test_extras_split_runtime_bench_test_lint_and_dev_is_all() -> None:
    extras = _extras()
    assert {"bench", "test", "lint", "chdb", "dev"} <= set(extras)
    (dev,) = extras["dev"]
    assert dev.name == "adstream" and dev.extras == set(extras) - {"dev"}  # [dev] is every other extra
    runtime = {canonicalize_name(Requirement(r).name) for r in PROJECT["dependencies"]}
    assert not runtime & TOOLS, runtime & TOOLS
    # every requirement is pinned in constraints.txt, so every install resolves the same set
    pins = _pins()
    every = [Requirement(r) for r in PROJECT["dependencies"]] + [
        r for k, rs in extras.items() for r in rs if r.name != "adstream"
    ]
    assert not [r.name for r in every if canonicalize_name(r.name) not in pins]
    for r in every:
        assert r.specifier.contains(pins[canonicalize_name(r.name)], prereleases=True), r


def _closure(names: list[Requirement]) -> set[str]:
    """Canonical names of the installed distributions `names` pull (markers evaluated here)."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(r, frozenset(r.extras)) for r in names]
    while todo:
        req, extras = todo.pop()
        if (canonicalize_name(req.name), extras) in seen:
            continue
        seen.add((canonicalize_name(req.name), extras))
        for raw in metadata.requires(req.name) or []:
            dep = Requirement(raw)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if dep.marker is None or any(dep.marker.evaluate(env) for env in envs):
                todo.append((dep, frozenset(dep.extras)))
    return {name for name, _ in seen}


def test_the_runtime_does_not_pull_benchmark_or_test_tools() -> None:
    """The runtime's whole dependency closure (the installed metadata), not only its list."""
    runtime = _closure([Requirement(r) for r in PROJECT["dependencies"]])
    assert "torch" in runtime and "ray" in runtime
    assert not runtime & TOOLS, sorted(runtime & TOOLS)


def test_make_install_installs_what_test_and_lint_need() -> None:
    install = (ROOT / "deploy" / "install.sh").read_text()
    assert re.search(r'pip" install -q -c constraints\.txt -e "\.\[dev\]"', install)
    dev = _closure([Requirement("adstream[dev]")]) if _installed("adstream") else set()
    lint = (ROOT / "Makefile").read_text().split("\nlint:", 1)[1].split("\n\n", 1)[0]
    tools = set(re.findall(r"\$\(BIN\)/([\w-]+)", lint))
    assert {"ruff", "lint-imports", "deptry", "mypy"} <= tools
    for tool in tools:
        assert (Path(sys.executable).parent / tool).exists(), f"make lint runs {tool}, not installed"
    if dev:
        assert TOOLS <= dev, sorted(TOOLS - dev)


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


# ------------------------------------------------------------------------------------------ the wheel


def _shipped_packages() -> list[str]:
    """Top-level packages of the wheel (pyproject's find include, less the globs)."""
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted({p.rstrip("*").split(".")[0] for p in include})


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A throwaway venv (no system site-packages) with the wheel built from a copy of the source.

    Only the project's own wheel is installed there; its dependencies are read from this venv's
    site-packages through a path entry (a .pth line adds a path without running that directory's
    .pth files, so this venv's editable adstream is not seen): what the test checks is that the
    wheel itself carries everything `adstream` needs, with no source tree anywhere on the path."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
    for package in _shipped_packages():
        shutil.copytree(ROOT / package, src / package, ignore=skip)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", str(src), "-w", str(tmp / "dist")],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp / "dist").glob("adstream-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([*pip, "--python", str(py), "install", "-q", "--no-deps", str(wheel)], check=True)
    purelib = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    deps = Path(str(metadata.distribution("typer").locate_file("")))  # this venv's site-packages
    (Path(purelib) / "_adstream_deps.pth").write_text(f"{deps}\n")
    shutil.rmtree(src)  # nothing of the source tree is left to find
    yield venv


def _in_venv(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([*args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_the_wheel_ships_every_package_the_license_and_no_results(installed: Path) -> None:
    py = str(installed / "bin" / "python")
    code = (
        "import importlib.metadata as m, json; d = m.distribution('adstream'); "
        "print(json.dumps([str(f) for f in d.files]))"
    )
    res = _in_venv(installed, py, "-c", code, cwd=installed)
    assert res.returncode == 0, res.stderr
    files = json.loads(res.stdout)
    tops = {f.split("/")[0] for f in files if f.endswith(".py")}
    assert set(_shipped_packages()) <= tops, set(_shipped_packages()) - tops
    assert "benchmarks/serve_load.lua" in files  # benchmarks/serve.py's wrk script
    assert any(f.endswith(".dist-info/licenses/LICENSE") for f in files)
    assert not [f for f in files if f.startswith("benchmarks/results")]


@pytest.mark.slow
def test_adstream_bench_works_from_the_installed_wheel(installed: Path, tmp_path: Path) -> None:
    adstream = str(installed / "bin" / "adstream")
    code = "import deploy, benchmarks; print(deploy.__file__, benchmarks.__file__)"
    where = _in_venv(installed, str(installed / "bin" / "python"), "-c", code, cwd=tmp_path)
    assert where.returncode == 0 and str(ROOT) not in where.stdout, where
    listing = _in_venv(installed, adstream, "bench", "--help", cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    for name in ("all", "table", "freshness", "serve", "recall"):
        assert re.search(rf"│ {name}\s", listing.stdout), name
    # one benchmark's own flags through the CLI: the installed package's module runs
    flags = _in_venv(installed, adstream, "bench", "recall", "--help", cwd=tmp_path)
    assert flags.returncode == 0 and "--ads" in flags.stdout, flags.stderr[-2000:]
    # installed there are no committed results: `bench table` says so (exit 2), no traceback
    table = _in_venv(installed, adstream, "bench", "table", cwd=tmp_path)
    assert table.returncode == 2 and "source checkout" in table.stderr and "Traceback" not in table.stderr
    assert not (tmp_path / "bench-results").exists()  # --help wrote nothing


# ------------------------------------------------------------------------------------------ the image


def _dockerfile(build_args: dict[str, str]) -> dict[str, Any]:
    """The Dockerfile's instructions with the build args substituted: {"args", "from", "runs",
    "copies"} (continuation lines joined; ${X} and ${X:+word} of the args expanded as sh would)."""
    text = (ROOT / "Dockerfile").read_text()
    lines = re.sub(r"\\\n", " ", "\n".join(x for x in text.splitlines() if not x.lstrip().startswith("#")))
    args: dict[str, str] = {}
    out: dict[str, Any] = {"runs": [], "copies": []}

    def expand(s: str) -> str:
        s = re.sub(r"\$\{(\w+):\+([^}]*)\}", lambda m: expand(m[2]) if args.get(m[1]) else "", s)
        s = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], m[0]), s)
        return re.sub(r"\$(\w+)", lambda m: args.get(m[1], m[0]), s)

    for line in lines.splitlines():
        if not line.strip():
            continue
        op, _, rest = line.strip().partition(" ")
        if op == "ARG":
            name, _, default = rest.partition("=")
            args[name] = build_args.get(name, default.strip('"'))
        elif op == "FROM":
            out["from"] = expand(rest)
        elif op == "RUN":
            out["runs"].append(expand(rest))
        elif op == "COPY":
            out["copies"].append(rest.split())
    assert set(build_args) <= set(args), f"no ARG {set(build_args) - set(args)}"
    out["args"] = args
    return out


@pytest.mark.parametrize(
    ("build_args", "variant"),
    [
        ({}, "cpu"),
        ({"TORCH_VARIANT": "cu128"}, "cu128"),
        ({"TORCH_VARIANT": "cu126", "EXTRAS": "bench"}, "cu126"),
    ],
)
def test_the_image_installs_cpu_torch_by_default_and_cuda_by_build_arg(
    build_args: dict[str, str], variant: str
) -> None:
    image = _dockerfile(build_args)
    version = next(r.specifier for r in map(Requirement, PROJECT["dependencies"]) if r.name == "torch")
    assert str(version) == f"=={image['args']['TORCH_VERSION']}"
    torch = [r for r in image["runs"] if "torch==" in r and "--index-url" in r]
    assert len(torch) == 1, torch
    assert f'--index-url "https://download.pytorch.org/whl/{variant}"' in torch[0]
    assert f'"torch=={image["args"]["TORCH_VERSION"]}"' in torch[0]
    # the project's install keeps that torch (its pin dropped from the constraints), and the last
    # step checks the build it ended with
    deps = next(r for r in image["runs"] if "-c /tmp/constraints.txt" in r)
    assert "grep -v '^torch=='" in deps and image["runs"].index(deps) > image["runs"].index(torch[0])
    extras = build_args.get("EXTRAS")
    assert f'".{f"[{extras}]" if extras else ""}"' in deps
    assert f"torch.__version__ == '{image['args']['TORCH_VERSION']}+{variant}'" in image["runs"][-1]
    assert "adstream bench --help" in image["runs"][-1]
    # the image's Python is one the project supports
    py = re.match(r"python:(\d+\.\d+)\.\d+-slim", image["from"])
    assert py and f"{py[1]}.0" in SpecifierSet(PROJECT["requires-python"]), image["from"]


def test_the_image_gets_every_shipped_package_and_the_license() -> None:
    image = _dockerfile({})
    copied = [c[0] for c in image["copies"]]
    for package in _shipped_packages():
        assert ["COPY", package, package][1:] in [c for c in image["copies"] if len(c) == 2], package
    first = next(c for c in image["copies"] if "pyproject.toml" in c)
    assert "LICENSE" in first and copied.index(first[0]) < min(copied.index(p) for p in _shipped_packages())
    stubs = next(r for r in image["runs"] if "touch $p/__init__.py" in r)
    assert set(re.search(r'PKGS="([^"]+)"', stubs)[1].split()) == set(_shipped_packages())  # type: ignore[index]
    ignored = [x for x in (ROOT / ".dockerignore").read_text().splitlines() if not x.startswith("#")]
    assert not set(_shipped_packages()) & set(ignored) and "benchmarks/results" in ignored
    extras = set(PROJECT["optional-dependencies"])
    assert {"bench", "chdb"} <= extras  # the EXTRAS build arg's documented values


# ----------------------------------------------------------------- resolution per Python version


def _index_reachable(url: str = "https://pypi.org/simple/pip/") -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10):
            return True
    except OSError:
        return False


def _resolve(
    version: str, requirements: Path, constraints: list[Path], report: Path
) -> subprocess.CompletedProcess[str]:
    """pip's resolver for CPython `version` on manylinux x86_64, binary wheels only, nothing
    installed (a dry run into an empty target)."""
    platforms = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"]
    platforms += [f"manylinux_2_{minor}_x86_64" for minor in range(5, 29)]
    cmd = [
        sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
        "--report", str(report), "--python-version", version, "--only-binary=:all:",
        *[a for p in platforms for a in ("--platform", p)],
        "--target", str(report.with_suffix(".target")), "-r", str(requirements),
        *[a for c in constraints for a in ("-c", str(c))],
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_pinned_dependencies_resolve_for_every_supported_python(tmp_path: Path) -> None:
    """Runtime and every extra, at constraints.txt's pins, for CPython 3.11, 3.12 and 3.13 on
    manylinux x86_64 (wheels only). torch comes from one source for every version: the package
    index's own 2.13.0 (`===` keeps out a local `+cpu` build such as this machine's, which exists
    for 3.11 only); download.pytorch.org's CPU builds of 2.13.0 cover the same versions.

    Needs the package index (pip downloads wheels whose metadata the index does not serve); without
    it the test skips, unless ADSTREAM_REQUIRE_INDEX=1 (`make check-install`, in CI) makes it fail."""
    if not _index_reachable():
        if os.environ.get("ADSTREAM_REQUIRE_INDEX") == "1":
            pytest.fail("the package index (pypi.org) is unreachable; ADSTREAM_REQUIRE_INDEX=1")
        pytest.skip("needs the package index (pypi.org)")
    reqs = list(PROJECT["dependencies"]) + [
        r for rs in PROJECT["optional-dependencies"].values() for r in rs if not r.startswith("adstream")
    ]
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("\n".join(dict.fromkeys(reqs)) + "\n")
    torch = tmp_path / "torch.txt"
    torch.write_text(f"torch==={_pins()['torch']}\n")
    with ThreadPoolExecutor(len(SUPPORTED)) as pool:
        runs = dict(zip(SUPPORTED, pool.map(
            lambda v: _resolve(v, requirements, [ROOT / "constraints.txt", torch], tmp_path / f"{v}.json"),
            SUPPORTED,
        ), strict=True))  # fmt: skip
    pins = _pins()
    for version, run in runs.items():
        assert run.returncode == 0, f"Python {version}: {run.stderr[-3000:]}"
        got: dict[str, str] = {
            canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
            for i in json.loads((tmp_path / f"{version}.json").read_text())["install"]
        }
        assert got["torch"] == pins["torch"], (version, got["torch"])
        for name in {canonicalize_name(Requirement(r).name) for r in reqs}:
            assert got[name] == pins[name], (version, name, got[name], pins[name])


def test_installed_bench_writes_under_bench_results_and_passes_out_only_where_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`adstream bench` from an installed package (no committed results to keep): a run writes its
    JSON under $ADSTREAM_BENCH_RESULTS; a benchmark without `--out` is not handed one."""
    from deploy import cli_bench

    bench = tmp_path / "site" / "benchmarks"
    bench.mkdir(parents=True)
    (bench / "__init__.py").write_text("")
    (bench / "takes_out.py").write_text(
        "import argparse, json, pathlib\n"
        'ap = argparse.ArgumentParser(); ap.add_argument("--out", type=pathlib.Path, required=True)\n'
        "a = ap.parse_args(); a.out.write_text(json.dumps({'p99_s': 0.25}))\n"
    )
    (bench / "plain.py").write_text("import sys\nassert sys.argv[1:] == [], sys.argv\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(cli_bench, "BENCH_DIR", bench)
    monkeypatch.setattr(cli_bench, "checkout", lambda: False)
    monkeypatch.setenv("ADSTREAM_BENCH_RESULTS", str(work / "out"))
    row = cli_bench.run_one("takes_out", [], quick=False)
    assert row["status"] == "ok" and row["headline"] == "p99_s=0.25", row
    assert row["results"] == ["out/takes_out.json"] and (work / "out" / "takes_out.json").exists()
    plain = cli_bench.run_one("plain", [], quick=False)
    assert plain["status"] == "ok" and plain["results"] == [], plain
    assert not list(bench.rglob("*.json"))  # nothing written into the installed package
