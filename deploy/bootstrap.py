"""Starting the loop from nothing (`adstream init`) and waiting for what it makes.

`adstream init` is the deployment's one-shot first step (compose `init` service, k8s Job
`adstream-init`): it creates the contract topics and the ClickHouse database, applies the
migrations, and provisions the base model under `model_dir` unless one is there already:

* **from history** when ClickHouse holds at least `min_examples` labelled impressions (with at
  least `min_clicks` clicks): the ranker and the two-tower recall model with its ad index,
  exactly as `adstream train --clickhouse` trains them;
* otherwise the **cold-start model**: a ranker trained on a simulated history of the built-in
  market simulator (`workloads.Market`, seed `COLD_START_SEED`). It knows the generic shape of
  click-through (position and slot effects, the match between a user's recent interest in a
  category and an ad's category) but nothing about this deployment's ads, so no two-tower model
  or ad index is written (the replicas recall without one) and `model_dir/base_model.json` says
  `"source": "cold-start"`. Once real history has accumulated, `adstream init --retrain` (or
  `adstream train --clickhouse`) replaces it; the online trainer then learns on top of the new base.

The trainer and the Serve replicas wait for the checkpoint (`wait_for_model`) instead of failing
or serving an untrained ranker.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from schemas.errors import ModelError
from schemas.settings import Settings

log = logging.getLogger(__name__)

ORIGIN_FILE = "base_model.json"
COLD_START_SEED = 20_240_601


@dataclass(frozen=True)
class InitSpec:
    """How `adstream init` provisions the base model."""

    min_examples: int = 2_000  # labelled impressions in ClickHouse to train from history
    min_clicks: int = 20
    cold_start_impressions: int = 12_000  # simulated history of the cold-start model
    epochs: int = 3
    retrain: bool = False  # train again even when a checkpoint exists
    threads: int = 2


def ranker_checkpoint(model_dir: Path) -> Path | None:
    """The ranker checkpoint under `model_dir` (`ranker/`, or the folder itself), as serving looks."""
    from trainers.models.ranker import CONFIG_FILE

    for candidate in (model_dir / "ranker", model_dir):
        if (candidate / CONFIG_FILE).exists():
            return candidate
    return None


def base_model_origin(model_dir: Path) -> dict[str, Any] | None:
    """What `adstream init` recorded about the base model (None: not made by init)."""
    try:
        data = json.loads((model_dir / ORIGIN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def wait_for_model(
    settings: Settings,
    timeout_s: float,
    say: Callable[[str], None],
    checkpoint: Path | None = None,
    every_s: float = 10.0,
) -> Path:
    """Block until a ranker checkpoint exists (under `checkpoint`, else `settings.model_dir`),
    saying so every `every_s` seconds; ModelError after `timeout_s` (0: do not wait)."""
    where = checkpoint or settings.model_dir
    t0 = time.monotonic()
    said = -every_s
    while True:
        found = ranker_checkpoint(where)
        if found is not None:
            if said >= 0:  # it did wait: say when the model came
                say(f"base model found at {found} after {time.monotonic() - t0:.0f}s")
            return found
        waited = time.monotonic() - t0
        if timeout_s > 0 and waited - said >= every_s:
            say(
                f"waiting for the base model under {where} (written by `adstream init`): "
                f"{waited:.0f}s of {timeout_s:.0f}s"
            )
            said = waited
        if waited >= timeout_s:
            raise ModelError(
                f"no ranker checkpoint under {where} after {waited:.0f}s: run `adstream init` "
                "(or `adstream train`) first, or raise --wait-for-model"
            )
        time.sleep(min(1.0, max(0.05, timeout_s - waited)))


def history_size(settings: Settings) -> tuple[int, int]:
    """Impressions and clicks in ClickHouse's raw event tables (0, 0 when the tables are empty)."""
    from schemas.clients import clickhouse_client, clickhouse_database

    client = clickhouse_client(settings, clickhouse_database(settings))
    try:
        (imps,) = client.execute("SELECT count() FROM impressions")[0]
        (clicks,) = client.execute("SELECT count() FROM clicks")[0]
    finally:
        client.disconnect()
    return int(imps), int(clicks)


def _write_origin(model_dir: Path, origin: dict[str, Any]) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    tmp = model_dir / f".{ORIGIN_FILE}.tmp"
    tmp.write_text(json.dumps(origin, indent=2, default=str) + "\n")
    tmp.replace(model_dir / ORIGIN_FILE)


