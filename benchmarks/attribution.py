"""Attribution benchmarks and the truth check.

1. `sink_rows_per_s`: raw events (impressions, clicks, conversions of the attribution market)
   inserted into the raw tables of the ClickHouse server by the streams worker's own sink
   (`streams.sink.ClickHouseSink`: row tuples as the worker builds them, blocks of
   `sink.batch_size` rows; the tuples are built before the clock starts). Goal ≥ 100,000.
   `bulk_load_rows_per_s` is the columnar load path (`DriverBackend.insert_columnar`, 200,000-row
   column lists) that the tests and the truth check use, for comparison.
2. `path_build_events_per_s`: the path-building SQL (attribution.paths) over those events, at
   slot × campaign granularity, events in range / wall time. Goal ≥ 1,000,000.
3. `models_100k_paths_s`: every model (point estimates; Markov with its order chosen on held-out
   likelihood) on 100,000 distinct paths over 15 channels. Goal ≤ 2 s.
4. `shapley_1m_paths_s`: Shapley over 1,000,000 conversion paths with 3–12 distinct channels
   each (15 channels), exact per channel set. Goal ≤ 5 s.
5. The truth check (attribution.truth) on an unconfounded and a confounded market (with 30 %
   holdouts on the confounded one), every model and its calibrated variant (and Markov with the
   textbook null removal, `markov_null_removal`, beside the default redistribution): TV distance of
   credit shares against the exact causal credit, and the true change in caused conversions
   and value when each model's budget plan is re-simulated (expected given the touches served,
   and as one draw realised them), beside the plans from the true curves (the ceiling) →
   `results/attribution_truth.json`.
   A third market, `outside`, is the confounded one plus three channels outside adstream
   (`Touch` touchpoints and imported daily spend) whose effect has a known adstock and Hill
   saturation; each model's total share of them is reported beside the true share
   (`--truth-only outside` runs just that market).

Run: `.venv/bin/python -m benchmarks.attribution` (`--quick` for a smaller run while developing;
`--only paths` for figures 1 and 2 alone, printed, no result file written).
Prints a table; writes `benchmarks/results/attribution.json`. The ClickHouse server of the
settings is used (a database of its own, dropped at the end).
"""

from __future__ import annotations

import argparse
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

import numpy as np
from rich.console import Console
from rich.table import Table

from attribution.migrate import migrate
from attribution.models import MODELS, ModelConfig, attribute
from attribution.models.shapley import shapley
from attribution.paths import Paths, Window, build_paths
from attribution.sql import DriverBackend
from attribution.truth import check_market
from deploy.machine import machine, write_result
from schemas.clients import clickhouse_client
from schemas.errors import StoreError
from schemas.settings import Settings
from streams.sink import ClickHouseSink
from workloads.attribution_market import (
    AttributionMarketConfig,
    default_outside,
    period,
    raw_columns,
    simulate,
)

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "benchmarks" / "results"
GOALS = {
    "sink_rows_per_s": (">=", 100_000),
    "path_build_events_per_s": (">=", 1_000_000),
    "models_100k_paths_s": ("<=", 2.0),
    "shapley_1m_paths_s": ("<=", 5.0),
    "shapley_10m_paths_s": ("<=", 2.0),
}


