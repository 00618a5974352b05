"""Open Bandit Dataset replay: every row becomes an impression, every click a Click, in time order."""

from __future__ import annotations

import csv
import itertools
from collections import Counter

import pytest

from schemas.codec import decode_any, encode
from schemas.errors import ConfigError
from schemas.events import Click, Impression
from workloads.obd import CAMPAIGNS, POLICIES, obd_files, replay_obd


def _file_counts(policy: str, campaign: str) -> tuple[int, int, int]:
    log_csv, items_csv = obd_files(policy, campaign)
    with log_csv.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    with items_csv.open(newline="") as fh:
        items = sum(1 for _ in csv.DictReader(fh))
    return len(rows), sum(int(r["click"]) for r in rows), items


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("campaign", CAMPAIGNS)
def test_replay_reproduces_the_click_count_exactly(policy: str, campaign: str) -> None:
    n_rows, n_clicks, n_items = _file_counts(policy, campaign)
    msgs = list(replay_obd(policy, campaign))
    kinds = Counter(m.kind for m in msgs)
    assert kinds == {"ad": n_items, "impression": n_rows, "click": n_clicks}


def test_the_small_dataset_has_its_published_totals() -> None:
    totals = [_file_counts(p, c) for p in POLICIES for c in CAMPAIGNS]
    assert sum(t[0] for t in totals) == 60_000
    assert sum(t[1] for t in totals) == 287


def test_events_validate_keep_time_order_and_speedup_compresses_time() -> None:
    msgs = list(replay_obd("bts", "women"))
    fast = list(replay_obd("bts", "women", speedup=100.0))
    imps = [m for m in msgs if isinstance(m, Impression)]
    ts = [m.ts for m in msgs]
    assert all(a <= b for a, b in itertools.pairwise(ts))
    for m in msgs[:200] + msgs[-200:]:
        assert decode_any(encode(m)) == m
    assert {m.position for m in imps} == {0, 1, 2}
    span = imps[-1].ts - imps[0].ts
    fast_imps = [m for m in fast if isinstance(m, Impression)]
    assert abs((fast_imps[-1].ts - fast_imps[0].ts) - span / 100).total_seconds() < 1e-3
    ids = {m.event_id for m in imps}
    assert all(c.impression_id in ids for c in msgs if isinstance(c, Click))
    log_csv, _ = obd_files("bts", "women")
    with log_csv.open(newline="") as fh:
        first = next(csv.DictReader(fh))
    assert imps[0].ts.isoformat(sep=" ") == first["timestamp"]


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ConfigError, match="policy"):
        list(replay_obd("greedy", "all"))
    with pytest.raises(ConfigError, match="speedup"):
        list(replay_obd("random", "all", speedup=0))


def test_start_moves_the_replay_to_a_new_origin() -> None:
    from datetime import UTC, datetime

    origin = datetime(2030, 1, 1, tzinfo=UTC)
    msgs = list(replay_obd("random", "men", speedup=2.0, start=origin))
    imps = [m for m in msgs if isinstance(m, Impression)]
    orig = [m for m in replay_obd("random", "men") if isinstance(m, Impression)]
    assert imps[0].ts == origin and msgs[0].ts == origin
    assert imps[-1].ts - imps[0].ts == (orig[-1].ts - orig[0].ts) / 2
    with pytest.raises(ConfigError, match="start"):
        list(replay_obd("random", "men", start=datetime(2030, 1, 1)))
