"""Benchmark: cold start — ads that arrive mid-stream, and new adapters' informed start.

Both parts replay simulator streams (`workloads.Market`) through the online trainer (the live
code path: `trainers.replay.replay`, micro-batches of `settings.online.micro_batch`, progressive
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

3. **New users** (`new_users`): `--new-users` (1,000) of the market's `--users` (3,000) are
   held out: their events are dropped from the stream the base ranker is trained on, so they
   are never seen in training. Each then makes a first request (slot by the market's shares)
   carrying the interests the simulator has them declare (their true top 2 categories, each
   swapped with probability 0.25: `MarketConfig.declared_error`), over `--candidates` (20)
   ads drawn at random from the catalog, each clicked with its true probability at position 0
   (`Market.true_pctr`, drawn with a seeded generator). The same impressions are scored by:
   `new_user` — the base ranker through serving's own recall and rank input
   (`AdPipeline.recall`, every ad recalled) on the cold-start state serving builds from the
   interests (`AdPipeline.with_interests`, `settings.serving.interest_weight`); `zero_state` —
   the same without interests (a new user today); `*_trained_features` — those states
   featurized as the ranker was trained (`trainers.models.features.featurize`: no recall score, while
   serving adds the recall score and its flag, which training examples never carry);
   `popular` — serving's popular-ads fallback (`Catalog.popular`: (impressions + 1) × bid,
   impressions counted over the training stream); `popular_ctr` — a stronger popularity
   baseline, each ad's smoothed CTR in the training stream; `oracle` — the true probability
   (the ceiling); `true_top` — interests that are exactly the true top 2. Per seed the AUC over
   its new users' impressions; `new_user_auc`, `popular_auc` are the means over seeds (goal:
   new_user > popular); also the AUC pooled over seeds and the mean within-request AUC (`gauc`,
   requests with a click and a non-click), other prior weights (`weight_sweep`; `true_top` and
   the sweep featurized as trained), and what building the prior costs per request (µs).
   Recall's choice of candidates is not measured: every method scores the same ads.

Usage: `.venv/bin/python -m benchmarks.cold_start [--seeds 7 8 9] [--impressions 60000]`;
writes `benchmarks/results/cold_start.json` (`new_ads_auc_gap`, `adapter_init`, `new_user_auc`,
`popular_auc`, `new_user_goal_met`, seeds, machine).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from deploy.machine import describe, machine, write_result
from schemas.api import AdRequest
from schemas.events import SLOTS, AdCreative, Impression
from schemas.ids import adapter_id_for
from schemas.settings import Settings
from schemas.stats import auc
from serving.catalog import Catalog
from serving.pipeline import AdPipeline, UserView, content_vectorizer
from serving.ranking import RankInput, RankModel
from streams.in_memory import training_examples
from trainers.models.features import featurize
from trainers.models.lora import AdapterBank
from trainers.models.ranker import Ranker, RankerConfig, weights_version
from trainers.offline import TrainSpec, train_ranker
from trainers.online import OnlineTrainer
from trainers.replay import impression_order, replay
from workloads import Market, MarketConfig

OUT = Path(__file__).parent / "results" / "cold_start.json"
GOAL_NEW_ADS_GAP = 0.03
NEW_USER_METHODS = (
    "new_user", "zero_state", "popular", "popular_ctr", "oracle", "true_top",
    "new_user_trained_features", "zero_state_trained_features",
)  # fmt: skip
WEIGHTS = (0.25, 0.5, 1.0, 2.0, 4.0)


def _stream(seed: int, impressions: int, settings: Settings) -> tuple[list[Any], set[str], Any]:
    market = Market(MarketConfig(seed=seed, drift_at=None, new_ads_at=0.5))
    initial = {a.ad_id for a in market.catalog()}
    examples = impression_order(training_examples(market.open_loop(impressions), settings))
    return examples, initial, market


def _replay(stream: list[Any], base: Ranker, settings: Settings, pca: Any = None) -> dict[str, np.ndarray]:
    """Progressive scores (online, frozen) and labels of `stream`, in stream order."""
    lora = settings.lora
    bank = AdapterBank(base, lora, weights_version(base))
    if pca is not None:
        bank.init_from_inputs(pca)
    trainer = OnlineTrainer.from_settings(bank, settings, keep_log=True)
    replay(stream, trainer, settings.online.micro_batch)
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


@dataclass(frozen=True)
class _Candidate:
    """One (new user, ad) pair as the ranker reads it (`trainers.models.features.RankerInput`)."""

    user_vector: list[float]
    intent_score: float
    ad_id: str
    advertiser_id: str
    campaign_id: str
    category: str
    slot: str
    hour: int
    recall_score: float | None = None
    query_match: float | None = None  # a cold-start request carries no query
    position: int = 0


def _ranker_scores(
    ranker: Ranker, view: UserView | None, ads: list[AdCreative], slot: str, hour: int, dim: int
) -> np.ndarray:
    vec = np.zeros(dim, dtype=np.float32) if view is None else np.asarray(view.vector, dtype=np.float32)
    intents = {} if view is None else view.intents
    rows = [
        _Candidate(vec.tolist(), float(intents.get(a.category, 0.0)), a.ad_id, a.advertiser_id,
                   a.campaign_id, a.category, slot, hour)
        for a in ads
    ]  # fmt: skip
    return ranker.score(featurize(rows, ranker.config)).numpy()


def _served_scores(pipe: AdPipeline, req: AdRequest, rows: list[int], hour: int) -> np.ndarray:
    """The base ranker's pCTR of catalog `rows` for a new user's request, through serving's own
    recall (every servable ad: `recall.k` ≥ the catalog) and rank input (`AdPipeline.recall`)."""
    rec = pipe.recall(req, None, [], hour)
    assert rec.rank_input is not None and rec.rows.shape[0] == pipe.catalog.n
    at = np.empty(pipe.catalog.n, dtype=np.int64)
    at[rec.rows] = np.arange(rec.rows.shape[0])
    idx = torch.from_numpy(at[rows])
    inp = rec.rank_input
    sub = RankInput(inp.dense[idx], inp.ids[idx], inp.rows[idx])
    return pipe.rank.score([sub], use_adapters=False)[0]


def _gauc(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray) -> float:
    """Mean AUC within requests that have both a click and a non-click."""
    out = []
    for g in np.unique(groups):
        m = groups == g
        if 0 < labels[m].sum() < m.sum():
            out.append(auc(scores[m], labels[m]))
    return float(np.mean(out)) if out else float("nan")


def new_users(seed: int, args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    market = Market(MarketConfig(seed=seed, n_users=args.users, drift_at=None, new_ads_at=None))
    rng = np.random.default_rng([seed, 16])
    held = {market.user_id(int(u)) for u in rng.choice(args.users, size=args.new_users, replace=False)}
    seen = [m for m in market.open_loop(args.impressions) if getattr(m, "user_id", None) not in held]
    examples = impression_order(training_examples(seen, settings))
    assert not held & {e.user_id for e in examples}
    base = _pretrain(examples, settings, seed)
    base.eval()
    dim, hour = settings.state_dim, examples[-1].hour
    catalog = market.catalog()
    pipe = AdPipeline(
        settings,
        RankModel(base, weights_version(base), settings, torch.device("cpu")),
        Catalog(dim, base.config, content_vectorizer(dim)),
    )
    for ad in catalog:
        pipe.add_ad(ad)
    shown = Counter(m.ad_id for m in seen if isinstance(m, Impression))
    clicked = Counter(e.ad_id for e in examples if e.click)
    for ad in catalog:  # the popularity serving would have counted had it served the stream
        pipe.catalog.impressions[pipe.catalog.row_of[ad.ad_id]] = shown[ad.ad_id]
    popular_prior = (pipe.catalog.impressions + 1.0) * pipe.catalog.bid  # Catalog.popular's order
    shares = np.asarray([market.config.slot_share[x] for x in SLOTS], dtype=float)
    scores: dict[str, list[np.ndarray]] = {m: [] for m in (*NEW_USER_METHODS, *(f"w{w}" for w in WEIGHTS))}
    labels, groups, prior_us = [], [], []
    right = 0
    for i, uid in enumerate(sorted(held)):
        slot = SLOTS[int(rng.choice(len(SLOTS), p=shares / shares.sum()))]
        req = AdRequest(user_id=uid, slot=slot, k=market.config.slot_k[slot],
                        interests=list(market.declared_interests(uid)))  # fmt: skip
        picks = [catalog[int(j)] for j in rng.choice(len(catalog), size=args.candidates, replace=False)]
        truth = np.asarray([market.true_pctr(uid, a.ad_id, slot, 0) for a in picks])
        labels.append(rng.random(len(picks)) < truth)
        groups.append(np.full(len(picks), i))
        t = time.perf_counter()
        view = pipe.with_interests(None, req.interests)
        prior_us.append((time.perf_counter() - t) * 1e6)
        taste = market.world.interests[int(uid[1:])]
        top = [market.world.categories[int(c)] for c in np.argsort(-taste)[:2]]
        right += len(set(top) & set(req.interests or []))
        rows = [pipe.catalog.row_of[a.ad_id] for a in picks]
        scores["new_user"].append(_served_scores(pipe, req, rows, hour))
        plain = req.model_copy(update={"interests": None})
        scores["zero_state"].append(_served_scores(pipe, plain, rows, hour))
        scores["new_user_trained_features"].append(_ranker_scores(base, view, picks, slot, hour, dim))
        scores["zero_state_trained_features"].append(_ranker_scores(base, None, picks, slot, hour, dim))
        scores["true_top"].append(
            _ranker_scores(base, pipe.with_interests(None, top), picks, slot, hour, dim)
        )
        scores["popular"].append(popular_prior[rows])
        scores["popular_ctr"].append(
            np.asarray([(clicked[a.ad_id] + 1) / (shown[a.ad_id] + 30) for a in picks])
        )
        scores["oracle"].append(truth)
        for w in WEIGHTS:
            view_w = pipe.with_interests(None, req.interests, weight=w)
            scores[f"w{w}"].append(_ranker_scores(base, view_w, picks, slot, hour, dim))
    return {
        "seed": seed,
        "training_examples": len(examples),
        "new_users": len(held),
        "impressions": int(sum(len(y) for y in labels)),
        "clicks": int(sum(int(y.sum()) for y in labels)),
        "declared_right_share": right / (2 * len(held)),
        "prior_us_p50": float(np.percentile(prior_us, 50)),
        "prior_us_p99": float(np.percentile(prior_us, 99)),
        "_scores": {m: np.concatenate(v) for m, v in scores.items()},
        "_labels": np.concatenate(labels),
        "_groups": np.concatenate(groups) + seed * 10_000_000,
    }


def _new_user_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each method's AUC (the mean of the seeds'; also pooled over them) and mean within-request
    AUC over every seed's new users."""
    y = np.concatenate([r.pop("_labels") for r in runs])
    g = np.concatenate([r.pop("_groups") for r in runs])
    pooled = [r.pop("_scores") for r in runs]
    out: dict[str, Any] = {}
    for m in pooled[0]:
        s = np.concatenate([p[m] for p in pooled])
        per_seed = []
        start = 0
        for r in runs:
            n = r["impressions"]
            per_seed.append(auc(s[start : start + n], y[start : start + n]))
            start += n
        out[m] = {
            "auc": float(np.mean(per_seed)),
            "pooled_auc": auc(s, y),
            "gauc": _gauc(s, y, g),
            "auc_per_seed": per_seed,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[7, 8, 9])
    ap.add_argument("--impressions", type=int, default=60_000)
    ap.add_argument("--new-ad-impressions", type=int, default=1000)
    ap.add_argument("--adapter-examples", type=int, default=2000)
    ap.add_argument("--users", type=int, default=3000, help="new users part: users of the market")
    ap.add_argument("--new-users", type=int, default=1000, help="of them held out of training")
    ap.add_argument("--candidates", type=int, default=20, help="ads scored per new user's first request")
    ap.add_argument("--only", choices=("all", "new_users"), default="all", help="run one part only")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    settings = Settings()
    m0 = machine()
    t0 = time.perf_counter()
    users = [new_users(seed, args, settings) for seed in args.seeds]
    nu = _new_user_summary(users)
    new_user_result = {
        "new_user_auc": nu["new_user"]["auc"],
        "popular_auc": nu["popular"]["auc"],
        "new_user_goal_met": nu["new_user"]["auc"] > nu["popular"]["auc"],
        "new_users": {
            "methods": {m: v for m, v in nu.items() if not m.startswith("w")},
            "weight_sweep": {m[1:]: v for m, v in nu.items() if m.startswith("w")},
            "serve_interest_weight": settings.serving.interest_weight,
            "users": args.users,
            "new_users_per_seed": args.new_users,
            "candidates": args.candidates,
            "per_seed": users,
        },
    }
    if args.only == "new_users":
        old = json.loads(args.out.read_text()) if args.out.exists() else {}
        old.pop("new_user_note", None)
        old.update({k: v for k, v in new_user_result.items() if k != "new_users"})
        part = {**new_user_result["new_users"], "machine": m0, "seeds": args.seeds}
        part["wall_s"] = round(time.perf_counter() - t0, 1)
        write_result(args.out, part, section="new_users", base=old)
        _print_new_users(nu, args.seeds, m0)
        return
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
        **new_user_result,
        "settings": {"lora_targets": list(settings.lora.targets), "micro_batch": settings.online.micro_batch},
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
    _print_new_users(nu, args.seeds, m0)
    write_result(args.out, result)


def _print_new_users(nu: dict[str, Any], seeds: list[int], m0: dict[str, Any]) -> None:
    table = Table(title=f"New users' first request, seeds {seeds} ({describe(m0)})")
    for col in ("ranking", "AUC", "within-request AUC"):
        table.add_column(col)
    for m, v in nu.items():
        table.add_row(m, f"{v['auc']:.4f}", f"{v['gauc']:.4f}")
    Console().print(table)


if __name__ == "__main__":
    main()
