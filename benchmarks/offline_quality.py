"""Benchmark: offline ranker quality — simulator (ranker, LR, oracle, per-user ceiling) and OBD.

Everything goes through the real pipeline: contract events → `streams.in_memory.training_examples`
(the streams label join and user state, the live worker's code) → `trainers.offline` (time-ordered
split, `train_ranker`, `predict`) and `trainers.baseline` (LR on the ranker's own features, the
paired-bootstrap CI of the AUC difference).

**Simulator** (`workloads.Market`, open loop, random logging policy). For every config of
`--configs` and every seed of `--seeds`: the last `--holdout` (20 %) of the examples by impression
time is held out; on the same holdout rows we score
- `ranker`: `train_ranker` with the default `TrainSpec` (seeded);
- `lr`: `trainers.baseline.logistic_probs` on the same split;
- `oracle`: the simulator's true click probability of each impression (`market.oracle_pctr`);
- `ceiling`: an estimate of the best AUC reachable from per-user data — the posterior-predictive
  click probability of a Bayes estimator that knows the true generative model (the prior of
  tastes: `favorite_categories` favourites with `favorite_boost` plus N(0, `interest_noise`²)
  noise, and the drift's time and share) and every non-user effect exactly (ad quality,
  advertiser, slot, position, bias), and learns the user's tastes only from that user's own
  earlier impressions and clicks (exact over the favourite sets, Gauss–Hermite over the noise).
  It ignores dwell (a little information) and sees each click as soon as its impression is
  shown, so it is a near-upper bound, not a strict one. `oracle − ceiling` is the part of the
  gap no learner can close with this much data per user; `ceiling − ranker` is what is left.
- `served`: what a replica serves at the defaults — the ranker plus the streams worker's
  per-user correction (`state.feedback_lr`, replayed by `streams.in_memory.corrected_scores`),
  learned over each user's whole history as the user state carries it (`auc_served_warm`;
  the correction meets the holdout already learned, as the ceiling meets it with the user's
  whole history; the ranker's scores on the training rows are in-sample), and the same with the
  correction starting from zero at the holdout (`auc_served`, a lower bound no deployment has).
  The issue's key `ceiling_gap_defaults` is ceiling − served (warm), mean of the `default`
  seeds; `ceiling_gap_defaults_cold` the lower bound's, `_ranker_alone` without the correction.
  `--feedback-lrs 0.5,1` also scores the correction at those steps (tuning: run it on seeds
  kept apart from the reporting ones; `feedback_lrs` per run and in the summary).

Configs (impressions = users × per-user count; the rest is `MarketConfig`'s defaults):
- `default`: 1000 users × 200 (the simulator's defaults; drift and new ads half-way);
- `rich`: `--rich-users` (20) users × `--rich-per-user` (10,000), no drift. Why: the same
  200,000 impressions (same cost) with enough clicks per user (~100) that the ceiling comes
  within ~0.005 of the oracle, so the remaining gap measures the ranker, not the data. Drift is
  off because the market's default rate (100 requests/s) packs the whole run into ~12 simulated
  minutes, far below the state's 1 h intent half-life: a user who redraws tastes keeps the old
  ones in the state for the whole holdout, which caps any state-based model (not the oracle);
- `rich-drift` (opt-in): `rich` with the default drift, to show that cap;
- `u<N>x<M>` (opt-in, e.g. `u200x1000`): N users × M impressions each, no drift (as `rich`) — a
  learning curve in data per user: `--configs u1000x200,u200x1000,u50x4000,u20x10000,u20x20000`
  shows how the oracle − ceiling and oracle − ranker gaps close as each user's history grows.

**Open Bandit Dataset** (`workloads.obd`, the six files of `obp==0.4.1`: 60,000 impressions,
287 clicks). Each file alone holds ~40 clicks, so a 20 % holdout has ~8: no comparison. The six
logs cover the same week and are pooled into one time-ordered stream (item ids made
campaign-specific, since each campaign numbers its items from 0; cohorts keep their ids), then
evaluated with rolling-origin folds (`--obd-origins` 0.5…0.9: train on everything before the
origin, score the next block; a fresh ranker and LR per fold on the same rows). The pooled
out-of-fold predictions (~144 clicks) give both AUCs and the paired-bootstrap 95 % CI of
ranker − LR; `per_file` splits those rows by source file; `standalone` (skip with
`--no-obd-standalone`) repeats the folds on each file alone.

**User tower** (`--user-tower decayed|gru|both`, issue 16): instead of the parts above, the
decayed-state ranker (today's `train_ranker`) and/or rankers with the sequence user tower
(`RankerConfig(user_tower="gru")`, one per `--tower-seq-lens` × `--tower-hidden`, trained by
`trainers.sequence_training`) on the same seeds, split and holdout rows (configs: `default`
unless `--configs` says otherwise). Per run: holdout AUC, ceiling and oracle gaps, the paired-
bootstrap CI of gru − decayed, train seconds, the tower's mean gate weights, and the rank-time
cost of one request of `--rank-candidates` (500) candidates (the tower runs once per request).
Writes `benchmarks/results/offline_quality_user_tower.json` unless `--out` is given. One seed
with six tower variants took ~5 minutes (two seeds side by side on 2 cores); run seeds as
separate processes and `--merge` their files (`--rank-cost` re-times one request per variant in
the merging process, alone on the machine).

Usage: `.venv/bin/python -m benchmarks.offline_quality [--part sim|obd|all] [--seeds 0,1]
[--configs default,rich] [--impression-weight W] [--no-obd-standalone] [--out PATH]
[--user-tower both --tower-seq-lens 16,32 --tower-hidden 32]`; writes
`benchmarks/results/offline_quality.json`. About 9 minutes on 2 busy cores: each simulator run
~1.5 minutes (a third of it making the examples), the OBD part ~2.5.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import math
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from deploy.machine import machine, write_result
from schemas.events import AdCreative, Click, Impression, Message, TrainingExample
from schemas.settings import EngagementSettings, Settings, StateSettings
from streams.in_memory import corrected_scores, training_examples
from streams.processor import Processor
from trainers.baseline import auc_diff_ci, logistic_probs
from trainers.models.features import RankerBatch, featurize
from trainers.models.ranker import Ranker, RankerConfig
from trainers.models.user_tower import MODALITIES, UserSequences, build_sequences
from trainers.offline import TrainSpec, predict, time_split, train_ranker
from trainers.quality import auc
from trainers.sequence_training import mean_gate, predict_with_sequences, train_tower_ranker
from workloads import Market, MarketConfig
from workloads.obd import CAMPAIGNS, POLICIES, replay_obd

OUT = Path(__file__).parent / "results" / "offline_quality.json"
GOAL_CEILING_GAP = 0.01  # issue 16: served holdout AUC within this of the per-user Bayes ceiling
OUT_TOWER = Path(__file__).parent / "results" / "offline_quality_user_tower.json"
console = Console(width=150)


# -- the per-user Bayes ceiling ------------------------------------------------------------
class _History:
    """Log-likelihood of some of a user's clicks per category × favourite? × noise node, with its
    marginal over the noise nodes kept up to date row by row."""

    def __init__(self, n_cat: int, log_w: np.ndarray) -> None:
        self.log_w = log_w
        self.ll = np.zeros((n_cat, 2, len(log_w)))
        self.log_m = np.zeros((n_cat, 2))  # log Σ_g w_g exp(ll): the marginal over the noise

    def add(self, cat: int, loglik: np.ndarray) -> None:
        self.ll[cat] += loglik
        self.log_m[cat] = np.logaddexp.reduce(self.ll[cat] + self.log_w, axis=1)

    def predictive(self, cat: int, logits: np.ndarray, sets: np.ndarray) -> tuple[float, float]:
        """(posterior-predictive click probability in `cat`, log marginal likelihood).

        `logits` [2, G]: this impression's click logit per (favourite?, noise node); `sets` [S, C]:
        every possible set of favourite categories as a 0/1 row (a uniform prior over them).
        """
        log_m = self.log_m
        scores = log_m[:, 0].sum() + sets @ (log_m[:, 1] - log_m[:, 0])  # [S]
        log_z = float(np.logaddexp.reduce(scores))
        p_fav = float(np.exp(np.logaddexp.reduce(scores[sets[:, cat] == 1]) - log_z))
        p = 0.0
        for fav, share in ((0, 1.0 - p_fav), (1, p_fav)):
            node_post = np.exp(self.ll[cat, fav] + self.log_w - log_m[cat, fav])
            p += share * float((node_post / (1.0 + np.exp(-logits[fav]))).sum())
        return p, log_z


def bayes_ceiling(
    market: Market, examples: Sequence[TrainingExample], holdout_ids: set[str], nodes: int = 15
) -> dict[str, float]:
    """Posterior-predictive pCTR of each holdout impression from its user's earlier clicks.

    The estimator knows the market's true model except each user's tastes (see the module
    docstring); impressions are processed in emission order, each updating its user's posterior
    after it is scored. After the drift it mixes "kept the tastes" (all history) and "redrew
    them" (history since the drift) by their marginal likelihoods and the drift share.
    Returns impression id → probability for the ids in `holdout_ids`.
    """
    cfg, world = market.config, market.world
    cat_index = {c: i for i, c in enumerate(world.categories)}
    ad_index = {a: i for i, a in enumerate(world.ads.ad_ids)}
    n_cat = cfg.n_categories
    z, w = np.polynomial.hermite_e.hermegauss(nodes)
    log_w = np.log(w / w.sum())
    interest = np.array([0.0, cfg.favorite_boost])[:, None] + (z * cfg.interest_noise)[None, :]
    sets = np.array(
        [
            [1.0 if c in s else 0.0 for c in range(n_cat)]
            for s in itertools.combinations(range(n_cat), cfg.favorite_categories)
        ]
    )
    pos_bias = np.asarray(cfg.position_bias)
    drift_at = market.drift_impression
    share = cfg.drift_share if drift_at is not None else 0.0
    users: dict[str, tuple[_History, _History, _History]] = {}  # all, before, since the drift
    out: dict[str, float] = {}
    # emission order: impression ids are the market's event counter, zero-padded
    for k, ex in enumerate(sorted(examples, key=lambda e: e.impression_id)):
        ad = ad_index[ex.ad_id]
        cat = cat_index[ex.category]
        offset = (
            world.ads.quality[ad]
            + world.advertiser_effect[world.ads.advertiser[ad]]
            + cfg.slot_effect[ex.slot]
            + pos_bias[min(ex.position, len(pos_bias) - 1)]
            + cfg.bias
        )
        logits = cfg.interest_scale * interest + offset
        if ex.user_id not in users:
            users[ex.user_id] = (_History(n_cat, log_w), _History(n_cat, log_w), _History(n_cat, log_w))
        every, before, since = users[ex.user_id]
        after = drift_at is not None and k >= drift_at
        if ex.impression_id in holdout_ids:
            p, log_z = every.predictive(cat, logits, sets)
            if after and 0 < share < 1:  # a mixture: the user kept or redrew their tastes
                p_new, log_z_since = since.predictive(cat, logits, sets)
                _, log_z_before = before.predictive(cat, logits, sets)
                kept = math.log(1 - share) + log_z
                redrawn = math.log(share) + log_z_before + log_z_since
                w_redrawn = 1.0 / (1.0 + math.exp(min(700.0, kept - redrawn)))
                p = (1 - w_redrawn) * p + w_redrawn * p_new
            elif after and share >= 1:
                p, _ = since.predictive(cat, logits, sets)
            out[ex.impression_id] = p
        loglik = -np.logaddexp(0.0, -logits) if ex.click else -np.logaddexp(0.0, logits)
        every.add(cat, loglik)
        (since if after else before).add(cat, loglik)
    return out


def examples_of(
    events: Sequence[Message], settings: Settings, impression_weight: float | None
) -> list[TrainingExample]:
    """`streams.in_memory.training_examples` (the worker's state and label join); with
    `impression_weight`, the same with that impression weight in the user state (an ablation)."""
    if impression_weight is None:
        return list(training_examples(events, settings))
    proc = Processor.from_settings(settings)
    weights = proc.params.weights.model_copy(update={"impression": impression_weight})
    proc.params = proc.params.model_copy(update={"weights": weights})
    out = [ex for event in events for ex in proc.on_event(event)]  # as training_examples does
    return out + proc.join.close_all()


# -- simulator runs ------------------------------------------------------------------------
def sim_config(name: str, seed: int, args: argparse.Namespace) -> tuple[MarketConfig, int]:
    """(market config, impressions) of a named config; ValueError naming it when unknown."""
    if name == "default":
        return MarketConfig(seed=seed), 1000 * 200
    if name == "rich-drift":
        return MarketConfig(seed=seed, n_users=args.rich_users), args.rich_users * args.rich_per_user
    scaled = re.fullmatch(r"u([1-9][0-9]*)x([1-9][0-9]*)", name)
    if name == "rich":
        users, per_user = args.rich_users, args.rich_per_user
    elif scaled:
        users, per_user = int(scaled[1]), int(scaled[2])
    else:
        raise ValueError(f"--configs: unknown config {name!r} (default, rich, rich-drift, u<N>x<M>)")
    return MarketConfig(seed=seed, n_users=users, drift_at=None), users * per_user


def sim_run(name: str, seed: int, args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    """One simulator run: every model scored on the same time-ordered holdout."""
    mcfg, n = sim_config(name, seed, args)
    t0 = time.perf_counter()
    market = Market(mcfg)
    events = list(market.open_loop(n))
    examples = examples_of(events, settings, args.impression_weight)
    t_data = time.perf_counter() - t0
    train, hold = time_split(examples, args.holdout)
    rcfg = RankerConfig(state_dim=settings.state_dim)
    train_b, hold_b = featurize(train, rcfg), featurize(hold, rcfg)
    assert hold_b.label is not None
    y = hold_b.label.numpy()
    t1 = time.perf_counter()
    spec = TrainSpec(seed=seed)
    ranker = train_ranker(train_b, rcfg, spec)
    p_rank = predict(ranker, hold_b).numpy()
    t_rank = time.perf_counter() - t1
    t2 = time.perf_counter()
    p_lr = logistic_probs(train_b, hold_b, seed=seed)
    t_lr = time.perf_counter() - t2
    p_oracle = np.array([market.oracle_pctr(e.impression_id) for e in hold])
    t3 = time.perf_counter()
    ceiling = bayes_ceiling(market, examples, {e.impression_id for e in hold})
    p_ceiling = np.array([ceiling[e.impression_id] for e in hold])
    t_ceiling = time.perf_counter() - t3
    lo, hi = auc_diff_ci(p_rank, p_lr, y, seed=seed)
    a_rank, a_lr, a_oracle, a_ceiling = (auc(p, y) for p in (p_rank, p_lr, p_oracle, p_ceiling))
    # what a replica serves: the ranker plus the worker's per-user correction, learned
    # progressively from the holdout's own impressions and clicks (cold: from zero at its start),
    # and the same learned over the training rows first (warm: as it is in the user state by the
    # time the holdout is served; the ranker's scores there are in-sample)
    p_all = np.concatenate([predict(ranker, train_b).numpy(), p_rank])

    def served(params: StateSettings) -> tuple[np.ndarray, np.ndarray]:
        if params.feedback_lr <= 0:
            return p_rank, p_rank
        cold = corrected_scores(hold, p_rank, params)
        return cold, corrected_scores([*train, *hold], p_all, params)[len(train) :]

    p_served, p_warm = served(settings.state)
    a_served, a_served_warm = auc(p_served, y), auc(p_warm, y)
    variants: dict[str, dict[str, float]] = {}
    for lr in args.feedback_lrs:
        cold, warm = served(settings.state.model_copy(update={"feedback_lr": lr}))
        variants[f"{lr:g}"] = {
            "gap_ceiling_served": a_ceiling - auc(cold, y),
            "gap_ceiling_served_warm": a_ceiling - auc(warm, y),
        }
    seconds = {"data": t_data, "ranker": t_rank, "lr": t_lr, "ceiling": t_ceiling}
    res: dict[str, Any] = {
        "config": name,
        "seed": seed,
        "users": mcfg.n_users,
        "impressions": n,
        "drift_at": mcfg.drift_at,
        "examples": len(examples),
        "holdout": len(hold),
        "holdout_clicks": int(y.sum()),
        "auc_ranker": a_rank,
        "auc_lr": a_lr,
        "auc_oracle": a_oracle,
        "auc_ceiling": a_ceiling,
        "auc_served": a_served,
        "gap_ceiling_served": a_ceiling - a_served,
        "auc_served_warm": a_served_warm,
        "gap_ceiling_served_warm": a_ceiling - a_served_warm,
        "ranker_minus_lr_ci95": [lo, hi],
        "gap_oracle_ranker": a_oracle - a_rank,
        "gap_oracle_ceiling": a_oracle - a_ceiling,
        "gap_ceiling_ranker": a_ceiling - a_rank,
        "spec": asdict(spec),
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
    }
    if variants:
        res["feedback_lrs"] = variants
    console.print(
        f"sim {name} seed {seed}: ranker {a_rank:.4f} served {a_served_warm:.4f} (from zero at the holdout "
        f"{a_served:.4f}) LR {a_lr:.4f} "
        f"ceiling {a_ceiling:.4f} oracle {a_oracle:.4f} ({sum(seconds.values()):.0f} s)"
    )
    return res


def summarize_sim(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over seeds per config, and whether the 0.02 goal holds in each seed."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(r["config"] for r in runs):
        rs = [r for r in runs if r["config"] == name]
        keys = ("auc_ranker", "auc_served", "auc_lr", "auc_ceiling", "auc_oracle", "gap_oracle_ranker")
        mean = {k: float(np.mean([r[k] for r in rs])) for k in keys}
        mean["gap_oracle_ceiling"] = float(np.mean([r["gap_oracle_ceiling"] for r in rs]))
        mean["gap_ceiling_ranker"] = float(np.mean([r["gap_ceiling_ranker"] for r in rs]))
        mean["gap_ceiling_served"] = float(np.mean([r["gap_ceiling_served"] for r in rs]))
        mean["gap_ceiling_served_warm"] = float(np.mean([r["gap_ceiling_served_warm"] for r in rs]))
        mean["auc_served_warm"] = float(np.mean([r["auc_served_warm"] for r in rs]))
        lrs = rs[0].get("feedback_lrs", {})
        out[name] = {
            "seeds": [r["seed"] for r in rs],
            "mean": mean,
            "feedback_lrs": {  # per correction step of --feedback-lrs: the mean gaps
                lr: {k: float(np.mean([r["feedback_lrs"][lr][k] for r in rs])) for k in lrs[lr]} for lr in lrs
            },
            "max_gap_oracle_ranker": max(r["gap_oracle_ranker"] for r in rs),
            "goal_within_0_02_every_seed": all(r["gap_oracle_ranker"] <= 0.02 for r in rs),
        }
    return out


# -- user tower: decayed state vs the sequence tower ---------------------------------------
def rank_ms(model: Ranker, batch: Any, seq: UserSequences | None, reps: int = 60) -> float:
    """Median milliseconds of one forward over `batch` (one request's candidates)."""
    times = []
    with torch.no_grad():
        for i in range(reps + 10):
            t = time.perf_counter()
            model(batch.dense, batch.ids, seq)
            if i >= 10:
                times.append(time.perf_counter() - t)
    return 1000 * float(np.median(times))


def request_of(hold_b: Any, seq: UserSequences, n: int) -> tuple[Any, UserSequences]:
    """`n` holdout candidates as one request with the longest sequence in the holdout (the
    tower's worst case): the rows are real, the request's state/context is its first row's."""
    r = int(torch.argmax(seq.length))
    rows = torch.arange(min(n, len(hold_b)))
    one = UserSequences(
        seq.ad[r : r + 1], seq.category[r : r + 1], seq.click[r : r + 1], seq.dwell[r : r + 1],
        seq.age[r : r + 1], seq.length[r : r + 1], torch.zeros(len(rows), dtype=torch.int64),
    )  # fmt: skip
    return hold_b.select(rows), one


def tower_run(name: str, seed: int, args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    """One simulator run: decayed-state and sequence-tower rankers on the same holdout rows."""
    mcfg, n = sim_config(name, seed, args)
    t0 = time.perf_counter()
    market = Market(mcfg)
    events = list(market.open_loop(n))
    examples = examples_of(events, settings, args.impression_weight)
    t_data = time.perf_counter() - t0
    train, hold = time_split(examples, args.holdout)
    rcfg = RankerConfig(state_dim=settings.state_dim)
    train_b, hold_b = featurize(train, rcfg), featurize(hold, rcfg)
    assert hold_b.label is not None
    y = hold_b.label.numpy()
    spec = TrainSpec(seed=seed, epochs=args.epochs, patience=args.patience)
    p_oracle = np.array([market.oracle_pctr(e.impression_id) for e in hold])
    t1 = time.perf_counter()
    ceiling = bayes_ceiling(market, examples, {e.impression_id for e in hold})
    p_ceiling = np.array([ceiling[e.impression_id] for e in hold])
    t_ceiling = time.perf_counter() - t1
    a_oracle, a_ceiling = auc(p_oracle, y), auc(p_ceiling, y)
    variants: dict[str, dict[str, Any]] = {}
    probs: dict[str, np.ndarray] = {}
    if args.user_tower in ("decayed", "both"):
        t = time.perf_counter()
        model = train_ranker(train_b, rcfg, spec)
        train_s = time.perf_counter() - t
        probs["decayed"] = predict(model, hold_b).numpy()
        one_b = hold_b.select(torch.arange(min(args.rank_candidates, len(hold_b))))
        variants["decayed"] = {"train_s": train_s, "rank_ms": rank_ms(model, one_b, None)}
    seqs: dict[int, tuple[UserSequences, UserSequences, float]] = {}
    grid = args.tower_variants or list(
        itertools.product(args.tower_encoders, args.tower_seq_lens, args.tower_hidden)
    )
    for encoder, k, hidden in grid if args.user_tower in ("gru", "both") else []:
        # "noseq": the gru tower fed empty histories, an ablation that keeps the gate, the
        # decayed and context projections and the wider input, and drops only the sequence
        tower = "gru" if encoder == "noseq" else encoder
        cfg = dataclasses.replace(rcfg, user_tower=tower, tower_seq_len=k, tower_hidden=hidden)
        if k not in seqs:
            t = time.perf_counter()
            built = build_sequences(events, train, cfg), build_sequences(events, hold, cfg)
            seqs[k] = (*built, time.perf_counter() - t)
        seq_train, seq_hold, build_s = seqs[k]
        if encoder == "noseq":
            seq_train, seq_hold = (
                dataclasses.replace(q, length=torch.zeros_like(q.length)) for q in (seq_train, seq_hold)
            )
        t = time.perf_counter()
        model = train_tower_ranker(train_b, seq_train, cfg, spec)
        train_s = time.perf_counter() - t
        key = f"{encoder}_k{k}_h{hidden}"
        probs[key] = predict_with_sequences(model, hold_b, seq_hold).numpy()
        one_b, one_seq = request_of(hold_b, seq_hold, args.rank_candidates)
        variants[key] = {
            "encoder": encoder,
            "seq_len": k,
            "hidden": hidden,
            "train_s": train_s,
            "sequence_build_s": build_s,
            "rank_ms": rank_ms(model, one_b, one_seq),
            "gate_mean": dict(zip(MODALITIES, mean_gate(model, hold_b, seq_hold), strict=True)),
            "holdout_requests": seq_hold.requests,
            "holdout_mean_seq_len": float(seq_hold.length.float().mean()),
        }
        console.print(f"  {key}: AUC {auc(probs[key], y):.4f} ({train_s:.0f} s)")
    for key, v in variants.items():
        a = auc(probs[key], y)
        v.update(auc=a, gap_ceiling_ranker=a_ceiling - a, gap_oracle_ranker=a_oracle - a)
        if key != "decayed" and "decayed" in probs:
            v["minus_decayed"] = a - variants["decayed"]["auc"]
            v["minus_decayed_ci95"] = list(auc_diff_ci(probs[key], probs["decayed"], y, seed=seed))
    res: dict[str, Any] = {
        "config": name,
        "seed": seed,
        "examples": len(examples),
        "holdout": len(hold),
        "holdout_clicks": int(y.sum()),
        "auc_oracle": a_oracle,
        "auc_ceiling": a_ceiling,
        "variants": variants,
        "spec": asdict(spec),
        "seconds": {"data": round(t_data, 1), "ceiling": round(t_ceiling, 1)},
    }
    line = ", ".join(f"{k} {v['auc']:.4f}" for k, v in variants.items())
    console.print(f"tower {name} seed {seed}: {line}; ceiling {a_ceiling:.4f} oracle {a_oracle:.4f}")
    return res


def rank_cost(variants: Sequence[str], n: int, settings: Settings, reps: int = 300) -> dict[str, float]:
    """Median ms of one request of `n` candidates per variant key ("decayed", "gru_k16_h32"…),
    untrained weights (the cost does not depend on them), every history full (K events)."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for key in variants:
        rcfg = RankerConfig(state_dim=settings.state_dim)
        seq = None
        if key != "decayed":
            encoder, k, hidden = (
                key.split("_")[0],
                int(key.split("_k")[1].split("_h")[0]),
                int(key.split("_h")[1]),
            )
            rcfg = dataclasses.replace(rcfg, user_tower=encoder, tower_seq_len=k, tower_hidden=hidden)
            seq = UserSequences.one_full_request(n, k)
        torch.manual_seed(0)
        model = Ranker(rcfg).eval()
        ids = torch.stack([torch.randint(0, m, (n,), generator=gen) for m in rcfg.table_sizes.values()], 1)
        dense = torch.randn(n, rcfg.dense_dim, generator=gen)
        out[key] = rank_ms(model, RankerBatch(dense, ids), seq, reps)
    return out


def summarize_tower(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per config and variant: seed means; the best variant and whether it beats decayed by 0.005."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(r["config"] for r in runs):
        rs = [r for r in runs if r["config"] == name]
        per: dict[str, Any] = {}
        for key in rs[0]["variants"]:
            vs = [r["variants"][key] for r in rs]
            mean = {
                k: float(np.mean([v[k] for v in vs]))
                for k in ("auc", "gap_ceiling_ranker", "gap_oracle_ranker", "train_s", "rank_ms")
            }
            if "minus_decayed" in vs[0]:
                mean["minus_decayed"] = float(np.mean([v["minus_decayed"] for v in vs]))
                mean["minus_decayed_min_seed"] = float(min(v["minus_decayed"] for v in vs))
            per[key] = mean
        best = max(per, key=lambda k: per[k]["auc"])
        gain = per[best].get("minus_decayed", 0.0)
        out[name] = {
            "seeds": [r["seed"] for r in rs],
            "auc_ceiling": float(np.mean([r["auc_ceiling"] for r in rs])),
            "auc_oracle": float(np.mean([r["auc_oracle"] for r in rs])),
            "variants": per,
            "ceiling_gap": {k: v["gap_ceiling_ranker"] for k, v in per.items()},
            "best": best,
            "best_minus_decayed": gain,
            "wins_by_0_005": bool(best != "decayed" and gain >= 0.005),
        }
    return out


def print_tower(result: dict[str, Any]) -> None:
    t = Table(title="user tower: decayed state vs sequence tower, same holdout rows")
    for col in (
        "config",
        "seed",
        "variant",
        "AUC",
        "ceiling−AUC",
        "−decayed 95% CI",
        "train s",
        "rank ms/500",
    ):
        t.add_column(col)
    for r in result["runs"]:
        for key, v in r["variants"].items():
            ci = _ci(v["minus_decayed_ci95"]) if "minus_decayed_ci95" in v else ""
            t.add_row(
                r["config"], str(r["seed"]), key, _f(v["auc"]), _f(v["gap_ceiling_ranker"]), ci,
                f"{v['train_s']:.0f}", f"{v['rank_ms']:.2f}",
            )  # fmt: skip
    for name, sm in result["summary"].items():
        for key, m in sm["variants"].items():
            t.add_row(
                f"[bold]{name} mean", "", key, _f(m["auc"]), _f(m["gap_ceiling_ranker"]),
                _f(m.get("minus_decayed", math.nan)), f"{m['train_s']:.0f}", f"{m['rank_ms']:.2f}",
            )  # fmt: skip
    console.print(t)
    for name, sm in result["summary"].items():
        console.print(
            f"{name}: best {sm['best']} ({sm['best_minus_decayed']:+.4f} vs decayed); "
            f"wins by ≥ 0.005: {sm['wins_by_0_005']}"
        )


# -- Open Bandit Dataset -------------------------------------------------------------------
def _file_events(policy: str, campaign: str) -> Iterator[Message]:
    """One OBD file's events with campaign-specific item ids (each campaign counts from 0)."""
    for m in replay_obd(policy, campaign):
        if isinstance(m, AdCreative | Impression | Click):
            m = m.model_copy(update={"ad_id": m.ad_id.replace("obd-item", f"obd-{campaign}-item")})
        yield m


def _source(ex: TrainingExample) -> str:
    """'policy/campaign' of an OBD example (its impression id is `obd-{policy}-{campaign}-{row}`)."""
    return "/".join(ex.impression_id.split("-")[1:3])


def obd_examples(
    files: Sequence[tuple[str, str]], settings: Settings, impression_weight: float | None
) -> list[TrainingExample]:
    """The training examples of the given OBD files merged into one stream, by impression time."""
    streams = [list(_file_events(p, c)) for p, c in files]
    events = list(heapq.merge(*streams, key=lambda m: m.ts))
    examples = examples_of(events, settings, impression_weight)
    examples.sort(key=lambda e: (e.impression_ts, e.impression_id))
    return examples


def rolling_folds(
    examples: Sequence[TrainingExample], origins: Sequence[float], seed: int, settings: Settings
) -> dict[str, Any]:
    """Rolling-origin evaluation: per origin, fit on everything before it, score the next block."""
    rcfg = RankerConfig(state_dim=settings.state_dim)
    batch = featurize(examples, rcfg)
    assert batch.label is not None
    n = len(batch)
    rows: list[int] = []
    p_rank: list[np.ndarray] = []
    p_lr: list[np.ndarray] = []
    folds = []
    bounds = [*origins, 1.0]
    for a_frac, z_frac in itertools.pairwise(bounds):
        a, z = int(a_frac * n), int(z_frac * n)
        train, test = batch.select(torch.arange(0, a)), batch.select(torch.arange(a, z))
        assert test.label is not None
        ranker = train_ranker(train, rcfg, TrainSpec(seed=seed))
        p_rank.append(predict(ranker, test).numpy())
        p_lr.append(logistic_probs(train, test, seed=seed))
        y = test.label.numpy()
        folds.append(
            {
                "origin": a_frac,
                "train": a,
                "test": z - a,
                "clicks": int(y.sum()),
                "auc_ranker": auc(p_rank[-1], y),
                "auc_lr": auc(p_lr[-1], y),
            }
        )
        rows += range(a, z)
    labels = batch.label.numpy()[rows]
    pr, pl = np.concatenate(p_rank), np.concatenate(p_lr)
    lo, hi = auc_diff_ci(pr, pl, labels, seed=seed)
    chance = np.zeros_like(pr)  # a constant score: AUC 0.5, so these are CIs of AUC − 0.5
    return {
        "rows": np.asarray(rows),
        "p_ranker": pr,
        "p_lr": pl,
        "labels": labels,
        "summary": {
            "scored": len(rows),
            "clicks": int(labels.sum()),
            "auc_ranker": auc(pr, labels),
            "auc_lr": auc(pl, labels),
            "ranker_minus_lr_ci95": [lo, hi],
            "ranker_minus_chance_ci95": list(auc_diff_ci(pr, chance, labels, seed=seed)),
            "lr_minus_chance_ci95": list(auc_diff_ci(pl, chance, labels, seed=seed)),
            "folds": folds,
        },
    }


def obd_run(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    """Pooled rolling-origin ranker vs LR on the six OBD files (plus each file alone)."""
    files = [(p, c) for p in POLICIES for c in CAMPAIGNS]
    t0 = time.perf_counter()
    examples = obd_examples(files, settings, args.impression_weight)
    pooled = rolling_folds(examples, args.obd_origins, args.obd_seed, settings)
    summary = pooled["summary"]
    sources = np.array([_source(examples[r]) for r in pooled["rows"]])
    per_file = {}
    for src in sorted(set(sources)):
        k = sources == src
        y = pooled["labels"][k]
        per_file[src] = {
            "scored": int(k.sum()),
            "clicks": int(y.sum()),
            "auc_ranker": auc(pooled["p_ranker"][k], y),
            "auc_lr": auc(pooled["p_lr"][k], y),
        }
    out: dict[str, Any] = {
        "examples": len(examples),
        "clicks": sum(e.click for e in examples),
        "origins": list(args.obd_origins),
        "pooled": summary,
        "per_file": per_file,
        "seconds_pooled": round(time.perf_counter() - t0, 1),
    }
    console.print(
        f"OBD pooled: {summary['clicks']} scored clicks, ranker {summary['auc_ranker']:.4f} "
        f"LR {summary['auc_lr']:.4f} CI {summary['ranker_minus_lr_ci95']}"
    )
    if args.obd_standalone:
        t1 = time.perf_counter()
        alone = {}
        for p, c in files:
            res = rolling_folds(
                obd_examples([(p, c)], settings, args.impression_weight),
                args.obd_origins,
                args.obd_seed,
                settings,
            )
            alone[f"{p}/{c}"] = res["summary"]
        out["standalone"] = alone
        out["seconds_standalone"] = round(time.perf_counter() - t1, 1)
    return out


# -- output --------------------------------------------------------------------------------
def _f(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


def _ci(ci: Sequence[float]) -> str:
    return f"[{ci[0]:+.4f}, {ci[1]:+.4f}]"


def print_tables(result: dict[str, Any]) -> None:
    """Rich tables of whatever parts ran."""
    if "sim" in result:
        t = Table(title="simulator: time-ordered holdout (last 20 %), same rows for every model")
        for col in ("config", "seed", "clicks", "ranker", "LR", "ranker−LR 95% CI", "ceiling", "oracle"):
            t.add_column(col)
        t.add_column("oracle−ranker", style="bold")
        t.add_column("oracle−ceiling")
        for r in result["sim"]["runs"]:
            t.add_row(
                r["config"], str(r["seed"]), str(r["holdout_clicks"]), _f(r["auc_ranker"]), _f(r["auc_lr"]),
                _ci(r["ranker_minus_lr_ci95"]), _f(r["auc_ceiling"]), _f(r["auc_oracle"]),
                _f(r["gap_oracle_ranker"]), _f(r["gap_oracle_ceiling"]),
            )  # fmt: skip
        for name, s in result["sim"]["summary"].items():
            m = s["mean"]
            t.add_row(
                f"[bold]{name} mean", "", "", _f(m["auc_ranker"]), _f(m["auc_lr"]), "",
                _f(m["auc_ceiling"]), _f(m["auc_oracle"]), _f(m["gap_oracle_ranker"]),
                _f(m["gap_oracle_ceiling"]),
            )  # fmt: skip
        console.print(t)
        for name, sm in result["sim"]["summary"].items():
            console.print(
                f"{name}: oracle − ranker ≤ 0.02 in every seed: {sm['goal_within_0_02_every_seed']} "
                f"(largest {sm['max_gap_oracle_ranker']:.4f})"
            )
    if "obd" in result:
        o = result["obd"]
        t = Table(title=f"OBD: rolling-origin folds at {o['origins']} (out-of-fold rows)")
        for col in ("evaluation", "scored", "clicks", "ranker", "LR", "ranker−LR 95% CI"):
            t.add_column(col)
        t.add_column("ranker−0.5 / LR−0.5 95% CI")
        p = o["pooled"]
        t.add_row(
            "[bold]pooled 6 files", str(p["scored"]), str(p["clicks"]), _f(p["auc_ranker"]),
            _f(p["auc_lr"]), _ci(p["ranker_minus_lr_ci95"]),
            f"{_ci(p['ranker_minus_chance_ci95'])} / {_ci(p['lr_minus_chance_ci95'])}",
        )  # fmt: skip
        for src, r in o["per_file"].items():
            t.add_row(f"  pooled, rows of {src}", str(r["scored"]), str(r["clicks"]), _f(r["auc_ranker"]),
                      _f(r["auc_lr"]), "")  # fmt: skip
        for src, r in o.get("standalone", {}).items():
            t.add_row(
                f"  {src} alone", str(r["scored"]), str(r["clicks"]), _f(r["auc_ranker"]), _f(r["auc_lr"]),
                _ci(r["ranker_minus_lr_ci95"]),
                f"{_ci(r['ranker_minus_chance_ci95'])} / {_ci(r['lr_minus_chance_ci95'])}",
            )  # fmt: skip
        console.print(t)


def _plain(x: Any) -> Any:
    """JSON-ready: NaN → null (an AUC with one class only), numpy scalars → Python."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and math.isnan(x):
        return None
    return x


def _arg(v: Any) -> Any:
    """A CLI argument as JSON (paths as strings)."""
    if isinstance(v, list):
        return [_arg(x) for x in v]
    return str(v) if isinstance(v, Path) else v


def main() -> None:
    """Run the parts asked for; print tables; write the JSON."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--part", choices=("sim", "obd", "all"), default="all")
    ap.add_argument("--seeds", default="0,1", help="simulator seeds, comma-separated")
    ap.add_argument(
        "--configs", default=None, help="default, rich, rich-drift, u<N>x<M> (default: default,rich)"
    )
    ap.add_argument("--rich-users", type=int, default=20)
    ap.add_argument("--rich-per-user", type=int, default=10_000)
    ap.add_argument("--holdout", type=float, default=0.2)
    ap.add_argument(
        "--obd-origins", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 0.6, 0.7, 0.8, 0.9]
    )
    ap.add_argument("--obd-seed", type=int, default=0)
    ap.add_argument("--obd-standalone", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--impression-weight",
        type=float,
        default=None,
        help="ablation: state.weights.impression of the user state (default: the state's own)",
    )
    ap.add_argument(
        "--feedback-lrs",
        type=lambda v: [float(x) for x in v.split(",") if x],
        default=[],
        help="also score the per-user correction at these state.feedback_lr values (tuning), e.g. 0.5,1",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--out", type=Path, default=None, help=f"default {OUT} ({OUT_TOWER.name} with --user-tower)"
    )
    ap.add_argument(
        "--user-tower",
        choices=("decayed", "gru", "both"),
        default=None,
        help="compare the decayed-state ranker with the sequence user tower instead of the parts",
    )
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument(
        "--tower-encoders",
        type=lambda s: s.split(","),
        default=["gru"],
        help="sequence encoders, comma-separated: gru, pool (RankerConfig.user_tower), noseq (no history)",
    )
    ap.add_argument("--tower-seq-lens", type=ints, default=[32], help="K, comma-separated")
    ap.add_argument("--tower-hidden", type=ints, default=[32], help="GRU hidden sizes, comma-separated")
    ap.add_argument(
        "--tower-variants",
        type=lambda s: [(e, int(k), int(h)) for e, k, h in (v.split(":") for v in s.split(","))],
        default=None,
        help="instead of the product above: encoder:K:hidden, comma-separated (e.g. gru:32:32,pool:128:32)",
    )
    ap.add_argument("--rank-candidates", type=int, default=500)
    ap.add_argument(
        "--epochs", type=int, default=TrainSpec.epochs, help="with --user-tower: TrainSpec.epochs"
    )
    ap.add_argument(
        "--patience", type=int, default=TrainSpec.patience, help="with --user-tower: TrainSpec.patience"
    )
    ap.add_argument(
        "--rank-cost",
        action="store_true",
        help="with --merge: also time one request per variant in this (single) process",
    )
    ap.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        help="with --user-tower: summarise the runs of these result files (seeds run as separate processes)",
    )
    args = ap.parse_args()
    if args.configs is None:
        args.configs = "default" if args.user_tower else "default,rich"
    if args.out is None:
        args.out = OUT_TOWER if args.user_tower else OUT
    for name in args.configs.split(","):  # fail before minutes of runs, not after
        try:
            sim_config(name, 0, args)
        except ValueError as e:
            ap.error(str(e))
    torch.set_num_threads(args.threads)
    settings = Settings()
    t0 = time.perf_counter()
    result: dict[str, Any] = {"args": {k: _arg(v) for k, v in vars(args).items()}}
    if args.user_tower and args.merge:
        parts = [json.loads(path.read_text()) for path in args.merge]
        runs = [r for part in parts for r in part["tower"]["runs"]]
        result["merged"] = [
            {"file": str(path), "args": part["args"]} for path, part in zip(args.merge, parts, strict=True)
        ]
        result["machine"] = [{k: part.get(k) for k in ("machine_before", "machine_after")} for part in parts]
        result["tower"] = {"runs": runs, "summary": summarize_tower(runs)}
        if args.rank_cost:  # one process, this machine otherwise as quiet as the lock makes it
            keys = list(next(iter(result["tower"]["summary"].values()))["variants"])
            result["machine_rank_cost"] = machine()
            result["rank_ms_single_process"] = rank_cost(keys, args.rank_candidates, settings)
            console.print(
                f"rank ms per request of {args.rank_candidates}: {result['rank_ms_single_process']}"
            )
    elif args.user_tower:
        result["machine_before"] = machine()
        seeds = [int(s) for s in args.seeds.split(",")]
        runs = [tower_run(name, seed, args, settings) for name in args.configs.split(",") for seed in seeds]
        result["tower"] = {"runs": runs, "summary": summarize_tower(runs)}
        result["machine_after"] = machine()
    if args.user_tower:
        result["total_s"] = round(time.perf_counter() - t0, 1)
        print_tower(result["tower"])
        write_result(args.out, _plain(result))
        console.print(f"wrote {args.out} ({result['total_s']} s)")
        return
    result["machine"] = machine()  # where it ran (the figures compare models within a run)
    if args.part in ("sim", "all"):
        seeds = [int(s) for s in args.seeds.split(",")]
        runs = [sim_run(name, seed, args, settings) for name in args.configs.split(",") for seed in seeds]
        result["sim"] = {"runs": runs, "summary": summarize_sim(runs)}
        if "default" in result["sim"]["summary"]:  # the key: ceiling − what is served, defaults
            mean = result["sim"]["summary"]["default"]["mean"]
            result["ceiling_gap_defaults"] = mean["gap_ceiling_served_warm"]
            result["ceiling_gap_defaults_cold"] = mean["gap_ceiling_served"]
            result["ceiling_gap_defaults_ranker_alone"] = mean["gap_ceiling_ranker"]
            result["goal_ceiling_gap"] = GOAL_CEILING_GAP
            result["ceiling_goal_met"] = bool(mean["gap_ceiling_served_warm"] <= GOAL_CEILING_GAP)
            result["feedback_lr"] = settings.state.feedback_lr
            result["figures"] = {  # what `adstream bench table` shows
                "ceiling_gap_defaults": round(mean["gap_ceiling_served_warm"], 4),
                "ceiling_gap_defaults_cold": round(mean["gap_ceiling_served"], 4),
                "ceiling_gap_defaults_ranker_alone": round(mean["gap_ceiling_ranker"], 4),
                "ceiling_goal_met": result["ceiling_goal_met"],
                "auc_served": round(mean["auc_served_warm"], 4),
                "auc_ceiling": round(mean["auc_ceiling"], 4),
                "seeds": len(result["sim"]["summary"]["default"]["seeds"]),
            }
    if args.part in ("obd", "all"):
        result["obd"] = obd_run(args, settings)
    result["total_s"] = round(time.perf_counter() - t0, 1)
    print_tables(result)
    result["impression_weight"] = (
        args.impression_weight if args.impression_weight is not None else EngagementSettings().impression
    )
    write_result(args.out, _plain(result))
    console.print(f"wrote {args.out} ({result['total_s']} s)")


if __name__ == "__main__":
    main()
