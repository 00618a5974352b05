"""Every dashboard statement on seeded events, on ClickHouse 18.16 (the server) and on chDB.

Both engines get the same migrations and the same events (a seeded market, through the sink's
own row mapping); every query must run on both and give the same rows, every panel must have
data, and the numbers are checked against what the events say (counts, CTR, spend, AUC).
"""

from __future__ import annotations

import math
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

from attribution.dashboard import panels
from attribution.dashboard import queries as q
from attribution.sql import Backend, ChdbBackend, DriverBackend
from schemas.settings import Settings

pytestmark = [pytest.mark.clickhouse, pytest.mark.timeout(180)]

N_IMPRESSIONS = 6000
VERSIONS = (None, "slot:feed@1", "slot:feed@2")  # served adapter, by thirds of the run
SLOT_CHANNELS = ["feed", "search", "splash"]
HOLDOUT_EVERY = 40  # every 40th impression records a held-out user (schemas.holdout)
MODELS = ("last_click", "linear", "markov", "shapley")


def seeded_rows(
    n_impressions: int = N_IMPRESSIONS, seed: int = 11
) -> dict[tuple[str, tuple[str, ...]], list[tuple[Any, ...]]]:
    """The raw-table rows of a seeded market, as the streams sink writes them (table, columns → rows).

    Impressions carry the served pctr (the market's true click probability: a good ranker) and
    the adapter version serving them (none, then two versions, by thirds of the run).
    """
    from schemas.events import Click, Dwell, Impression
    from schemas.holdout import HOLDOUT_AD_ID
    from streams.sink import COLUMNS, row_of
    from workloads import Market, MarketConfig

    market = Market(
        MarketConfig(
            seed=seed, n_users=400, n_ads=40, n_advertisers=5, rate=0.5, drift_at=None, new_ads_at=None
        )
    )
    rows: dict[tuple[str, tuple[str, ...]], list[tuple[Any, ...]]] = defaultdict(list)
    seen = 0
    held_out: set[str] = set()
    for offset, event in enumerate(market.open_loop(n_impressions)):
        if isinstance(event, Impression) and seen % HOLDOUT_EVERY == HOLDOUT_EVERY - 1:
            seen += 1  # a held-out user: no ad shown, nothing to click, nothing paid
            held_out.add(event.event_id)
            event = event.model_copy(update={"ad_id": HOLDOUT_AD_ID, "price": 0.0, "model_version": None})
        elif isinstance(event, Impression):
            version = VERSIONS[min(3 * seen // n_impressions, 2)]
            seen += 1
            event = event.model_copy(
                update={
                    "pctr": round(market.oracle_pctr(event.event_id), 6),
                    "adapter_version": version,
                    "model_version": "ranker-1",
                    **_variant(event.ad_id, seen),
                }
            )
        elif isinstance(event, Click | Dwell) and event.impression_id in held_out:
            continue
        table, row = row_of(event, 0, offset)
        rows[(table, (*COLUMNS[type(event)][1], "kafka_partition", "kafka_offset"))].append(row)
    return dict(rows)


def _variant(ad_id: str, seen: int) -> dict[str, Any]:
    """A creative variant (three, drawn in turn) on the impressions of about a third of the ads,
    for the variants panel (serving's bandit chooses them; the seeded market has none)."""
    if ord(ad_id[-1]) % 3:
        return {}
    return {"variant_id": f"v{seen % 3}", "variant_propensity": 1 / 3}


def insert_rows(backend: Backend, rows: dict[tuple[str, tuple[str, ...]], list[tuple[Any, ...]]]) -> None:
    for (table, columns), batch in rows.items():
        backend.insert(table, columns, batch)


def seed_ab_rollup(backend: Backend, rows: dict[tuple[str, tuple[str, ...]], list[tuple[Any, ...]]]) -> None:
    """The A/B rollup (ab_rollup_hourly) of the seeded events with users split into three arms by
    id: the dashboard reads the rollup (how a refresh builds it from impressions that carry an
    arm is tested in test_ab_engines)."""
    from datetime import UTC, datetime

    from schemas.holdout import HOLDOUT_AD_ID

    (imp_key,) = [k for k in rows if k[0] == "impressions"]
    (click_key,) = [k for k in rows if k[0] == "clicks"]
    col = {c: i for i, c in enumerate(imp_key[1])}
    clicked = {r[click_key[1].index("impression_id")] for r in rows[click_key]}
    acc: dict[tuple[int, str, str, str], list[Any]] = defaultdict(lambda: [set(), 0, 0, 0.0])
    for r in rows[imp_key]:
        if r[col["ad_id"]] == HOLDOUT_AD_ID:
            continue
        user = r[col["user_id"]]
        arm = ("learning", "correction", "control")[int(user.lstrip("u")) % 3]
        a = acc[(int(r[col["ts"]]) // 3600 * 3600, arm, r[col["slot"]], user)]
        hit = r[col["event_id"]] in clicked
        a[0].add(r[col["request_id"]])
        a[1], a[2], a[3] = a[1] + 1, a[2] + hit, a[3] + (r[col["price"]] if hit else 0.0)
    backend.insert(
        "ab_rollup_hourly",
        ("hour", "arm", "slot", "user_id", "requests", "impressions", "clicks", "revenue", "version"),
        [
            (
                datetime.fromtimestamp(h, UTC).replace(tzinfo=None),
                arm,
                slot,
                user,
                len(a[0]),
                a[1],
                a[2],
                a[3],
                1,
            )
            for (h, arm, slot, user), a in acc.items()
        ],
    )


def store_run(backend: Backend, since: int, until: int, bootstrap: int = 30) -> str:
    """An attribution run over the slots (four models, bootstrap CIs), made and stored by
    attribution.runs as `adstream attribution` does, with the hourly rollups of its range
    refreshed (the spend panels read them); its id."""
    from attribution.models import ModelConfig
    from attribution.paths import Window
    from attribution.rollups import refresh_rollups
    from attribution.runs import run_attribution
    from attribution.runs import store_run as store

    run = run_attribution(
        backend,
        models=list(MODELS),
        by="slot",
        since=since,
        until=until,
        window=Window(),
        config=ModelConfig(seed=1, bootstrap=bootstrap),
    )
    store(backend, run)
    refresh_rollups(backend, since, until)
    return run.run_id


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, tuple[str, ...]], list[tuple[Any, ...]]]:
    return seeded_rows()


def _database(stack: Settings, tag: str) -> Settings:
    base, db = stack.clickhouse.url.rsplit("/", 1)
    return stack.model_copy(
        update={
            "clickhouse": stack.clickhouse.model_copy(
                update={"url": f"{base}/{db}_{tag}_{uuid.uuid4().hex[:6]}"}
            )
        }
    )


def server_backend(settings: Settings) -> Iterator[DriverBackend]:
    """A migrated database of its own on the ClickHouse server; dropped afterwards."""
    from clickhouse_driver import Client

    from attribution.migrate import migrate
    from schemas.clients import clickhouse_args, clickhouse_database

    migrate(settings)
    client = Client(**clickhouse_args(settings, clickhouse_database(settings)))
    try:
        yield DriverBackend(client)
    finally:
        client.execute(f"DROP DATABASE IF EXISTS {clickhouse_database(settings)}")
        client.disconnect()


def chdb_backend(tag: str) -> Iterator[ChdbBackend]:
    from attribution.migrate import apply_migrations

    name = f"dash_{tag}_{uuid.uuid4().hex[:6]}"
    backend = ChdbBackend(name)
    try:
        apply_migrations(backend)
        yield backend
    finally:
        backend.execute(f"DROP DATABASE IF EXISTS {name}")
        backend.close()


@pytest.fixture(scope="module")
def engines(
    stack: Settings, rows: dict[tuple[str, tuple[str, ...]], list[tuple[Any, ...]]]
) -> Iterator[dict[str, Backend]]:
    server = server_backend(_database(stack, "dash"))
    embedded = chdb_backend("seeded")
    backends: dict[str, Backend] = {"clickhouse": next(server), "chdb": next(embedded)}
    for backend in backends.values():
        insert_rows(backend, rows)
        seed_ab_rollup(backend, rows)
        lo, hi = panels.data_bounds(backend)  # type: ignore[misc]
        store_run(backend, lo, hi + 1)
    # the sink re-inserts a batch after a crash: the same rows again, on the server
    impressions = next(k for k in rows if k[0] == "impressions")
    backends["clickhouse"].insert(impressions[0], impressions[1], rows[impressions][:1500])
    yield backends
    for gen in (server, embedded):
        gen.close()


@pytest.fixture(scope="module")
def window(engines: dict[str, Backend]) -> q.Window:
    return q.resolve(panels.data_bounds(engines["clickhouse"]))


def _close(a: Any, b: Any, path: str = "") -> None:
    """Equal up to float rounding (the engines may sum in different orders)."""
    if isinstance(a, float) or isinstance(b, float):
        assert a is not None and b is not None, f"{path}: {a!r} != {b!r}"
        if math.isnan(float(a)) or math.isnan(float(b)):  # undefined on both (a CPA without conversions)
            assert math.isnan(float(a)) and math.isnan(float(b)), f"{path}: {a!r} != {b!r}"
            return
        assert math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-9), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys differ"
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), f"{path}: lengths {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.mark.parametrize("bucket", [60, 300, 900])
@pytest.mark.parametrize("name", sorted(q.QUERIES))
def test_every_query_runs_on_both_engines_alike(
    name: str, bucket: int, engines: dict[str, Backend], window: q.Window
) -> None:
    params = {**window.params, "bucket": bucket}
    server = engines["clickhouse"].execute(q.QUERIES[name], params)
    embedded = engines["chdb"].execute(q.QUERIES[name], params)
    assert server, f"{name} returned no rows on seeded data"
    if name in ("run_info", "recent_runs"):  # each engine's run has its own id and creation time
        server, embedded = [r[2:] for r in server], [r[2:] for r in embedded]
    if name == "run_results":  # point estimates; the bootstrap CIs depend on the path order
        server, embedded = ([r[:5] + r[7:11] for r in rows] for rows in (server, embedded))
    _close(server, embedded, name)


