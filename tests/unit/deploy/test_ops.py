"""`adstream init`'s waiters, `adstream probe`'s judgement and `adstream schedule`'s job parsing."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import typer

from deploy.bootstrap import ranker_checkpoint, wait_for_model
from deploy.cli_ops import judge, metric_sum, parse_job
from schemas.errors import ModelError
from schemas.settings import Settings


def _fake_checkpoint(model_dir: Path) -> None:
    from trainers.models.ranker import CONFIG_FILE

    (model_dir / "ranker").mkdir(parents=True)
    (model_dir / "ranker" / CONFIG_FILE).write_text("{}")


def test_wait_for_model_gives_up_with_a_clear_error_and_says_it_waits(tmp_path: Path) -> None:
    lines: list[str] = []
    with pytest.raises(ModelError, match="adstream init"):
        wait_for_model(Settings(model_dir=tmp_path), 0.3, lines.append, every_s=0.1)
    assert lines and "waiting for the base model" in lines[0]


def test_wait_for_model_returns_once_init_writes_the_checkpoint(tmp_path: Path) -> None:
    timer = threading.Timer(0.4, _fake_checkpoint, [tmp_path])
    timer.start()
    t0 = time.monotonic()
    found = wait_for_model(Settings(model_dir=tmp_path), 30, lambda _: None)
    assert found == tmp_path / "ranker" and time.monotonic() - t0 < 10
    assert ranker_checkpoint(tmp_path) == found


def test_metric_sum_adds_every_sample_and_knows_absent() -> None:
    text = (
        "# HELP adstream_streams_events_in_total Records consumed\n"
        'adstream_streams_events_in_total{topic="ad.clicks"} 3.0\n'
        'adstream_streams_events_in_total{topic="ad.impressions"} 10.0\n'
        'adstream_streams_events_in_created{topic="ad.clicks"} 1.7e9\n'
        "adstream_streams_lag_events 0\n"
    )
    assert metric_sum(text, ("adstream_streams_events_in_total",)) == 13.0
    assert metric_sum(text, ("adstream_streams_lag_events",)) == 0.0
    assert metric_sum(text, ("adstream_trainers_examples_total",)) is None


def test_probe_fails_only_a_consumer_that_stopped_with_work_waiting() -> None:
    alive, _, state = judge({}, 5, 100, now=0, stall_s=60)
    assert alive  # first look
    alive, why, state = judge(state, 5, 100, now=30, stall_s=60)
    assert alive and "30s" in why  # stalled, within the limit
    alive, why, _ = judge(state, 5, 100, now=61, stall_s=60)
    assert not alive and "no progress for 61s with 100 records pending" == why
    alive, _, state = judge(state, 6, 100, now=61, stall_s=60)
    assert alive and state == {"progress": 6, "since": 61}  # moved: the clock restarts
    alive, why, state = judge(state, 6, 0, now=500, stall_s=60)
    assert alive and why.startswith("idle")  # nothing to consume is not a hang


def test_schedule_jobs_parse_with_the_cli_and_refuse_typos() -> None:
    assert parse_job("1h=attribution rollup") == (3600.0, ["attribution", "rollup"])
    assert parse_job("1d=attribution --by campaign")[0] == 86400.0
    for bad, says in (
        ("1h=attribution rolup", "not an adstream command"),
        ("1h=nope", "not an adstream command"),
        ("1h=attribution rollup --sinc 3", "No such option"),
        ("1x=attribution rollup", "EVERY"),
        ("attribution rollup", "EVERY"),
    ):
        with pytest.raises(typer.BadParameter, match=says):
            parse_job(bad)
