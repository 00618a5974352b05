"""Attribution runs: build paths, run models, plan budgets, store everything (tables of 003).

`run_attribution` is what `adstream attribution` does; the dashboard reads the stored runs
with `LATEST_RUN_SQL`, `RUN_RESULTS_SQL` and `RUNS_SQL` (importable here, one place for the SQL).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from attribution.channel_lift import measure_design
from attribution.incrementality import calibrate, measure_lift
from attribution.models import AttributionResult, ModelConfig, attribute, check_model
from attribution.paths import AttributionInputError, PathBuild, Window, build_paths, channel_sql, check_range
from attribution.roi import BudgetPlan, channel_spend, plan_budget
from attribution.sql import Backend
from schemas.settings import Settings

RUNS_TABLE, RESULTS_TABLE = "attribution_runs", "attribution_results"

RUNS_SQL = """
SELECT run_id, created_at, since, until, granularity, models, paths, conversions, value, null_paths,
       direct_conversions
FROM attribution_runs
ORDER BY created_at DESC, run_id DESC
LIMIT %(limit)s
"""

LATEST_RUN_SQL = """
SELECT run_id FROM attribution_runs
WHERE granularity = %(granularity)s
ORDER BY created_at DESC, run_id DESC
LIMIT 1
"""

RUN_RESULTS_SQL = """
SELECT model, channel, conversions, value, share, ci_low, ci_high, value_ci_low, value_ci_high,
       spend, roi, cpa, recommended_spend, low_confidence
FROM attribution_results
WHERE run_id = %(run_id)s
ORDER BY model, channel
"""

_RESULT_COLUMNS = (
    "run_id", "created_at", "model", "channel", "conversions", "value", "share", "ci_low", "ci_high",
    "value_ci_low", "value_ci_high", "spend", "roi", "cpa", "recommended_spend", "low_confidence",
)  # fmt: skip
_RUN_COLUMNS = (
    "run_id", "created_at", "since", "until", "granularity", "models", "seed", "bootstrap",
    "click_lookback_s", "view_lookback_s", "journey_gap_s", "paths", "conversions", "value",
    "null_paths", "direct_conversions", "params",
)  # fmt: skip


@dataclass
class Run:
    """One attribution run: inputs, the path build, each model's result and budget plan."""

    run_id: str
    by: str
    since: int
    until: int
    window: Window
    config: ModelConfig
    build: PathBuild
    results: dict[str, AttributionResult] = field(default_factory=dict)
    plans: dict[str, BudgetPlan] = field(default_factory=dict)
    spend: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "by": self.by,
            "since": self.since,
            "until": self.until,
            "paths": self.build.paths.n,
            "conversions": float(self.build.paths.conversions.sum()),
            "value": float(self.build.paths.value.sum()),
            "null_paths": float(self.build.paths.nulls.sum()),
            "direct_conversions": self.build.direct_conversions,
            "seconds": self.seconds,
            "results": {m: r.to_dict() for m, r in self.results.items()},
            "budget": {m: p.to_dict() for m, p in self.plans.items()},
        }


def run_attribution(  # noqa: PLR0913 - keyword-only knobs of one run
    backend: Backend,
    *,
    models: list[str],
    by: str,
    since: int,
    until: int,
    window: Window,
    config: ModelConfig,
    calibrate_holdout: bool = False,
    elasticity: float = 0.5,
    max_change: float = 0.5,
    bounds: dict[str, tuple[float, float]] | None = None,
) -> Run:
    """Build paths, run each model (and its holdout-calibrated variant if asked), plan budgets."""
    check_range(since, until)
    channel_sql(by)
    if not models:
        raise AttributionInputError("no model given")
    for m in models:
        check_model(m)
    t0 = time.perf_counter()
    build = build_paths(backend, by, since, until, window)
    run = Run(uuid.uuid4().hex[:16], by, since, until, window, config, build)
    run.seconds["paths"] = time.perf_counter() - t0
    if build.paths.n == 0 or build.paths.conversions.sum() <= 0:
        raise AttributionInputError(
            f"no conversion paths between {_iso(since)} and {_iso(until)} (by {by}): nothing to attribute"
        )
    run.spend = channel_spend(backend, by, since, until)
    lifts = measure_lift(backend, since, until) if calibrate_holdout else {}
    if calibrate_holdout and not lifts:
        raise AttributionInputError(f"no campaign has holdout users between {_iso(since)} and {_iso(until)}")
    design = measure_design(backend, since, until) if calibrate_holdout else None
    for m in models:
        t1 = time.perf_counter()
        result = attribute(m, build.paths, config)
        run.seconds[m] = time.perf_counter() - t1
        run.results[m] = result
        if calibrate_holdout:
            cal = calibrate(result, lifts, by, design)
            run.results[cal.model] = cal
    for name, result in run.results.items():
        run.plans[name] = plan_budget(
            result, run.spend, elasticity=elasticity, max_change=max_change, bounds=bounds
        )
    return run


def run_and_store(  # noqa: PLR0913 - keyword-only knobs of one run
    backend: Backend,
    settings: Settings,
    *,
    models: list[str],
    by: str,
    since: int,
    until: int,
    bootstrap: int | None = None,
    seed: int | None = None,
    calibrate_holdout: bool = False,
    bounds: dict[str, tuple[float, float]] | None = None,
    store: bool = True,
) -> Run:
    """One run as `adstream attribution` makes it: the window and the model knobs from `settings`
    (`bootstrap` and `seed` override theirs); with `store`, the run is written and the hourly
    rollups of its range refreshed (the dashboards' figures of that range)."""
    overrides = {k: v for k, v in (("bootstrap", bootstrap), ("seed", seed)) if v is not None}
    run = run_attribution(
        backend,
        models=models,
        by=by,
        since=since,
        until=until,
        window=Window.from_settings(settings),
        config=ModelConfig.from_settings(settings, **overrides),
        calibrate_holdout=calibrate_holdout,
        bounds=bounds,
    )
    if store:
        from attribution.rollups import refresh_rollups

        store_run(backend, run)
        refresh_rollups(backend, since, until)
    return run


def store_run(backend: Backend, run: Run) -> None:
    """Write the run and one row per model × channel."""
    now = int(time.time())
    p = run.build.paths
    params = {
        "seconds": run.seconds,
        "window": run.window.__dict__,
        "meta": {m: r.meta for m, r in run.results.items()},
    }
    backend.insert(
        RUNS_TABLE,
        _RUN_COLUMNS,
        [(
            run.run_id, _dt(now), _dt(run.since), _dt(run.until), run.by, list(run.results), run.config.seed,
            run.config.bootstrap, run.window.click_s, run.window.view_s, run.window.gap_s, p.n,
            float(p.conversions.sum()), float(p.value.sum()), float(p.nulls.sum()),
            run.build.direct_conversions, json.dumps(params, default=str),
        )],
    )  # fmt: skip
    rows = []
    for model, result in run.results.items():
        plan = {c.channel: c for c in run.plans[model].channels}
        for r in result.rows():
            c = plan[r.channel]
            rows.append((
                run.run_id, _dt(now), model, r.channel, r.conversions, r.value, r.share, r.ci_low, r.ci_high,
                r.value_ci_low, r.value_ci_high, c.spend, c.roi, c.cpa, c.recommended_spend,
                int(c.low_confidence),
            ))  # fmt: skip
    backend.insert(RESULTS_TABLE, _RESULT_COLUMNS, rows)


def _dt(ts: int) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC).replace(tzinfo=None)


def _iso(ts: int) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")
