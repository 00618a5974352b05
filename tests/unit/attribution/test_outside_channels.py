"""Outside touchpoints (`Touch`) in paths beside own impressions and clicks, every model, spend
import and the ROI table, on embedded ClickHouse (chDB) with hand-made journeys."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime

import numpy as np
import pytest

from attribution.migrate import apply_migrations
from attribution.models import MODELS, ModelConfig, attribute
from attribution.paths import Window, build_paths
from attribution.roi import channel_spend, plan_budget
from attribution.spend import SpendFileError, import_spend, parse_spend_csv
from attribution.sql import ChdbBackend
from schemas.events import Touch
from streams.sink import COLUMNS, row_of

T0 = 1_793_491_200  # 2026-11-01 00:00 UTC
DAY = 86400
IMP = ("event_id", "ts", "ts_ms", "user_id", "request_id", "ad_id", "campaign_id", "advertiser_id", "slot",
       "position", "price", "kafka_partition", "kafka_offset")  # fmt: skip
CLK = ("event_id", "ts", "ts_ms", "user_id", "impression_id", "ad_id", "campaign_id", "kafka_partition",
       "kafka_offset")  # fmt: skip
CNV = ("event_id", "ts", "ts_ms", "user_id", "campaign_id", "advertiser_id", "value", "kafka_partition",
       "kafka_offset")  # fmt: skip


def _touch(i: int, user: str, t: int, source: str, medium: str, campaign: str | None, interaction: str
           ) -> Touch:  # fmt: skip
    return Touch.model_validate({
        "event_id": f"t{i}", "ts": datetime.fromtimestamp(t, UTC), "user_id": user, "advertiser_id": "adv",
        "source": source, "medium": medium, "campaign": campaign, "interaction": interaction,
    })  # fmt: skip


@pytest.fixture(scope="module")
def backend() -> ChdbBackend:
    b = ChdbBackend(f"outside_{uuid.uuid4().hex[:6]}")
    apply_migrations(b)
    # u1: google cpc click, then our feed impression (a view) and its click, then a conversion
    # u2: a newsletter (email) view, then a conversion
    # u3: facebook social click only: a null journey; u4: our search view then a conversion
    b.insert("impressions", IMP, [
        ("i1", T0 + 100, (T0 + 100) * 1000, "u1", "r1", "ad1", "cmp1", "adv", "feed", 0, 0.5, 0, 1),
        ("i4", T0 + 100, (T0 + 100) * 1000, "u4", "r4", "ad1", "cmp1", "adv", "search", 0, 0.7, 0, 2),
    ])  # fmt: skip
    b.insert("clicks", CLK, [("c1", T0 + 150, (T0 + 150) * 1000, "u1", "i1", "ad1", "cmp1", 0, 1)])
    b.insert("conversions", CNV, [
        ("v1", T0 + 3600, (T0 + 3600) * 1000, "u1", "site", "adv", 40.0, 0, 1),
        ("v2", T0 + 3600, (T0 + 3600) * 1000, "u2", "site", "adv", 10.0, 0, 2),
        ("v4", T0 + 3600, (T0 + 3600) * 1000, "u4", "site", "adv", 20.0, 0, 3),
    ])  # fmt: skip
    touches = [
        _touch(1, "u1", T0 + 10, "google", "cpc", "brand", "click"),
        _touch(2, "u2", T0 + 20, "newsletter", "email", None, "view"),
        _touch(3, "u3", T0 + 30, "facebook", "social", "spring", "click"),
    ]
    # the rows exactly as the streams sink writes them
    table, cols = COLUMNS[Touch]
    rows = [row_of(t, 0, i)[1] for i, t in enumerate(touches)]
    b.insert(table, (*cols, "kafka_partition", "kafka_offset"), rows)
    return b


WINDOW = Window(click_s=7 * DAY, view_s=DAY, gap_s=DAY)


def test_paths_mix_outside_and_own_channels(backend: ChdbBackend) -> None:
    built = build_paths(backend, "campaign", T0, T0 + 3 * DAY, WINDOW)
    p = built.paths
    got = {}
    for i in range(p.n):
        sl = slice(p.offsets[i], p.offsets[i + 1])
        key = tuple((p.channels[c], int(k)) for c, k in zip(p.channel[sl], p.kind[sl], strict=True))
        got[key] = (p.conversions[i], p.nulls[i])
    assert got == {
        (("google/cpc/brand", 1), ("cmp1", 0), ("cmp1", 1)): (1.0, 0.0),
        (("newsletter/email", 0),): (1.0, 0.0),
        (("facebook/social/spring", 1),): (0.0, 1.0),
        (("cmp1", 0),): (1.0, 0.0),
    }
    # at slot granularity an outside channel is its source / medium
    slots = build_paths(backend, "slot", T0, T0 + 3 * DAY, WINDOW).paths.channels
    assert set(slots) == {"facebook/social", "feed", "google/cpc", "newsletter/email", "search"}
    # an outside view keeps the view lookback: with 60 s, the newsletter no longer counts (its
    # conversion is direct: no touchpoint)
    late = build_paths(backend, "campaign", T0, T0 + 3 * DAY, Window(click_s=7 * DAY, view_s=60, gap_s=DAY))
    lp = late.paths
    converting = {lp.channels[c] for c in lp.channel[lp.conversions[lp.path_of_touch] > 0]}
    assert "newsletter/email" not in converting and late.direct_conversions == 2.0


@pytest.mark.parametrize("model", list(MODELS))
def test_every_model_credits_outside_channels(backend: ChdbBackend, model: str) -> None:
    p = build_paths(backend, "campaign", T0, T0 + 3 * DAY, WINDOW).paths
    r = attribute(model, p, ModelConfig(markov_order=1, seed=1))
    assert r.conversions.sum() == pytest.approx(3.0)
    credit = dict(zip(r.channels, r.conversions.tolist(), strict=True))
    # the newsletter is the only touch of a converting journey: every model credits it
    assert credit["newsletter/email"] > 0
    assert set(r.channels) >= {"google/cpc/brand", "facebook/social/spring"}


def test_spend_import_feeds_the_roi_table_and_budget_moves(backend: ChdbBackend) -> None:
    text = (
        "date,advertiser_id,source,medium,campaign,spend\n"
        "2026-11-01,adv,google,cpc,brand,12.5\n"
        "2026-11-02,adv,google,cpc,brand,7.5\n"
        "2026-11-01,adv,newsletter,email,,3\n"
        "2026-11-05,adv,newsletter,email,,100\n"  # after the range: not counted
    )
    rows = parse_spend_csv(text)
    assert rows[2].campaign == "" and rows[0].day == date(2026, 11, 1)
    assert import_spend(backend, rows, version=1) == 4
    # importing a day again replaces it
    import_spend(backend, parse_spend_csv("date,advertiser_id,source,medium,campaign,spend\n"
                                          "2026-11-02,adv,google,cpc,brand,2.5\n"), version=2)  # fmt: skip
    spend = channel_spend(backend, "campaign", T0, T0 + 3 * DAY)
    assert spend == pytest.approx({"cmp1": 1.2, "google/cpc/brand": 15.0, "newsletter/email": 3.0})
    p = build_paths(backend, "campaign", T0, T0 + 3 * DAY, WINDOW).paths
    plan = plan_budget(attribute("linear", p), spend)
    rows_by = {c.channel: c for c in plan.channels}
    assert rows_by["google/cpc/brand"].spend == pytest.approx(15.0)
    assert np.isfinite(rows_by["newsletter/email"].roas)
    assert sum(c.recommended_spend for c in plan.channels) == pytest.approx(sum(spend.values()))


def test_a_bad_spend_file_names_every_bad_line_and_writes_nothing() -> None:
    text = (
        "date,advertiser_id,source,medium,campaign,spend\n"
        "2026-11-01,adv,google,cpc,brand,12.5\n"
        "2026-13-01,adv,google,cpc,brand,1\n"
        "2026-11-02,adv,,cpc,,1\n"
        "2026-11-02,adv,google,cpc,,-4\n"
        "2026-11-02,adv,google,cpc,,abc\n"
        "2026-11-01,adv,google,cpc,brand,2\n"
        "2026-11-03,adv,google\n"
    )
    with pytest.raises(SpendFileError) as exc:
        parse_spend_csv(text, "s.csv")
    msg = str(exc.value)
    assert msg.startswith("s.csv: 6 bad rows, nothing imported")
    for line in ("line 3: date '2026-13-01'", "line 4: source ''", "line 5: spend -4.0",
                 "line 6: spend 'abc'", "line 7: the same day and channel as line 2", "line 8:"):  # fmt: skip
        assert line in msg
    with pytest.raises(SpendFileError, match="line 1: header lacks spend"):
        parse_spend_csv("date,advertiser_id,source,medium,campaign\n")
    with pytest.raises(SpendFileError, match="no spend rows"):
        parse_spend_csv("date,advertiser_id,source,medium,campaign,spend\n")
