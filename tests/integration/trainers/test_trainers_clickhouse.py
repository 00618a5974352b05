"""`adstream train --clickhouse`: events written by the streams sink are read back and trained on."""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from schemas.settings import Settings
from workloads import Market, MarketConfig

pytestmark = [pytest.mark.clickhouse, pytest.mark.timeout(180)]


def test_read_back_and_train(stack: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from attribution.migrate import migrate
    from schemas.clients import clickhouse_client
    from streams.sink import ClickHouseSink, empty_rows, row_of
    from trainers.clickhouse_source import read_events

    base, db = stack.clickhouse.url.rsplit("/", 1)
    s = stack.model_copy(
        update={
            "clickhouse": stack.clickhouse.model_copy(update={"url": f"{base}/{db}_{uuid.uuid4().hex[:6]}"})
        }
    )
    migrate(s)
    events = list(
        Market(MarketConfig(seed=9, n_users=50, n_ads=30, drift_at=None, new_ads_at=None)).open_loop(3000)
    )
    rows = empty_rows()
    for i, e in enumerate(events):
        table, row = row_of(e, 0, i)
        rows[table].append(row)
    sink = ClickHouseSink(s)
    try:
        asyncio.run(sink.write(rows))
        asyncio.run(sink.write(rows))  # a replayed batch: FINAL collapses it
    finally:
        sink.close()
    try:
        back = read_events(s.clickhouse.url)
        assert Counter(m.kind for m in back) == Counter(m.kind for m in events)
        assert all(a.ts <= b.ts for a, b in itertools.pairwise(back))
        original = {e.event_id: e for e in events}
        for m in back:
            o = original[m.event_id]
            assert m.model_dump(exclude={"ts"}) == o.model_dump(exclude={"ts"})
            assert abs((m.ts - o.ts).total_seconds()) < 0.001

        from deploy.cli import app

        monkeypatch.setenv("ADSTREAM_CLICKHOUSE__URL", s.clickhouse.url)
        monkeypatch.setenv("ADSTREAM_MODEL_DIR", str(tmp_path / "models"))
        out = tmp_path / "r.json"
        res = CliRunner().invoke(
            app,
            [
                "train",
                "--clickhouse",
                "--epochs",
                "1",
                "--no-two-tower",
                "--threads",
                "1",
                "--json",
                str(out),
            ],
        )
        assert res.exit_code == 0, res.output
        assert json.loads(out.read_text())["examples"] == 3000
    finally:
        client = clickhouse_client(s)
        client.execute(f"DROP DATABASE IF EXISTS {s.clickhouse.url.rsplit('/', 1)[1]}")
        client.disconnect()
