"""Prometheus export of the trainer: rolling AUC gauges and guard counters (no ids as labels)."""

from __future__ import annotations

import torch
from helpers_trainers import make_examples
from prometheus_client import REGISTRY

from schemas.settings import LoraSettings, OnlineSettings
from trainers import telemetry
from trainers.models.lora import AdapterBank
from trainers.models.ranker import Ranker, RankerConfig
from trainers.online import OnlineTrainer
from trainers.replay import replay

CFG = RankerConfig(
    state_dim=8, ad_buckets=64, advertiser_buckets=16, campaign_buckets=16, category_buckets=8, deep_hidden=16
)


def test_export_and_counters() -> None:
    torch.manual_seed(0)
    tr = OnlineTrainer(
        AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8), "v"), OnlineSettings(min_step_examples=16)
    )
    replay(make_examples(400, dim=8, adapters=("feed", "search")), tr, 64)
    telemetry.export(tr.runs, per_adapter_labels=True)
    auc = REGISTRY.get_sample_value("adstream_trainers_rolling_auc", {"adapter": "feed", "model": "online"})
    assert auc is not None and 0 <= auc <= 1
    assert REGISTRY.get_sample_value("adstream_trainers_adapters") == 2
    mean = REGISTRY.get_sample_value("adstream_trainers_rolling_auc_mean")
    assert mean is not None and 0 <= mean <= 1
    before = (
        REGISTRY.get_sample_value("adstream_trainers_dropped_updates_total", {"reason": "oversized"}) or 0
    )
    telemetry.count_trainer({"dropped_oversized": 1}, {"dropped_oversized": 3, "resets": 1})
    assert (
        REGISTRY.get_sample_value("adstream_trainers_dropped_updates_total", {"reason": "oversized"})
        == before + 2
    )


def _labelled_adapters() -> set[str]:
    return {
        s.labels["adapter"]
        for metric in REGISTRY.collect()
        if metric.name in ("adstream_trainers_rolling_auc", "adstream_trainers_rolling_logloss")
        for s in metric.samples
    }


def test_per_adapter_labels_are_slots_only_and_follow_the_adapters_held() -> None:
    """Reliability M2: any `adapter_id` on `ad.training-examples` gets a trainer run, so labels
    from ids are unbounded (and an evicted adapter's label stayed for ever): only the contract's
    slots are labels, and only while the trainer holds them."""
    torch.manual_seed(0)
    tr = OnlineTrainer(
        AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8), "v"), OnlineSettings(min_step_examples=16)
    )
    forged = tuple(f"forged-{i}" for i in range(20))
    replay(make_examples(600, dim=8, adapters=("feed", "search", *forged)), tr, 64)
    telemetry.export(tr.runs, per_adapter_labels=True)
    assert _labelled_adapters() == {"feed", "search"}
    tr.evict("search")
    telemetry.export(tr.runs, per_adapter_labels=True)
    assert _labelled_adapters() == {"feed"}
    telemetry.export(tr.runs, per_adapter_labels=False)
    assert _labelled_adapters() == set()
