"""The A/B rollup (005) and off-policy reads on ClickHouse 18.16 (the server) and chDB: same rows,
numbers equal to what the raw events say, a re-inserted batch counted once, and the CLI's
`adstream ab` / `adstream evaluate` with their errors (exit 2, the value named, no traceback)."""

from __future__ import annotations

import json
import math
import uuid
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlparse, urlunparse

import numpy as np
import pytest

from attribution import ab_rollups
from attribution.ab import ArmData, arm_metrics, compare
from attribution.migrate import apply_migrations, migrate
from attribution.ope_logs import evaluate, read_logged
from attribution.sql import Backend, ChdbBackend, DriverBackend
from schemas.clients import clickhouse_client
from schemas.holdout import HOLDOUT_AD_ID
from schemas.settings import Settings

pytestmark = [pytest.mark.clickhouse, pytest.mark.timeout(300)]

T0 = 1_800_000_000 - 1_800_000_000 % 3600  # an hour boundary
HOURS = 3
ARMS = ("learning", "correction", "control")
IMP_COLUMNS = (
    "event_id", "ts", "ts_ms", "user_id", "request_id", "ad_id", "campaign_id", "advertiser_id", "slot",
    "position", "price", "pctr", "model_version", "adapter_version", "kafka_partition", "kafka_offset",
    "ab_arm", "propensity", "explored",
)  # fmt: skip
CLICK_COLUMNS = (
    "event_id", "ts", "ts_ms", "user_id", "impression_id", "ad_id", "campaign_id", "kafka_partition",
    "kafka_offset",
)  # fmt: skip


def _dt(t: int) -> datetime:
    return datetime.fromtimestamp(t, UTC).replace(tzinfo=None)


def market(seed: int = 3, n_users: int = 240) -> dict[str, list[tuple[Any, ...]]]:
    """Raw rows: users in arms (every 8th user in none), requests of 1–3 positions over three
    hours, ε-greedy propensities, some holdout rows; no bid types, so every served ad's price is
    revenue (`schemas.billing`: an impression from before bid types costs its price when served)."""
    rng = np.random.default_rng(seed)
    imps: list[tuple[Any, ...]] = []
    clicks: list[tuple[Any, ...]] = []
    for u in range(n_users):
        arm = None if u % 8 == 7 else ARMS[u % 3]
        ctr = {"learning": 0.12, "correction": 0.10, "control": 0.08, None: 0.1}[arm]
        for r in range(int(rng.integers(1, 6))):
            t = T0 + int(rng.integers(0, HOURS * 3600))
            slot = ("feed", "search", "splash")[int(rng.integers(3))]
            holdout = rng.random() < 0.05
            for pos in range(int(rng.integers(1, 4))):
                eid = f"i{u}-{r}-{pos}"
                explored = bool(rng.random() < 0.2)
                p = 0.2 / 10 if explored else 0.8 + 0.2 / 10
                price = round(float(rng.uniform(0.1, 2.0)), 3)
                imps.append((
                    eid, _dt(t), t * 1000, f"u{u:04d}", f"r{u}-{r}", HOLDOUT_AD_ID if holdout else f"ad{pos}",
                    "c1", "a1", slot, pos, 0.0 if holdout else price, 0.1, "m", None, 0, 0, arm,
                    None if holdout else p, None if holdout else int(explored),
                ))  # fmt: skip
                if not holdout and rng.random() < ctr * (0.7 if explored else 1.0):
                    tc = t + int(
                        rng.integers(1, 900)
                    )  # may fall in the next hour: counted in the impression's
                    clicks.append((f"c{eid}", _dt(tc), tc * 1000, f"u{u:04d}", eid, f"ad{pos}", "c1", 0, 0))
    return {"impressions": imps, "clicks": clicks}


