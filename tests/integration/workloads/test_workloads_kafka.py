"""`adstream simulate --kafka` and `replay obd --kafka` against the real broker, read back with aiokafka."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deploy.cli import app
from deploy.stack import create_topics, delete_topics_async
from schemas.codec import decode_any, key_of, topic_of
from schemas.settings import Settings
from schemas.topics import topic_name

pytestmark = pytest.mark.kafka
runner = CliRunner()
BASES = ("ad.catalog", "ad.campaigns", "ad.impressions", "ad.clicks", "ad.dwell", "ad.conversions")


async def _read_back(
    settings: Settings, expected: int, timeout_s: float = 60.0
) -> list[tuple[str, bytes, bytes]]:
    from aiokafka import AIOKafkaConsumer

    names = [topic_name(b, settings.topic_prefix) for b in BASES]
    consumer = AIOKafkaConsumer(
        *names, bootstrap_servers=settings.kafka.bootstrap, auto_offset_reset="earliest",
        enable_auto_commit=False, group_id=None,
    )  # fmt: skip
    await consumer.start()
    got: list[tuple[str, bytes, bytes]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < expected and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=500, max_records=10_000)
            for tp, records in batches.items():
                got.extend((tp.topic[len(settings.topic_prefix) :], r.key, r.value) for r in records)
        await asyncio.sleep(1.0)  # anything beyond the expected count would show up now
        for tp, records in (await consumer.getmany(timeout_ms=500)).items():
            got.extend((tp.topic[len(settings.topic_prefix) :], r.key, r.value) for r in records)
    finally:
        await consumer.stop()
    return got


@pytest.fixture
def own_topics(stack: Settings) -> Iterator[Settings]:
    """Settings with a prefix of this test's own, its contract topics created and dropped after."""
    settings = stack.model_copy(update={"topic_prefix": f"{stack.topic_prefix}w{uuid.uuid4().hex[:6]}."})
    create_topics(settings)
    yield settings
    asyncio.run(delete_topics_async(settings))


def _env(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> None:
    monkeypatch.setenv("ADSTREAM_TOPIC_PREFIX", settings.topic_prefix)
    monkeypatch.setenv("ADSTREAM_KAFKA__BOOTSTRAP", settings.kafka.bootstrap)


# with CPM campaigns the stream starts with the campaign entries, which go to ad.campaigns
@pytest.mark.parametrize("extra", [[], ["--cpm-share", "0.5"]], ids=["cpc", "cpm"])
def test_simulate_to_kafka_delivers_exactly_the_file_stream(
    own_topics: Settings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, extra: list[str]
) -> None:
    settings = own_topics
    _env(monkeypatch, settings)
    args = ["simulate", "--users", "200", "--ads", "40", "--events", "5000", "--seed", "21", *extra]
    out = tmp_path / "sim.jsonl"
    assert runner.invoke(app, [*args, "--out", str(out)]).exit_code == 0
    result = runner.invoke(app, [*args, "--kafka", "--pace", "20000"])
    assert result.exit_code == 0, result.output
    expected = []
    for line in out.read_bytes().splitlines():
        msg = decode_any(line)
        expected.append((topic_of(msg), key_of(msg), line))
    got = asyncio.run(_read_back(settings, len(expected)))
    assert Counter(got) == Counter(expected)
    assert ("ad.campaigns" in {t for t, _, _ in got}) == bool(extra)
    # per user and topic the broker keeps the simulator's time order (one partition per key)
    by_key: dict[tuple[str, bytes], list[bytes]] = {}
    for topic, key, value in got:
        by_key.setdefault((topic, key), []).append(value)
    for (topic, key), values in by_key.items():
        want = [v for t, k, v in expected if (t, k) == (topic, key)]
        assert values == want


def test_replay_obd_to_kafka_keeps_every_click(own_topics: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = own_topics
    _env(monkeypatch, settings)
    result = runner.invoke(app, ["replay", "obd", "--policy", "random", "--campaign", "women", "--kafka"])
    assert result.exit_code == 0, result.output
    got = asyncio.run(_read_back(settings, 10_000 + 46 + 46))
    counts = Counter(t for t, _, _ in got)
    assert counts == {"ad.impressions": 10_000, "ad.clicks": 46, "ad.catalog": 46}