def test_every_panel_has_data_and_engines_agree(engines: dict[str, Backend], window: q.Window) -> None:
    built = {name: panels.build(backend, window) for name, backend in engines.items()}
    for name, got in built.items():
        assert [p["id"] for p in got] == list(panels.PANEL_IDS)
        for panel in got:
            assert panel["error"] is None, f"{name}/{panel['id']}: {panel['error']}"
            assert panel["figure"] is not None, f"{name}/{panel['id']}: {panel['empty']}"
            traces = panel["figure"]["data"]
            assert traces and all(any(v is not None for v in points(t)) for t in traces), panel["id"]
    _close(*(_comparable_panels(built[e], engines[e]) for e in ("clickhouse", "chdb")), "panels")


def _comparable_panels(built: list[panels.Panel], backend: Backend) -> Any:
    """Panels as both engines must agree on them: the engine's own run id replaced by 'RUN', and
    of the run panels only the point estimates (bootstrap CIs, and the low-confidence flags drawn
    from them, depend on the order the engine returns the paths in: attribution.paths)."""
    import json

    ((run_id,),) = backend.execute("SELECT run_id FROM attribution_runs")
    out = json.loads(json.dumps(built).replace(run_id, "RUN"))
    for panel in out:
        if panel["id"] in ("model_comparison", "model_roi", "budget_moves"):
            panel["figure"]["data"] = [{k: t[k] for k in ("name", "x", "y")} for t in panel["figure"]["data"]]
        if panel["id"] == "recent_runs":  # each engine stored its run at its own moment
            del panel["figure"]["data"][0]["cells"]["values"][1]
    return out


