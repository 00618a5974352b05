"""`adstream train` and `adstream trainer --replay` end to end on a small simulated event file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from schemas import codec
from workloads import Market, MarketConfig

runner = CliRunner()


@pytest.fixture(scope="module")
def events_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sim") / "events.jsonl"
    market = Market(MarketConfig(seed=3, n_users=100, n_ads=40, drift_at=None, new_ads_at=None))
    with path.open("wb") as fh:
        for msg in market.open_loop(6000):
            fh.write(codec.encode(msg) + b"\n")
        fh.write(b'{"kind": "impression", "event_id": ""}\n')  # invalid: skipped and counted
    return path


def test_train_then_replay(events_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from deploy.cli import app

    monkeypatch.setenv("ADSTREAM_MODEL_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("ADSTREAM_ONLINE__MICRO_BATCH", "128")
    report = tmp_path / "train.json"
    res = runner.invoke(
        app,
        [
            "train",
            "--events",
            str(events_file),
            "--epochs",
            "2",
            "--no-two-tower",
            "--threads",
            "1",
            "--json",
            str(report),
        ],
    )
    assert res.exit_code == 0, res.output
    r = json.loads(report.read_text())
    assert r["examples"] == 6000 and r["holdout"] == 1200
    assert 0.5 < r["ranker"]["auc"] <= 1 and 0 < r["logistic_baseline"]["auc"] <= 1
    assert (tmp_path / "models" / "ranker" / "ranker.safetensors").exists()
    assert "1 invalid" in res.output

    out = tmp_path / "replay.json"
    res = runner.invoke(app, ["trainer", "--replay", str(events_file), "--json", str(out)])
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert rep["order"] == "impression" and rep["overall"]["n"] == 6000 and rep["invalid_lines"] == 1
    assert set(rep["adapters"]) <= {"feed", "search", "splash"}
    assert rep["overall"]["auc_online"] is not None and rep["overall"]["auc_base"] is not None
    assert sum(a["n"] for a in rep["adapters"].values()) == 6000


def test_train_needs_a_source() -> None:
    from deploy.cli import app

    res = runner.invoke(app, ["train"])
    assert res.exit_code != 0
