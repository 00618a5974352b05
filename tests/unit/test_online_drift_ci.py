"""benchmarks/online_drift.py's recovery interval: a bootstrap over seeds of the seed-mean figure."""

from __future__ import annotations

import argparse
from types import ModuleType

import numpy as np
import pytest

from tests.support.benchmarks import load_benchmark


def _online_drift() -> ModuleType:
    return load_benchmark("online_drift")


def _run(od: ModuleType, seed: int, recovery: float) -> object:
    """A stream whose online scores are sharp before the drift, blurred right after it and
    sharp again (by `recovery`) at the horizon: noise on a perfect score grows, then shrinks."""
    rng = np.random.default_rng(seed)
    n, drift = 600, 300
    y = rng.integers(0, 2, n).astype(float)
    noise = np.full(n, 0.5)
    after = np.arange(n - drift)
    noise[drift:] = 0.5 + 2.0 * np.exp(-after / 60.0 * recovery)  # blurred, then sharper
    scores = {
        "online": y + noise * rng.normal(size=n),
        "frozen": y + 2.0 * rng.normal(size=n),
        "oracle": y + 0.1 * rng.normal(size=n),
    }
    return od.SeedRun(seed, y, scores, drift)


def test_interval_brackets_the_seed_mean_and_collapses_for_identical_seeds() -> None:
    od = _online_drift()
    args = argparse.Namespace(window=100, horizon=200, recover_window=50)
    runs = [_run(od, s, 1.0 + 0.3 * s) for s in range(6)]
    point = od.figures(runs, args)["recovered_fraction"]
    ci = od.recovery_ci(runs, args.window, args.horizon, boot=500)
    assert ci["recovered_ci_low"] <= point <= ci["recovered_ci_high"]
    assert ci["recovered_ci_high"] - ci["recovered_ci_low"] > 0.01  # the seeds differ
    same = [_run(od, 0, 1.0)] * 4  # no spread between seeds: the interval is the figure itself
    only = od.recovery_ci(same, args.window, args.horizon, boot=200)
    assert only["recovered_ci_low"] == pytest.approx(od.figures(same, args)["recovered_fraction"])
    assert only["recovered_ci_high"] == pytest.approx(only["recovered_ci_low"])
    # deterministic under its seed
    assert od.recovery_ci(runs, args.window, args.horizon, boot=500) == ci


def test_user_category_bias_reference_learns_what_a_category_bias_cannot() -> None:
    """Keyed by (user, category), the bias reference separates two users of one category whose
    click rates differ (the frozen base rates both alike); keyed by category alone it cannot."""
    od = _online_drift()
    rng = np.random.default_rng(0)
    users = rng.integers(0, 2, 4000)
    y = (rng.random(4000) < np.where(users == 1, 0.3, 0.02)).astype(float)
    frozen = np.full(4000, 0.1)
    cats = ["shoes"] * 4000
    per_user = od._category_bias_scores(frozen, y, list(zip(users.tolist(), cats, strict=True)), 0.2)
    shared = od._category_bias_scores(frozen, y, cats, 0.2)
    late = slice(1000, None)
    assert od.auc(per_user[late], y[late]) > 0.7
    assert od.auc(shared[late], y[late]) < 0.6


def test_replica_is_servings_own_code_and_scores_what_the_trainer_published() -> None:
    """The replay's replica applies the published deltas through `serving.hotswap.DeltaApplier`
    into a `serving.ranking.RankModel` (issue 31: benchmarks use product code): after a replay its
    scores equal the trainer's own adapters' scores on the same examples, and every delta the
    trainer signed was applied."""
    import torch

    from schemas.delta import resolve_signing_key
    from schemas.settings import LoraSettings, OnlineSettings, Settings
    from serving.hotswap import DeltaApplier
    from tests.unit.trainers.helpers_trainers import make_examples
    from trainers.models.features import featurize
    from trainers.models.lora import AdapterBank
    from trainers.models.ranker import Ranker, RankerConfig
    from trainers.online import OnlineTrainer
    from trainers.replay import replay

    od = _online_drift()
    cfg = RankerConfig(state_dim=8, emb_dim=4, ad_buckets=64, advertiser_buckets=16, campaign_buckets=32,
                       category_buckets=8, deep_hidden=16)  # fmt: skip
    settings = Settings(lora={"rank": 4, "alpha": 8.0, "targets": ("cross", "deep.0")})
    lora = LoraSettings(rank=4, alpha=8.0, targets=("cross", "deep.0"))
    torch.manual_seed(0)
    base = Ranker(cfg).eval()
    trainer = OnlineTrainer(
        AdapterBank(base, lora, "v0"),
        # every direction published at each step: the replica then holds exactly the trainer's
        # adapters (at a higher percentile the directions below it wait in the trainer, and the
        # two differ by what waits: at 50 they happened to agree with the dense input of before
        # the query columns, and differed by up to 2e-3 with them)
        OnlineSettings(lr=0.01, min_step_examples=16, delta_percentile=0.001),
        signing_key=resolve_signing_key(settings),
    )
    replica = od._Replica(base, settings, lora, "v0")
    assert isinstance(replica.applier, DeltaApplier)
    exs = make_examples(1200, dim=8, seed=3, adapters=("feed", "search"))
    replay(exs, trainer, 128, on_deltas=replica.apply, before_learn=replica.score)
    assert replica.applier.outcomes["applied"] > 0 and replica.rejected == 0
    tail = exs[-200:]
    replica.score(tail)
    served = torch.tensor([replica.scores[e.impression_id] for e in tail])
    own = torch.sigmoid(trainer.bank.logits(featurize(tail, cfg), [e.adapter_id for e in tail]))
    assert torch.allclose(served, own, atol=1e-5)
    base_p = torch.sigmoid(trainer.bank.logits(featurize(tail, cfg), [None] * len(tail)))
    assert not torch.allclose(served, base_p, atol=1e-3)  # the adapters moved the scores