def points(trace: dict[str, Any]) -> list[Any]:
    """What a trace draws: its y values, or a table's first column."""
    return list(trace["cells"]["values"][0]) if trace["type"] == "table" else list(trace["y"])


def _table(rows: dict[tuple[str, tuple[str, ...]], list[tuple[Any, ...]]], name: str) -> list[dict[str, Any]]:
    (key,) = [k for k in rows if k[0] == name]
    return [dict(zip(key[1], r, strict=True)) for r in rows[key]]


def test_counts_ctr_and_spend_match_the_events(
    engines: dict[str, Backend],
    window: q.Window,
    rows: dict[tuple[str, tuple[str, ...]], list[tuple[Any, ...]]],
) -> None:
    from schemas.holdout import HOLDOUT_AD_ID

    everything = _table(rows, "impressions")
    imps = [i for i in everything if i["ad_id"] != HOLDOUT_AD_ID]
    clicked = {c["impression_id"] for c in _table(rows, "clicks")}
    for name, backend in engines.items():  # the server holds 1,500 impressions twice: FINAL hides them
        rates = backend.execute(q.EVENT_RATES, window.params)
        totals = Counter[str]()
        for kind, _, n in rates:
            totals[kind] += n
        expected = {t: len(_table(rows, t)) for t in ("clicks", "dwell", "conversions")}
        expected |= {"impressions": len(imps), "holdout impressions": len(everything) - len(imps)}
        assert totals == expected and expected["holdout impressions"] > 0, name
        ctr_rows = backend.execute(q.CTR_BY_SLOT_CAMPAIGN, {**window.params, "top": q.MAX_TOP})
        expect: Counter[tuple[str, str, str]] = Counter()
        for i in imps:
            expect[(i["slot"], i["campaign_id"], "i")] += 1
            expect[(i["slot"], i["campaign_id"], "c")] += i["event_id"] in clicked
        assert {(s, c): (n, k) for s, c, n, k in ctr_rows} == {
            (s, c): (expect[(s, c, "i")], expect[(s, c, "c")]) for s, c, kind in expect if kind == "i"
        }, name
        # the seeded market names no bid type: billed as before billing, its price when served
        assert all(i["bid_type"] is None for i in imps)
        spend = sum(s for _, s in backend.execute(q.SPEND_OVER_TIME, window.params))
        assert math.isclose(spend, sum(i["price"] for i in imps), rel_tol=1e-9), name


