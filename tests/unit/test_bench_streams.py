"""The streams benchmark's input: what it produces is what the worker it starts accepts."""

from __future__ import annotations

from pathlib import Path

from schemas.codec import decode, model_for_topic
from schemas.settings import Settings
from schemas.signing import check_event, event_key
from tests.support.benchmarks import load_benchmark


def test_generated_events_are_signed_with_the_key_of_the_workers_state_dir(tmp_path: Path) -> None:
    # the worker runs with the benchmark's own state dir: the events must carry its key, not the
    # key of the default state dir (every impression and click was dead-lettered as forged)
    bench = load_benchmark("streams")
    s = Settings(state_dir=tmp_path / "bench")
    _, events = bench.generate(300, 3, s)
    key = event_key(s)
    for topic, _, value in events:
        assert check_event(decode(model_for_topic(topic), value), key) is None


def test_rounds_report_the_median_rate_and_keep_every_round() -> None:
    bench = load_benchmark("streams")

    def run(rate: float, dead: int = 0) -> dict[str, object]:
        return {"events_per_s": rate, "cpu_us_per_event": 1e6 / rate, "worker_cpu_share": 0.9,
                "machine_busy_share": 0.6, "dead_letters": dead, "profile": {"first": rate}}  # fmt: skip

    row = bench.combine_rounds([run(9000.0), run(7000.0, dead=1), run(8000.0)])
    assert row["events_per_s"] == 8000.0
    assert row["rounds_events_per_s"] == [9000.0, 7000.0, 8000.0]
    assert row["dead_letters"] == 1  # any round's dead letters show
    assert row["profile"] == {"first": 9000.0}  # py-spy samples the first round
    assert bench.combine_rounds([run(5000.0)])["rounds_events_per_s"] == [5000.0]


def test_process_cpu_counts_this_process() -> None:
    import os
    import time

    bench = load_benchmark("streams")
    before = bench.process_cpu_s(os.getpid())
    end = time.process_time() + 0.3
    while time.process_time() < end:  # burn 0.3 s of CPU
        pass
    assert bench.process_cpu_s(os.getpid()) - before >= 0.2
    busy, total = bench.machine_cpu()
    assert 0 < busy <= total


def test_rounds_must_be_at_least_one() -> None:
    import argparse

    import pytest

    bench = load_benchmark("streams")
    assert bench.positive_int("3") == 3
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.positive_int(bad)


def test_core_floor_runs_the_worker_core_over_every_record_and_refuses_what_it_refuses(
    tmp_path: Path,
) -> None:
    """The in-process ceiling (`core_floor`) takes the same records as the engines: all valid, so
    all judged, applied and their examples encoded; a record the core refuses (forged) stops it,
    rather than being counted as work done."""
    import pytest

    bench = load_benchmark("streams")
    s = Settings(state_dir=tmp_path / "bench")
    catalog, events = bench.generate(400, 3, s)
    core = bench.core_floor(s, catalog, events)
    assert core["events"] == len(events) == 400
    assert core["examples"] >= 300  # every impression's fake negative at least (fn_weighted)
    assert core["events_per_s"] > 0 and set(core["stage_us_per_event"]) == {
        "judge", "state + join + examples", "row"
    }  # fmt: skip
    forged = [(t, k, v.replace(b'"sig":"', b'"sig":"0')) if t == "ad.impressions" else (t, k, v)
              for t, k, v in events]  # fmt: skip
    with pytest.raises(RuntimeError, match="refused a valid record"):
        bench.core_floor(s, catalog, forged)


def test_core_child_measures_the_same_records_in_a_fresh_process(tmp_path: Path) -> None:
    bench = load_benchmark("streams")
    s = Settings(state_dir=tmp_path / "bench")
    core = bench.core_child(s, 200, 3, tmp_path)
    assert core["events"] == 200 and core["examples"] >= 150 and core["events_per_s"] > 0


def test_too_few_events_for_a_rate_are_an_argparse_error(monkeypatch: object) -> None:
    """`--events 5000` with sink.batch_size 5000: the worker applied everything in one commit,
    the measured window held no events and the run died dividing by its rate of 0."""
    import sys

    import pytest

    bench = load_benchmark("streams")
    monkeypatch.setattr(sys, "argv", ["streams.py", "--events", "5000"])  # type: ignore[attr-defined]
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 2


def test_the_raw_floor_does_not_credit_the_first_batch_to_no_time() -> None:
    """The raw consumption floor started its clock when the first batch arrived but counted that
    batch (up to 10,000 records of a 100,000-record run): the floor read ~10 % high and every
    engine's ratio to it ~10 % low."""
    streams = load_benchmark("streams")
    r = streams.arrival_rate([(10.0, 10_000, 3_000_000), (10.5, 45_000, 0), (11.0, 45_000, 0)])
    assert r["events"] == 100_000 and r["seconds"] == 1.0
    assert r["events_per_s"] == 90_000.0  # not 100,000 records in 1.0 s
    assert r["mb_per_s"] == 0.0  # the first batch's bytes are outside the window too
    assert streams.arrival_rate([(1.0, 500, 10)])["events_per_s"] == 0.0  # one batch: no window


def test_two_workers_report_the_machine_rate_and_the_per_worker_ratio() -> None:
    """`--workers 2`: the machine-level rate of both workers, the per-worker rate and its ratio
    to raw, the speed-up over one worker of the same rounds, each worker's CPU share; the
    single-worker rows keep `engines.<name>.ratio_to_raw` and the core `core.ratio_to_raw`."""
    import argparse

    from rich.console import Console

    bench = load_benchmark("streams")

    def run(rate: float, **extra: object) -> dict[str, object]:
        return {"events_per_s": rate, "cpu_us_per_event": 1e6 / rate, "worker_cpu_share": 0.9,
                "seconds": 5.0, "events": 100_000, "machine_busy_share": 0.6, "dead_letters": 0,
                "profile": {}, **extra}  # fmt: skip

    two = {"workers": 2, "worker_cpu_shares": [0.8, 0.7]}
    m = bench.Measured(
        events=100_000,
        rounds={"aiokafka": [run(10_000.0), run(12_000.0)]},
        scaled={"aiokafka": [run(15_000.0, **two), run(21_000.0, **two)]},
        raws=[{"events_per_s": 200_000.0}],
        cores=[{"events_per_s": 20_000.0, "cpu_s": 5.0, "events": 100_000, "cpu_us_per_event": 50.0}],
    )
    sm = bench.summarize(m)
    row = sm.scale["aiokafka"]
    assert row["events_per_s"] == 18_000.0  # the median of the rounds
    assert row["per_worker_events_per_s"] == 9_000.0 and row["per_worker_ratio_to_raw"] == 0.045
    assert row["speedup_vs_one_worker"] == 1.636  # 18,000 / 11,000
    assert row["speedup_rounds"] == [1.5, 1.75] and row["worker_cpu_shares"] == [0.8, 0.7]
    args = argparse.Namespace(rounds=2)
    b = bench.Bench(args, ["aiokafka"], Settings(), "t", Path("."), Console())
    out = bench.result_json(b, m, sm, 0.5)
    assert out["engines"]["aiokafka"]["ratio_to_raw"] == 0.055
    assert out["core"]["ratio_to_raw"] == 0.1
    assert out["scale"]["aiokafka"]["per_worker_ratio_to_raw"] == 0.045
    bench.rates_table(m, sm)  # the table has the machine row
