"""`adstream produce` against the real broker: valid lines arrive keyed per contract, bad ones don't."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from schemas import topics
from schemas.codec import decode
from schemas.events import Click, Impression
from schemas.settings import Settings
from schemas.signing import check_event, event_key

pytestmark = [pytest.mark.kafka]

ADSTREAM = [sys.executable, "-m", "deploy.cli"]


def env_for(settings: Settings) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        ADSTREAM_KAFKA__BOOTSTRAP=settings.kafka.bootstrap,
        ADSTREAM_TOPIC_PREFIX=settings.topic_prefix,
        ADSTREAM_STATE_DIR=str(settings.state_dir),  # the stack's event key
    )
    return env


def click(i: int) -> dict[str, object]:
    return {
        "event_id": f"c{i}",
        "ts": f"2026-11-29T12:00:{i % 60:02d}+00:00",
        "user_id": f"user-{i % 3}",
        "impression_id": f"imp{i}",
        "ad_id": f"ad{i}",
        "campaign_id": "camp1",
    }


async def read_back(settings: Settings, topic: str, expected: int) -> list[tuple[bytes, dict[str, object]]]:
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        topics.topic_name(topic, settings.topic_prefix),
        bootstrap_servers=settings.kafka.bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    got: list[tuple[bytes, dict[str, object]]] = []
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while len(got) < expected and asyncio.get_running_loop().time() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                got.extend((r.key, json.loads(r.value)) for r in records)
        # anything beyond the expected count would be a bug too: give it a moment to show up
        extra = await consumer.getmany(timeout_ms=1000)
        for records in extra.values():
            got.extend((r.key, json.loads(r.value)) for r in records)
    finally:
        await consumer.stop()
    return got


def test_produce_sends_valid_lines_and_reports_invalid(stack: Settings, tmp_path: Path) -> None:
    lines = [json.dumps(click(i)) for i in range(20)]
    lines.insert(3, '{"event_id": "broken"')  # line 4: not JSON
    lines.insert(8, json.dumps({**click(99), "surprise": True}))  # line 9: unknown field
    lines.insert(12, "")  # blank lines are skipped, not errors
    lines.insert(15, json.dumps({**click(98), "ts": "2026-11-29T12:00:00"}))  # line 16: naive timestamp
    path = tmp_path / "clicks.jsonl"
    path.write_text("\n".join(lines) + "\n")

    proc = subprocess.run(
        [*ADSTREAM, "produce", "ad.clicks", str(path)],
        env=env_for(stack),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert "20 sent, 3 invalid, 1 blank" in proc.stdout
    assert "line 4:" in proc.stderr
    assert "line 9: field 'surprise'" in proc.stderr
    assert "line 16: field 'ts'" in proc.stderr

    got = asyncio.run(read_back(stack, topics.CLICKS, 20))
    assert sorted(v["event_id"] for _, v in got) == sorted(f"c{i}" for i in range(20))
    for key, value in got:
        assert key == str(value["user_id"]).encode()
        # the operator's tool gives each click its token, as serving gave the ad (M10.b)
        assert check_event(decode(Click, json.dumps(value)), event_key(stack)) is None


def test_produce_signs_impressions_unless_told_not_to(stack: Settings) -> None:
    import uuid

    base = {"ts": "2026-11-29T12:00:00Z", "ad_id": "ad1", "campaign_id": "c1", "advertiser_id": "v1"}
    lines = [
        json.dumps(
            {
                **base,
                "event_id": f"r{i}/0",
                "user_id": f"u{i}",
                "request_id": f"r{i}",
                "slot": "feed",
                "position": 0,
                "price": 0.25,
            }
        )
        for i in range(4)
    ]
    for sign, prefix in ((True, "signed"), (False, "unsigned")):
        s = stack.model_copy(update={"topic_prefix": f"{stack.topic_prefix}{prefix}{uuid.uuid4().hex[:4]}."})
        proc = subprocess.run(
            [*ADSTREAM, "produce", "ad.impressions", "-", *([] if sign else ["--no-sign"])],
            input="\n".join(lines),
            env=env_for(s),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        got = [decode(Impression, json.dumps(v)) for _, v in asyncio.run(read_back(s, topics.IMPRESSIONS, 4))]
        assert len(got) == 4
        if sign:
            assert all(check_event(imp, event_key(stack)) is None for imp in got)
        else:
            assert all(imp.sig is None for imp in got)


def test_produce_from_stdin_all_valid_exits_zero(stack: Settings) -> None:
    data = "\n".join(
        json.dumps(
            {
                "event_id": f"conv{i}",
                "ts": "2026-11-29T12:00:00Z",
                "user_id": "u-stdin",
                "campaign_id": "c",
                "advertiser_id": "v",
                "value": 9.5,
            }
        )
        for i in range(5)
    )
    proc = subprocess.run(
        [*ADSTREAM, "produce", "ad.conversions", "-"],
        input=data,
        env=env_for(stack),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "5 sent, 0 invalid" in proc.stdout
    got = asyncio.run(read_back(stack, topics.CONVERSIONS, 5))
    assert len(got) == 5


def test_produce_rejects_unknown_topic(stack: Settings) -> None:
    proc = subprocess.run(
        [*ADSTREAM, "produce", "ad.nope", "-"],
        input="{}",
        env=env_for(stack),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "not a contract topic" in proc.stderr
