"""Offline training end to end: examples (+ catalog) in, checkpoints, ad index and a report out.

`train_all(examples, catalog, out_dir, ...)` splits by impression time, trains the ranker and
the two-tower model on the earlier part, evaluates both (and a logistic-regression baseline) on
the later part, and writes under `out_dir`:
`ranker/` (ranker checkpoint), `two_tower/` (two-tower checkpoint + `ad_index.*`) and
`train_report.json`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from schemas.errors import ConfigError
from schemas.events import AdCreative, TrainingExample
from trainers.baseline import auc_diff_ci, logistic_probs
from trainers.models.features import featurize
from trainers.models.ranker import RankerConfig, save_checkpoint
from trainers.models.text import TitleEncoder
from trainers.models.two_tower import (
    TwoTowerConfig,
    build_ad_index,
    evaluate_two_tower,
    save_ad_index,
    save_two_tower,
    tower_batch,
    train_two_tower,
)
from trainers.offline import TrainSpec, evaluate, predict, time_split, train_ranker
from trainers.quality import auc, logloss

log = logging.getLogger(__name__)


def train_all(  # noqa: PLR0913 - examples, catalog and out dir, then keyword-only knobs
    examples: Sequence[TrainingExample],
    catalog: Mapping[str, AdCreative],
    out_dir: Path,
    *,
    state_dim: int,
    spec: TrainSpec | None = None,
    two_tower: bool = True,
    baseline: bool = True,
    encoder: TitleEncoder | None = None,
    slot_buckets: int = 0,
) -> dict[str, Any]:
    """Train, evaluate on the time-ordered holdout, write artefacts; returns the report.
    `slot_buckets`: hashed rows for slots beyond the defaults (`slot_buckets_for` the configured)."""
    if len(examples) < 10:
        raise ConfigError(f"need at least 10 training examples (got {len(examples)})")
    spec = spec or TrainSpec()
    train, hold = time_split(examples, spec.holdout)
    cfg = RankerConfig(state_dim=state_dim, slot_buckets=slot_buckets)
    t0 = time.perf_counter()
    train_b, hold_b = featurize(train, cfg), featurize(hold, cfg)
    ranker = train_ranker(train_b, cfg, spec)
    ranker_s = time.perf_counter() - t0
    res = evaluate(ranker, hold_b)
    version = save_checkpoint(ranker, out_dir / "ranker")
    report: dict[str, Any] = {
        "examples": len(examples),
        "train": len(train),
        "holdout": len(hold),
        "holdout_positives": res.positives,
        "holdout_from": hold[0].impression_ts.isoformat() if hold else None,
        "ranker": {
            "version": version,
            "auc": res.auc,
            "logloss": res.logloss,
            "train_s": round(ranker_s, 2),
            "config": asdict(cfg),
            "spec": asdict(spec),
        },
    }
    log.info("ranker holdout AUC %.4f logloss %.4f", res.auc, res.logloss)
    if baseline and hold_b.label is not None:
        y = hold_b.label.numpy()
        lr_p = logistic_probs(train_b, hold_b, seed=spec.seed)
        lo, hi = auc_diff_ci(predict(ranker, hold_b).numpy(), lr_p, y, seed=spec.seed)
        report["logistic_baseline"] = {"auc": auc(lr_p, y), "logloss": logloss(lr_p, y)}
        report["ranker_minus_lr_auc_ci95"] = [lo, hi]
        log.info("LR baseline holdout AUC %.4f; ranker − LR 95%% CI [%.4f, %.4f]", auc(lr_p, y), lo, hi)
    if two_tower:
        encoder = encoder or TitleEncoder()
        tcfg = TwoTowerConfig(state_dim=state_dim, slot_buckets=slot_buckets)
        t1 = time.perf_counter()
        tower = train_two_tower(tower_batch(train, catalog, encoder, tcfg), tcfg, seed=spec.seed)
        tt_auc = evaluate_two_tower(tower, tower_batch(hold, catalog, encoder, tcfg))
        tt_version = save_two_tower(tower, out_dir / "two_tower")
        ids, vecs = build_ad_index(tower, list(catalog.values()), encoder)
        save_ad_index(ids, vecs, out_dir / "two_tower", tt_version)
        report["two_tower"] = {
            "version": tt_version,
            "auc": tt_auc,
            "ads_indexed": len(ids),
            "train_s": round(time.perf_counter() - t1, 2),
        }
        log.info("two-tower holdout AUC %.4f; %d ads indexed", tt_auc, len(ids))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train_report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


def set_threads(n: int) -> None:
    """Bound torch's CPU threads (the machine is shared)."""
    torch.set_num_threads(max(1, n))