def synthetic_paths(n: int, channels: int, lo: int, hi: int, seed: int, nulls: bool) -> Paths:
    """`n` random paths of `lo`–`hi` distinct channels (in random order), one conversion each
    (and some null journeys when `nulls`), built straight into the flat layout."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    # distinct channels per path: the first `length` of a random permutation (argsort of noise)
    perm = np.argsort(rng.random((n, channels)), axis=1)
    mask = np.arange(channels)[None, :] < lengths[:, None]
    channel = perm[mask].astype(np.int32)
    touches = channel.shape[0]
    conv = rng.integers(0, 3, n).astype(float) if nulls else np.ones(n)
    null = rng.integers(0, 4, n).astype(float) if nulls else np.zeros(n)
    conv[(conv == 0) & (null == 0)] = 1.0
    return Paths(
        tuple(f"ch{i:02d}" for i in range(channels)), offsets, channel,
        np.asarray(rng.integers(0, 2, touches), dtype=np.uint8),
        np.asarray(rng.uniform(0, 7 * 86400, touches)),
        conv, conv * rng.uniform(10, 100, n), null,
    )  # fmt: skip


def bench_sink_and_paths(settings: Settings, users: int) -> dict[str, Any]:
    url = urlparse(settings.clickhouse.url)
    name = f"adstream_bench_attr_{uuid.uuid4().hex[:6]}"
    s = settings.model_copy(
        update={
            "clickhouse": settings.clickhouse.model_copy(
                update={"url": urlunparse(url._replace(path=f"/{name}"))}
            )
        }
    )
    migrate(s)
    client = clickhouse_client(s, name)
    backend = DriverBackend(client)
    try:
        cfg = AttributionMarketConfig(seed=3, n_users=users)
        data = simulate(cfg)
        tables = raw_columns(data)
        rows = sum(len(cols[0]) for _, cols in tables.values())
        sink = ClickHouseSink(s)
        batch = s.sink.batch_size
        tuples = {table: (names, list(zip(*cols, strict=True))) for table, (names, cols) in tables.items()}
        t0 = time.perf_counter()
        for table, (names, block) in tuples.items():
            for lo in range(0, len(block), batch):
                sink.insert_block(table, names, block[lo : lo + batch])
        insert_s = time.perf_counter() - t0
        sink.close()
        # the impressions again through the columnar bulk path, into a copy of their table
        client.execute("CREATE TABLE bulk_impressions AS impressions")
        names, cols = tables["impressions"]
        t0 = time.perf_counter()
        for lo in range(0, len(cols[0]), 200_000):
            backend.insert_columnar("bulk_impressions", names, [c[lo : lo + 200_000] for c in cols])
        bulk_s = time.perf_counter() - t0
        bulk_rows = len(cols[0])
        merge_fully(client, name, "impressions")  # merged parts, as a settled table would be
        since, until = period(cfg)
        window = Window(click_s=3 * 86400, view_s=86400, gap_s=3 * 86400)
        build_paths(backend, "slot_campaign", since, until, window)  # warm the caches
        t0 = time.perf_counter()
        built = build_paths(backend, "slot_campaign", since, until, window)
        path_s = time.perf_counter() - t0
        return {
            "rows": rows,
            "insert_s": round(insert_s, 3),
            "sink_batch_rows": batch,
            "sink_rows_per_s": round(rows / insert_s),
            "bulk_load_rows_per_s": round(bulk_rows / bulk_s),
            "path_events": data.n_events,
            "path_build_s": round(path_s, 3),
            "path_build_events_per_s": round(data.n_events / path_s),
            "distinct_paths": built.paths.n,
        }
    finally:
        client.execute(f"DROP DATABASE IF EXISTS {name}")
        client.disconnect()


def merge_fully(client: Any, database: str, table: str, wait_s: float = 120.0) -> None:
    """Merge each partition of `table` into one part (OPTIMIZE … FINAL), waiting for the server.

    A plain `OPTIMIZE TABLE … FINAL` does nothing, without a word on 18.16, while background
    merges hold some of the parts, which is just when the sink's small parts have been written:
    the benchmark then timed path building over four parts read with FINAL (a merging read,
    about 12 % more server CPU on this market). So each partition that still has several parts
    is optimized with `optimize_throw_if_noop`, and retried while the server cannot assign it."""
    from clickhouse_driver.errors import ServerException

    cannot_assign = 388  # CANNOT_ASSIGN_OPTIMIZE: parts are being merged in the background
    deadline = time.monotonic() + wait_s
    while True:
        split = client.execute(
            "SELECT partition_id FROM system.parts WHERE database = %(db)s AND table = %(table)s"
            " AND active GROUP BY partition_id HAVING count() > 1",
            {"db": database, "table": table},
        )
        if not split:
            return
        if time.monotonic() > deadline:
            raise StoreError(f"{table}: partitions {split} still have several parts after {wait_s} s")
        for (partition,) in split:
            try:
                client.execute(
                    f"OPTIMIZE TABLE {table} PARTITION ID %(p)s FINAL",
                    {"p": partition},
                    settings={"optimize_throw_if_noop": 1},
                )
            except ServerException as exc:
                if exc.code != cannot_assign:
                    raise
                time.sleep(0.5)


def bench_models(n: int) -> dict[str, Any]:
    paths = synthetic_paths(n, 15, 1, 10, seed=1, nulls=True)
    cfg = ModelConfig(seed=0)
    per: dict[str, float] = {}
    t0 = time.perf_counter()
    for m in MODELS:
        t1 = time.perf_counter()
        attribute(m, paths, cfg)
        per[m] = round(time.perf_counter() - t1, 3)
    total = time.perf_counter() - t0
    t1 = time.perf_counter()
    attribute("shapley", paths, ModelConfig(seed=0, bootstrap=20))
    boot = time.perf_counter() - t1
    return {"paths": n, "models_100k_paths_s": round(total, 3), "per_model_s": per,
            "shapley_bootstrap20_s": round(boot, 3)}  # fmt: skip


def bench_shapley(n: int, key: str = "shapley_1m_paths_s") -> dict[str, Any]:
    paths = chunked_paths(n, 15, 3, 12, seed=2)
    t0 = time.perf_counter()
    _, _, meta = shapley(paths, exact_max=12, permutations=200, seed=0)
    return {"conversion_paths": n, "touches": int(paths.channel.shape[0]),
            key: round(time.perf_counter() - t0, 3),
            "sampled_sets": meta["sampled_sets"]}  # fmt: skip


def chunked_paths(n: int, channels: int, lo: int, hi: int, seed: int, chunk: int = 1_000_000) -> Paths:
    """`synthetic_paths` (converting only) built a million at a time: 10 M paths without the
    10 M × channels noise matrix in memory at once (the first million equal `synthetic_paths`'s)."""
    if n <= chunk:
        return synthetic_paths(n, channels, lo, hi, seed, nulls=False)
    parts = [synthetic_paths(min(chunk, n - i), channels, lo, hi, seed + i // chunk, nulls=False)
             for i in range(0, n, chunk)]  # fmt: skip
    starts = np.cumsum([0] + [p.channel.shape[0] for p in parts[:-1]])
    offsets = np.concatenate(
        [parts[0].offsets[:1], *[p.offsets[1:] + s for p, s in zip(parts, starts, strict=True)]]
    )
    cat = lambda name: np.concatenate([getattr(p, name) for p in parts])  # noqa: E731
    return Paths(parts[0].channels, offsets.astype(np.int64), cat("channel"), cat("kind"), cat("age_s"),
                 cat("conversions"), cat("value"), cat("nulls"))  # fmt: skip


# markets the truth check runs only when named (`--truth-only mmm_long`): 18 weeks of 180 k users
ON_REQUEST = ("mmm_long",)


def markets(users: int, seed: int = 1) -> dict[str, AttributionMarketConfig]:
    """The truth check's markets: unconfounded, confounded (with holdouts), and the confounded one
    with three outside channels of known adstock and saturation (`default_outside`)."""
    confounded = AttributionMarketConfig(seed=seed, n_users=2 * users, confounded=True, holdout_share=0.3)
    mmm = replace(confounded, outside=default_outside(), days=42.0, n_users=6 * users, daily_jitter=0.4)
    return {
        "unconfounded": AttributionMarketConfig(seed=seed, n_users=users),
        "confounded": confounded,
        "outside": replace(confounded, outside=default_outside()),
        # six weeks with day-to-day campaign budgets: what a media-mix model needs (daily users as above)
        "mmm": mmm,
        # every channel with diminishing returns within ±50 % of its budget and returns of one order:
        # campaigns wear out with frequency (the third impression to a user is worth half the
        # first), the outside channels' effects ×10 (their cost per caused conversion in the own
        # campaigns' range, where it was 3–30 × it); what a media-mix model's curves are for
        "mmm_saturating": replace(mmm, wearout=0.7, outside=default_outside(effect=10.0)),
        # the mmm market over 18 weeks (same daily users and budgets): how much of the media-mix
        # model's error is six weeks of days, which cannot identify the outside channels' curves
        "mmm_long": replace(mmm, days=126.0, n_users=18 * users),
    }


def truth(
    settings: Settings,
    users: int,
    only: list[str] | None = None,
    mmm: str = "quick",
    seed: int = 1,
    budget_moves: bool = True,
) -> dict[str, Any]:
    url = urlparse(settings.clickhouse.url)
    out: dict[str, Any] = {}
    for market, cfg in markets(users, seed).items():
        if (only and market not in only) or (not only and market in ON_REQUEST):
            continue
        name = f"adstream_bench_truth_{uuid.uuid4().hex[:6]}"
        s = settings.model_copy(
            update={
                "clickhouse": settings.clickhouse.model_copy(
                    update={"url": urlunparse(url._replace(path=f"/{name}"))}
                )
            }
        )
        migrate(s)
        client = clickhouse_client(s, name)
        try:
            res, data = check_market(
                DriverBackend(client), cfg, list(MODELS), ModelConfig(seed=1),
                variants={"markov_null_removal": ("markov", {"markov_removal": "null"})},
                mmm=mmm if cfg.daily_jitter > 0 else None, budget_moves=budget_moves,
            )  # fmt: skip
        finally:
            client.execute(f"DROP DATABASE IF EXISTS {name}")
            client.disconnect()
        true_conv, _ = data.true_credit()
        out[market] = {
            "users": cfg.n_users,
            "holdout_share": cfg.holdout_share,
            "caused_conversions": float(true_conv.sum()),
            "all_conversions": int(data.conv["t"].shape[0]),
            "models": {m: r.to_dict() for m, r in res.items()},
            "true_share": next(iter(res.values())).true_share,
        }
        if cfg.outside:
            out[market]["outside_channels"] = {
                o.name: {"daily_spend": o.daily_spend, "cost_per_touch": o.cost_per_touch, "beta": o.beta,
                         "half_saturation": o.half_saturation, "shape": o.shape, "adstock_decay": o.decay,
                         "interaction": o.interaction,
                         "caused_conversions": float(true_conv[data.channels.index(o.name)])}
                for o in cfg.outside
            }  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (development)")
    ap.add_argument("--skip-truth", action="store_true")
    ap.add_argument(
        "--mmm-full", action="store_true", help="the media-mix model by NUTS (default: quick ADVI)"
    )
    ap.add_argument("--truth-only", nargs="*", metavar="MARKET", default=None,
                    help=f"only the truth check, of these markets (default all: {', '.join(markets(1))}); "
                    "writes attribution_truth_<markets>.json")  # fmt: skip
    ap.add_argument("--only", choices=["paths"], default=None,
                    help="only the sink and path building (figures 1 and 2), printed, no result file "
                    "written (a quick check of path building between full runs)")  # fmt: skip
    args = ap.parse_args()
    settings = Settings()
    if args.truth_only is not None:
        truth_table(settings, args.quick, args.truth_only or None, "full" if args.mmm_full else "quick")
        return
    sink_users = 20_000 if args.quick else 100_000
    if args.only == "paths":
        start = machine()
        part = bench_sink_and_paths(settings, sink_users)
        Console().print({"machine": {**start, "load_avg_1m_end": machine()["load_avg_1m"]}, **part})
        return
    n_models, n_shapley = (20_000, 100_000) if args.quick else (100_000, 1_000_000)
    result: dict[str, Any] = {"machine": machine()}
    result["sink_and_paths"] = bench_sink_and_paths(settings, sink_users)
    result["models"] = bench_models(n_models)
    result["shapley"] = bench_shapley(n_shapley)
    result["shapley_10m"] = bench_shapley(n_shapley * 10, "shapley_10m_paths_s")
    figures = {
        "sink_rows_per_s": result["sink_and_paths"]["sink_rows_per_s"],
        "path_build_events_per_s": result["sink_and_paths"]["path_build_events_per_s"],
        "models_100k_paths_s": result["models"]["models_100k_paths_s"],
        "shapley_1m_paths_s": result["shapley"]["shapley_1m_paths_s"],
        "shapley_10m_paths_s": result["shapley_10m"]["shapley_10m_paths_s"],
    }
    result["figures"] = figures
    result["goals"] = {
        k: {"goal": f"{op} {v}", "met": bool(figures[k] >= v if op == ">=" else figures[k] <= v)}
        for k, (op, v) in GOALS.items()
    }
    table = Table("figure", "value", "goal", "met")
    for k, v in figures.items():
        table.add_row(k, f"{v:,}", result["goals"][k]["goal"], "yes" if result["goals"][k]["met"] else "NO")
    console = Console()
    console.print(table)
    write_result(RESULTS / ("attribution_quick.json" if args.quick else "attribution.json"), result)
    if args.skip_truth:
        return
    truth_table(settings, args.quick, None, "full" if args.mmm_full else "quick")


def truth_table(settings: Settings, quick: bool, only: list[str] | None, mmm: str = "quick") -> None:
    """Run the truth check, print its table and write its result file."""
    truth_result = {"machine": machine(), "markets": truth(settings, 10_000 if quick else 20_000, only, mmm)}
    t = Table("market", "model", "TV error", "per campaign", "curve error", "retarget share",
              "outside share (true)", "Δ true conv. of budget moves: expected", "realised")  # fmt: skip
    for market, body in truth_result["markets"].items():
        for model, r in body["models"].items():
            outside = (
                f"{r['outside_share']:.3f} ({r['true_outside_share']:.3f})" if "outside_share" in r else ""
            )
            per = [f"{r[k]:.3f}" if k in r else "" for k in ("campaign_error", "curve_error")]
            t.add_row(market, model, f"{r['error']:.3f}", *per, f"{r['retarget_share']:.3f}", outside,
                      f"{r.get('budget_moves_expected_conversions_delta', float('nan')):+.1f}",
                      f"{r.get('budget_moves_true_conversions_delta', float('nan')):+.0f}")  # fmt: skip
    Console().print(t)
    stem = "attribution_truth" + (f"_{'_'.join(only)}" if only else "") + ("_quick" if quick else "")
    write_result(RESULTS / f"{stem}.json", truth_result)


if __name__ == "__main__":
    main()
