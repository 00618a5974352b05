"""Benchmark: cold start — ads that arrive mid-stream, and new adapters' informed start.

Both parts replay simulator streams (`workloads.Market`) through the online trainer (the live
code path: `trainers.replay.replay`, micro-batches of `settings.micro_batch`, progressive
validation: every example is scored before it is learned), on the same seeds for every variant.

1. **New ads** (`new_ads`): `n_new_ads` creatives arrive half-way (`new_ads_at=0.5`, no drift).
   The base ranker is trained offline on the examples before they arrive; the rest is replayed
   online under the slot scheme. Per seed: the AUC over the new ads' first `--new-ad-impressions`
   impressions (1,000) and the established ads' AUC over the same stretch of the stream, for the
   online model and the frozen base. `new_ads_auc_gap` = established − new (online; mean of
   seeds); goal ≤ 0.03.
2. **Adapter init** (`adapter_init`): under the `advertiser` scheme every advertiser's adapter
   is new when the replay starts. Each Linear target's `lora_A` starts either from PEFT's
   seeded random rows (`zero`: B = 0, the adapter equals the base) or from the principal
   directions of that layer's input over the pretraining examples (`pca`:
   `AdapterBank.init_from_inputs`, B = 0 too). Per adapter the progressive AUC over its first
   `--adapter-examples` examples (2,000); the mean over adapters and seeds, and the gain over
   the frozen base.

A brand-new user ranked from request context only (declared interests) is not measured here:
the request has no such field yet (README, limitations).

Usage: `.venv/bin/python benchmarks/cold_start.py [--seeds 7 8 9] [--impressions 60000]`;
writes `benchmarks/results/cold_start.json` (`new_ads_auc_gap`, `adapter_init`, seeds, machine).
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from deploy.machine import describe, machine
from schemas.ids import adapter_id_for
from schemas.settings import Settings
from schemas.stats import auc
from streams.offline import training_examples
from trainers.features import featurize
from trainers.lora import AdapterBank, LoraSpec
from trainers.offline import TrainSpec, train_ranker
from trainers.online import OnlineSpec, OnlineTrainer
from trainers.ranker import Ranker, RankerConfig, weights_version
from trainers.replay import impression_order, replay
from workloads import Market, MarketConfig

OUT = Path(__file__).parent / "results" / "cold_start.json"
GOAL_NEW_ADS_GAP = 0.03


def _stream(seed: int, impressions: int, settings: Settings) -> tuple[list[Any], set[str], Any]:
    market = Market(MarketConfig(seed=seed, drift_at=None, new_ads_at=0.5))
    initial = {a.ad_id for a in market.catalog()}
    examples = impression_order(training_examples(market.open_loop(impressions), settings))
    return examples, initial, market


def _replay(stream: list[Any], base: Ranker, settings: Settings, pca: Any = None) -> dict[str, np.ndarray]:
    """Progressive scores (online, frozen) and labels of `stream`, in stream order."""
    lora = LoraSpec.from_settings(settings)
    bank = AdapterBank(base, lora, weights_version(base))
    if pca is not None:
        bank.init_from_inputs(pca)
    trainer = OnlineTrainer(bank, OnlineSpec.from_settings(settings), keep_log=True)
    replay(stream, trainer, settings.micro_batch)
    lg = trainer.log
    assert lg is not None
    order = {iid: i for i, iid in enumerate(e.impression_id for e in stream)}
    idx = np.argsort([order[i] for i in lg.impression_ids])
    return {
        "online": np.asarray(lg.online)[idx],
        "frozen": np.asarray(lg.base)[idx],
        "labels": np.asarray(lg.labels)[idx],
    }


def _pretrain(examples: list[Any], settings: Settings, seed: int) -> Ranker:
    torch.manual_seed(seed)
    return train_ranker(examples, RankerConfig(state_dim=settings.state_dim), TrainSpec(epochs=6, seed=seed))


def new_ads(seed: int, args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    examples, initial, _ = _stream(seed, args.impressions, settings)
    first_new = next(i for i, e in enumerate(examples) if e.ad_id not in initial)
    pre, stream = examples[:first_new], examples[first_new:]
    base = _pretrain(pre, settings, seed)
    got = _replay(stream, base, settings)
    is_new = np.asarray([e.ad_id not in initial for e in stream])
    new_idx = np.flatnonzero(is_new)[: args.new_ad_impressions]
    lo, hi = int(new_idx[0]), int(new_idx[-1]) + 1
    est_idx = np.flatnonzero(~is_new[lo:hi]) + lo
    y = got["labels"]
    out: dict[str, Any] = {
        "seed": seed,
        "pretrain_examples": len(pre),
        "new_ad_impressions": len(new_idx),
        "new_ad_clicks": int(y[new_idx].sum()),
        "established_impressions_same_stretch": len(est_idx),
    }
    for model in ("online", "frozen"):
        a_new, a_est = auc(got[model][new_idx], y[new_idx]), auc(got[model][est_idx], y[est_idx])
        out[model] = {"new_auc": a_new, "established_auc": a_est, "gap": a_est - a_new}
    return out


def adapter_init(seed: int, args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    s = settings.model_copy(update={"adapter_scheme": "advertiser"})
    market = Market(MarketConfig(seed=seed, drift_at=None, new_ads_at=None))
    examples = impression_order(training_examples(market.open_loop(args.impressions), s))
    examples = [
        e.model_copy(update={"adapter_id": adapter_id_for(e.slot, e.advertiser_id, "advertiser")})
        for e in examples
    ]
    n_pre = len(examples) // 3
    pre, stream = examples[:n_pre], examples[n_pre:]
    base = _pretrain(pre, s, seed)
    pca_batch = featurize(pre[-4096:], base.config)
    runs = {"zero": _replay(stream, base, s), "pca": _replay(stream, base, s, pca=pca_batch)}
    adapters = np.asarray([e.adapter_id for e in stream])
    per: dict[str, dict[str, list[float]]] = {k: {"online": [], "frozen": []} for k in runs}
    for aid in sorted(set(adapters.tolist())):
        idx = np.flatnonzero(adapters == aid)[: args.adapter_examples]
        for name, got in runs.items():
            y = got["labels"][idx]
            if 0 < y.sum() < len(y):
                per[name]["online"].append(auc(got["online"][idx], y))
                per[name]["frozen"].append(auc(got["frozen"][idx], y))
    return {
        "seed": seed,
        "adapters": len(set(adapters.tolist())),
        **{
            name: {
                "mean_auc": float(np.mean(v["online"])),
                "frozen_mean_auc": float(np.mean(v["frozen"])),
                "gain_over_frozen": float(np.mean(v["online"]) - np.mean(v["frozen"])),
                "adapters_scored": len(v["online"]),
            }
            for name, v in per.items()
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[7, 8, 9])
    ap.add_argument("--impressions", type=int, default=60_000)
    ap.add_argument("--new-ad-impressions", type=int, default=1000)
    ap.add_argument("--adapter-examples", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    settings = Settings()
    m0 = machine()
    t0 = time.perf_counter()
    ads = [new_ads(seed, args, settings) for seed in args.seeds]
    inits = [adapter_init(seed, args, settings) for seed in args.seeds]
    gap = float(np.mean([r["online"]["gap"] for r in ads]))
    result = {
        "benchmark": "cold_start",
        "seeds": args.seeds,
        "impressions": args.impressions,
        "new_ads_auc_gap": gap,
        "new_ads_auc_gap_frozen": float(np.mean([r["frozen"]["gap"] for r in ads])),
        "goal_new_ads_auc_gap": GOAL_NEW_ADS_GAP,
        "new_ads_goal_met": gap <= GOAL_NEW_ADS_GAP,
        "new_ads": ads,
        "adapter_init": {
            "zero_mean_auc": float(np.mean([r["zero"]["mean_auc"] for r in inits])),
            "pca_mean_auc": float(np.mean([r["pca"]["mean_auc"] for r in inits])),
            "frozen_mean_auc": float(np.mean([r["zero"]["frozen_mean_auc"] for r in inits])),
            "per_seed": inits,
        },
        "new_user_auc": None,
        "popular_auc": None,
        "new_user_note": "not measured: AdRequest has no declared-interests field yet",
        "settings": {"lora_targets": list(settings.lora_targets), "micro_batch": settings.micro_batch},
        "machine": m0,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    table = Table(title=f"Cold start, seeds {args.seeds} ({describe(m0)})")
    for col in ("measure", "online", "frozen"):
        table.add_column(col)
    for r in ads:
        table.add_row(
            f"seed {r['seed']}: new ads AUC / established",
            f"{r['online']['new_auc']:.3f} / {r['online']['established_auc']:.3f}",
            f"{r['frozen']['new_auc']:.3f} / {r['frozen']['established_auc']:.3f}",
        )
    table.add_row("new-ads gap (mean)", f"{gap:.3f}", f"{result['new_ads_auc_gap_frozen']:.3f}")
    ai = result["adapter_init"]
    table.add_row(
        "new adapters, first examples: zero init",
        f"{ai['zero_mean_auc']:.4f}",
        f"{ai['frozen_mean_auc']:.4f}",
    )
    table.add_row("new adapters, first examples: PCA init", f"{ai['pca_mean_auc']:.4f}", "")
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
