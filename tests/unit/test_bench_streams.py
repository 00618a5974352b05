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