def expected_users(rows: dict[str, list[tuple[Any, ...]]]) -> dict[str, dict[str, list[float]]]:
    """Per arm and user (sorted by user id): requests, impressions, clicks, revenue, from raw rows."""
    clicked = {c[4] for c in rows["clicks"]}
    acc: dict[tuple[str, str], list[Any]] = defaultdict(lambda: [set(), 0, 0, 0.0])
    for row in rows["impressions"]:
        eid, user, request, ad, price, arm = row[0], row[3], row[4], row[5], row[10], row[16]
        if arm is None or ad == HOLDOUT_AD_ID:
            continue
        a = acc[(arm, user)]
        a[0].add((request, row[8], int(row[1].timestamp()) // 3600))
        a[1] += 1
        a[2] += eid in clicked
        a[3] += price  # served (no bid type): clicked or not
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (arm, _user), a in sorted(acc.items()):
        for name, v in zip(
            ("requests", "impressions", "clicks", "revenue"), (len(a[0]), *a[1:]), strict=True
        ):
            out[arm][name].append(float(v))
    return out


def insert(backend: Backend, rows: dict[str, list[tuple[Any, ...]]]) -> None:
    backend.insert("impressions", IMP_COLUMNS, rows["impressions"])
    backend.insert("clicks", CLICK_COLUMNS, rows["clicks"])


@pytest.fixture(scope="module")
def engines(stack: Settings) -> Iterator[tuple[dict[str, Backend], Settings]]:
    url = urlparse(stack.clickhouse.url)
    name = f"{url.path.lstrip('/')}_ab{uuid.uuid4().hex[:6]}"
    s = stack.model_copy(
        update={
            "clickhouse": stack.clickhouse.model_copy(
                update={"url": urlunparse(url._replace(path=f"/{name}"))}
            )
        }
    )
    migrate(s)
    client = clickhouse_client(s, name)
    chdb = ChdbBackend(f"ab_{uuid.uuid4().hex[:6]}")
    apply_migrations(chdb)
    backends: dict[str, Backend] = {"clickhouse": DriverBackend(client), "chdb": chdb}
    rows = market()
    for backend in backends.values():
        insert(backend, rows)
        ab_rollups.refresh_ab_rollups(backend, T0, T0 + HOURS * 3600)
    yield backends, s
    client.execute(f"DROP DATABASE IF EXISTS {name}")
    client.disconnect()
    chdb.close()


def test_rollup_equals_the_raw_events_on_both_engines(engines: tuple[dict[str, Backend], Settings]) -> None:
    backends, _ = engines
    want = expected_users(market())
    for name, backend in backends.items():
        arms = ab_rollups.read_arms(backend, T0, T0 + HOURS * 3600)
        assert sorted(arms) == sorted(ARMS), name
        for arm, data in arms.items():
            # requests are counted per hour and slot, so the raw side counts (request, slot, hour)
            for col in ("requests", "impressions", "clicks"):
                assert data.column(col).tolist() == want[arm][col], (name, arm, col)
            np.testing.assert_allclose(data.revenue, want[arm]["revenue"], rtol=1e-9)


def test_a_reinserted_batch_and_a_second_refresh_count_once(
    engines: tuple[dict[str, Backend], Settings],
) -> None:
    backends, _ = engines
    rows = market()
    for name, backend in backends.items():
        before = compare(ab_rollups.read_arms(backend, T0, T0 + HOURS * 3600), method="delta").as_dict()
        insert(backend, {k: v[: len(v) // 2] for k, v in rows.items()})  # the sink re-inserts half
        ab_rollups.refresh_ab_rollups(backend, T0, T0 + HOURS * 3600)
        ab_rollups.refresh_ab_rollups(backend, T0, T0 + HOURS * 3600)
        after = compare(ab_rollups.read_arms(backend, T0, T0 + HOURS * 3600), method="delta").as_dict()
        assert after == before, name


def test_bootstrap_report_is_the_same_on_both_engines(engines: tuple[dict[str, Backend], Settings]) -> None:
    backends, _ = engines
    reports = [
        compare(ab_rollups.read_arms(b, T0, T0 + HOURS * 3600, slot="feed"), n_boot=300, seed=4).as_dict()
        for b in backends.values()
    ]
    assert json.dumps(reports[0], sort_keys=True) == json.dumps(reports[1], sort_keys=True)


def test_hourly_ctr_band_equals_the_delta_method(engines: tuple[dict[str, Backend], Settings]) -> None:
    backends, _ = engines
    params = {"since": T0, "until": T0 + HOURS * 3600, "slot": ""}
    results = {n: b.execute(ab_rollups.HOURLY_CTR_SQL, params) for n, b in backends.items()}
    assert len(results["clickhouse"]) == HOURS * len(ARMS)
    for (t1, *a), (t2, *b) in zip(results["clickhouse"], results["chdb"], strict=True):
        assert str(t1)[:19] == str(t2)[:19] and a[:4] == b[:4]
        assert math.isclose(a[4], b[4], rel_tol=1e-9) and math.isclose(a[5], b[5], rel_tol=1e-6)
    # one hour of one arm, by attribution.ab on that hour's per-user rows
    hour, arm = results["chdb"][0][0], results["chdb"][0][1]
    t = int(datetime.fromisoformat(str(hour)).replace(tzinfo=UTC).timestamp())
    data = ab_rollups.read_arms(backends["chdb"], t, t + 3600)[arm]
    m = arm_metrics(ArmData.of(arm, data.requests, data.impressions, data.clicks, data.revenue), "delta")
    assert results["chdb"][0][5] == pytest.approx(m.ctr.value)
    assert results["chdb"][0][6] == pytest.approx(m.ctr.half_width, rel=1e-5)


def test_logged_rounds_and_the_logging_policy(engines: tuple[dict[str, Backend], Settings]) -> None:
    backends, _ = engines
    rows = market()
    logged = [r for r in rows["impressions"] if r[17] is not None]
    clicked = {c[4] for c in rows["clicks"]}
    values = []
    for backend in backends.values():
        rounds = read_logged(backend, T0, T0 + HOURS * 3600)
        assert rounds.n == len(logged)
        assert rounds.reward.sum() == sum(r[0] in clicked for r in logged)
        v = evaluate(rounds, "logging")
        assert v.estimates["ips"].value == pytest.approx(v.logged_ctr)
        assert v.estimates["snips"].value == pytest.approx(v.logged_ctr)
        values.append(evaluate(rounds, "greedy").as_dict())
        control = read_logged(backend, T0, T0 + HOURS * 3600, arm="control")
        assert 0 < control.n < rounds.n
    # rows arrive in each engine's own order: sums agree up to float rounding
    for name, e in values[0]["estimates"].items():  # type: ignore[attr-defined]
        assert e == pytest.approx(values[1]["estimates"][name], rel=1e-12)  # type: ignore[index]


def _cli(s: Settings, *args: str) -> Any:
    from typer.testing import CliRunner

    from deploy.cli import app

    env = {"ADSTREAM_CLICKHOUSE__URL": s.clickhouse.url, "COLUMNS": "200"}
    return CliRunner().invoke(app, list(args), env=env)


def test_cli_ab_and_evaluate(engines: tuple[dict[str, Backend], Settings]) -> None:
    _, s = engines
    rng = ["--since", str(T0), "--until", str(T0 + HOURS * 3600)]
    out = _cli(s, "ab", *rng, "--json", "--n-boot", "200")
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert sorted(report["arms"]) == sorted(ARMS) and len(report["lifts"]) == 6
    table = _cli(s, "ab", *rng, "--slot", "search", "--method", "delta")
    assert table.exit_code == 0 and "learning" in table.output and "relative lift" in table.output
    out = _cli(s, "evaluate", "--policy", "explore:0.5", *rng, "--json")
    assert out.exit_code == 0, out.output
    assert set(json.loads(out.stdout)["estimates"]) == {"ips", "snips", "dr"}
    assert "SNIPS" in _cli(s, "evaluate", "--policy", "greedy", *rng).output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("ab", "--since", "1000", "--until", "5000"), "no A/B traffic between 1970-01-01 00:00:00"),
        (("ab", "--since", str(T0), "--until", str(T0 + 3600), "--pair", "learning:holdout"),
         "learning vs holdout: arm 'holdout' has no traffic"),
        (("evaluate", "--policy", "greedy", "--since", "1000", "--until", "5000"),
         "no logged impressions with a propensity in [1000, 5000)"),
        (("evaluate", "--policy", "greedy", "--since", str(T0), "--until", str(T0 + 3600), "--arm", "contrl"),
         "arm 'contrl'"),
        (("evaluate", "--policy", "sometimes", "--since", str(T0)), "unknown policy 'sometimes'"),
    ],
)  # fmt: skip
def test_cli_bad_input_is_named_with_exit_2(
    engines: tuple[dict[str, Backend], Settings], args: tuple[str, ...], needle: str
) -> None:
    _, s = engines
    out = _cli(s, *args)
    assert out.exit_code == 2, out.output
    assert needle in out.output
    assert "Traceback" not in out.output
    assert out.exception is None or isinstance(out.exception, SystemExit)