def cold_start_events(n_impressions: int, seed: int = COLD_START_SEED) -> list[Any]:
    """The cold-start model's simulated history: `n_impressions` impressions of the simulator's
    market (no drift, no new ads) with their clicks, dwell and the catalog."""
    from workloads import Market, MarketConfig

    market = Market(MarketConfig(seed=seed, drift_at=None, new_ads_at=None, n_new_ads=0))
    return list(market.open_loop(n_impressions))


def _train(settings: Settings, events: list[Any], spec: InitSpec, two_tower: bool) -> dict[str, Any]:
    """Train into a staging folder next to `model_dir`, then move the checkpoints in: a trainer or
    replica waiting on `model_dir/ranker` never sees a half-written checkpoint."""
    import shutil

    from deploy.training_data import examples_from_events
    from trainers.models.ranker import resolve_device, slot_buckets_for
    from trainers.offline import TrainSpec
    from trainers.train_all import set_threads, train_all

    set_threads(spec.threads)
    examples, catalog = examples_from_events(events, settings)
    model_dir = settings.model_dir
    staging = model_dir / f".init-{int(time.time())}"
    shutil.rmtree(staging, ignore_errors=True)
    device = str(resolve_device(settings.device))
    report = train_all(
        examples,
        catalog,
        staging,
        state_dim=settings.state_dim,
        spec=TrainSpec(epochs=spec.epochs, device=device),
        two_tower=two_tower,
        baseline=False,
        slot_buckets=slot_buckets_for(settings.slots.names),
    )
    for part in ("two_tower", "ranker"):  # the ranker last: its presence is what waiters look for
        if (staging / part).exists():
            shutil.rmtree(model_dir / part, ignore_errors=True)
            (staging / part).replace(model_dir / part)
    if (staging / "train_report.json").exists():
        (staging / "train_report.json").replace(model_dir / "train_report.json")
    shutil.rmtree(staging, ignore_errors=True)
    return report


def provision_base_model(settings: Settings, spec: InitSpec, say: Callable[[str], None]) -> dict[str, Any]:
    """Leave a base model under `settings.model_dir`: the one there, one trained on ClickHouse's
    history, or the cold-start model. Returns what was done (also in `base_model.json`)."""
    existing = ranker_checkpoint(settings.model_dir)
    if existing is not None and not spec.retrain:
        kept = base_model_origin(settings.model_dir) or {"source": "existing"}
        say(f"base model already at {existing} ({kept.get('source')}): kept")
        return {**kept, "action": "kept"}
    imps, clicks = history_size(settings)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    if imps >= spec.min_examples and clicks >= spec.min_clicks:
        from deploy.training_data import events_from_clickhouse

        say(f"training the base model on ClickHouse's history ({imps:,} impressions, {clicks:,} clicks)")
        events = events_from_clickhouse(settings, None)
        report = _train(settings, events, spec, two_tower=True)
        origin: dict[str, Any] = {"source": "clickhouse", "impressions": imps, "clicks": clicks}
    else:
        say(
            f"ClickHouse holds {imps:,} impressions / {clicks:,} clicks (< {spec.min_examples:,} / "
            f"{spec.min_clicks}): training the cold-start model on {spec.cold_start_impressions:,} "
            f"simulated impressions (seed {COLD_START_SEED})"
        )
        events = cold_start_events(spec.cold_start_impressions)
        report = _train(settings, events, spec, two_tower=False)
        origin = {"source": "cold-start", "simulated_impressions": spec.cold_start_impressions,
                  "seed": COLD_START_SEED, "history_impressions": imps, "history_clicks": clicks}  # fmt: skip
    origin |= {
        "trained_at": started,
        "ranker_version": report["ranker"]["version"],
        "holdout_auc": report["ranker"]["auc"],
        "examples": report["examples"],
    }
    _write_origin(settings.model_dir, origin)
    auc = origin["holdout_auc"]
    say(f"base model {origin['ranker_version']} ({origin['source']}), holdout AUC {auc:.3f}")
    return {**origin, "action": "trained"}


def init(settings: Settings, spec: InitSpec, say: Callable[[str], None]) -> dict[str, Any]:
    """Topics, database, migrations, base model: everything the loop's services wait for."""
    from attribution.migrate import migrate
    from deploy.stack import create_database, create_topics
    from schemas.clients import require_kafka

    require_kafka(settings)
    created = create_topics(settings)
    say(f"topics created: {', '.join(created) or 'none (all exist)'}")
    create_database(settings)
    applied = migrate(settings)
    say(f"ClickHouse migrations applied: {', '.join(applied) or 'none (up to date)'}")
    model = provision_base_model(settings, spec, say)
    return {"topics_created": created, "migrations_applied": applied, "model": model}