@pytest.mark.parametrize("bucket", [300, 900])
def test_online_auc_is_the_rank_auc_per_bucket_and_version(
    bucket: int,
    engines: dict[str, Backend],
    window: q.Window,
    rows: dict[tuple[str, tuple[str, ...]], list[tuple[Any, ...]]],
) -> None:
    from sklearn.metrics import roc_auc_score

    clicked = {c["impression_id"] for c in _table(rows, "clicks")}
    groups: dict[tuple[int, str], tuple[list[float], list[int]]] = defaultdict(lambda: ([], []))
    for i in _table(rows, "impressions"):
        if i["pctr"] is None:  # holdout impressions: nothing was served
            continue
        t = i["ts"] // bucket * bucket
        for key in (i["adapter_version"] or "none", "all"):
            groups[(t, key)][0].append(math.floor(i["pctr"] * 10000))
            groups[(t, key)][1].append(int(i["event_id"] in clicked))
    expect = {k: roc_auc_score(y, s) for k, (s, y) in groups.items() if 0 < sum(y) < len(y)}
    for name, backend in engines.items():
        got = {
            (t, v): auc
            for t, v, _, _, auc in backend.execute(q.ONLINE_AUC, {**window.params, "bucket": bucket})
        }
        assert got.keys() == expect.keys(), name
        for k, auc in got.items():
            assert math.isclose(auc, expect[k], abs_tol=1e-9), (name, k, auc, expect[k])
    assert {v for _, v in expect} == {"all", "none", "slot:feed@1", "slot:feed@2"}
    assert sum(expect[k] for k in expect if k[1] == "all") / sum(k[1] == "all" for k in expect) > 0.6


def test_user_values_are_bound_not_spliced(engines: dict[str, Backend], window: q.Window) -> None:
    hostile = q.Window(window.since, window.until, window.bucket, 5, "x' OR '1'='1")
    for name, backend in engines.items():
        got = panels.attribution_runs(backend, hostile)
        assert all(p["figure"] is None and "no attribution run" in p["empty"] for p in got), name
        ((run_id,),) = backend.execute("SELECT run_id FROM attribution_runs")
        assert panels.attribution_runs(backend, q.Window(window.since, window.until, 60, 5, run_id))[0][
            "figure"
        ]


def test_an_empty_database_gives_no_data_panels_not_errors(stack: Settings) -> None:
    for gen in (server_backend(_database(stack, "empty")), chdb_backend("empty")):
        backend = next(gen)
        try:
            assert panels.data_bounds(backend) is None
            got = panels.build(backend, q.resolve(None))
            assert [p["id"] for p in got] == list(panels.PANEL_IDS)
            for panel in got:
                assert panel["error"] is None and panel["figure"] is None, panel
                assert panel["empty"], panel
        finally:
            gen.close()


def test_model_panels_show_the_stored_run(engines: dict[str, Backend], window: q.Window) -> None:
    for name, backend in engines.items():
        ((conversions,),) = backend.execute("SELECT conversions FROM attribution_runs")
        comparison, returns, moves = panels.attribution_runs(backend, window)
        assert sorted(t["name"] for t in returns["figure"]["data"]) == sorted(MODELS), name
        traces = comparison["figure"]["data"]
        assert sorted(t["name"] for t in traces) == sorted(MODELS), name
        for t in traces:
            assert t["x"] == SLOT_CHANNELS, name
            assert math.isclose(sum(t["y"]), conversions, rel_tol=1e-9), (name, t["name"])  # efficiency
            bars = [v for v in t["error_y"]["array"] + t["error_y"]["arrayminus"] if v is not None]
            assert bars and all(v >= 0 for v in bars), (name, t["name"])
        for t in moves["figure"]["data"]:  # the total budget is fixed: the moves cancel out
            assert abs(sum(t["y"])) < 1e-6 * max(1.0, max(abs(v) for v in t["y"])), (name, t["name"])
