"""Delayed feedback in the online trainer: the fake-negative losses learn the true click rate
from a stream where every impression is first a negative and each click a positive duplicate."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_trainers import make_examples

from schemas.events import TrainingExample
from schemas.settings import LoraSettings, OnlineSettings, Settings
from trainers.models.features import featurize
from trainers.models.lora import AdapterBank
from trainers.models.ranker import Ranker, RankerConfig
from trainers.online import OnlineTrainer, click_loss
from trainers.quality import rank_auc
from trainers.replay import replay

CFG = RankerConfig(
    state_dim=8, ad_buckets=64, advertiser_buckets=16, campaign_buckets=16, category_buckets=8, deep_hidden=16
)


def _fit_rate(fn_loss: str, fake: bool, positives: int = 200, impressions: int = 1000) -> float:
    """The click probability one free logit converges to on an FN stream with true rate
    positives / impressions (every impression a negative row, every click a positive row)."""
    label = torch.cat([torch.zeros(impressions), torch.ones(positives)])
    mark = torch.full_like(label, fake, dtype=torch.bool)
    z = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([z], lr=2.0)
    for _ in range(200):
        opt.zero_grad()
        click_loss(z.expand_as(label), label, mark, fn_loss).backward()  # type: ignore[no-untyped-call]
        opt.step()
    return float(torch.sigmoid(z.detach()))


@pytest.mark.parametrize("fn_loss", ["weighted", "calibrated"])
def test_fake_negative_losses_recover_the_true_rate(fn_loss: str) -> None:
    assert _fit_rate(fn_loss, fake=True) == pytest.approx(0.2, abs=2e-3)


def test_plain_log_loss_on_the_fake_negative_stream_is_biased() -> None:
    # what learning the FN stream without the correction gives: b = p / (1 + p) = 1/6
    assert _fit_rate("weighted", fake=False) == pytest.approx(200 / 1200, abs=2e-3)


def test_fn_weights_are_the_papers() -> None:
    z = torch.tensor([0.0, 0.0])  # p̂ = 0.5
    y = torch.tensor([1.0, 0.0])
    bce = torch.nn.functional.binary_cross_entropy_with_logits(z, y, reduction="none")
    got = click_loss(z, y, torch.tensor([True, True]), "weighted")
    assert float(got) == pytest.approx(float((1.5 * bce[0] + 0.5 * 1.5 * bce[1]) / 2))


def _fn_stream(exs: list[TrainingExample]) -> list[TrainingExample]:
    """The fake-negative stream of labelled examples: a negative each, a positive duplicate per click."""
    out = []
    for e in exs:
        out.append(e.model_copy(update={"click": False, "label_kind": "fake_negative"}))
        if e.click:
            out.append(e.model_copy(update={"event_id": e.event_id + "c", "label_kind": "click"}))
    return out


def _trained(stream: list[TrainingExample], fn_loss: str) -> OnlineTrainer:
    torch.manual_seed(0)
    bank = AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8, targets=("head", "wide.category")), "v1")
    mode = "fn_calibrated" if fn_loss == "calibrated" else "fn_weighted"
    spec = OnlineSettings(lr=0.01, embedding_lr=0.3, min_step_examples=16, label_mode=mode)
    tr = OnlineTrainer(bank, spec)
    for _ in range(2):
        replay(stream, tr, micro_batch=256)
    return tr


def test_online_trainer_on_the_fn_stream_predicts_the_true_click_rate() -> None:
    train, held = make_examples(1500, dim=8, seed=3), make_examples(500, dim=8, seed=4)
    rate = sum(e.click for e in held) / len(held)
    batch = featurize(held, CFG)

    def mean_p(tr: OnlineTrainer) -> float:
        with torch.no_grad():
            return float(torch.sigmoid(tr.bank.logits(batch, ["feed"] * len(held))).mean())

    stream = _fn_stream(train)
    naive = [e.model_copy(update={"label_kind": "final"}) for e in stream]  # no correction
    corrected = {m: mean_p(_trained(stream, m)) for m in ("weighted", "calibrated")}
    biased = mean_p(_trained(naive, "weighted"))
    b = rate / (1 + rate)  # the FN stream's click rate
    assert biased < b + 0.02  # learning fake negatives as final labels underestimates
    for m, p in corrected.items():
        assert abs(p - rate) < 0.05 and abs(p - rate) < abs(p - b) / 2, (m, p, rate, biased)


def test_dwell_updates_are_counted_not_learned() -> None:
    exs = make_examples(40, dim=8)
    dwell = [e.model_copy(update={"label_kind": "dwell", "dwell_ms": 900}) for e in exs]
    torch.manual_seed(0)
    bank = AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8), "v1")
    tr = OnlineTrainer(bank, OnlineSettings(min_step_examples=16))
    assert tr.learn(dwell, flush=True) == [] and tr.counts["steps"] == 0
    assert tr.counts["dwell_updates"] == 40 and tr.waiting() == 0
    tr.learn(dwell[:20] + exs[:20], flush=True)
    assert tr.counts["steps"] == 1 and tr.runs["feed"].counts["examples"] == 20


def test_spec_follows_the_label_mode() -> None:
    assert Settings(online={"label_mode": "fn_calibrated"}).online.fn_loss == "calibrated"
    assert Settings(online={"label_mode": "fn_weighted"}).online.fn_loss == "weighted"


def test_progressive_validation_scores_each_impression_once_with_its_final_label() -> None:
    """On the fake-negative stream a clicked impression arrives twice: as a negative, then as a
    positive duplicate. Progressive validation must score it once, at its impression (before
    anything was learned from it), against its final label: scoring the duplicate as a second
    pair put a copy of the impression in each class, which the frozen base scores alike (a tie)
    but the online model, having just learned the fake negative, scores lower at the click (a
    misordered pair) — the online-vs-base comparison (the demo's table, the guard) was biased
    against learning."""
    exs = make_examples(600, dim=8, seed=5)
    clicks = sum(e.click for e in exs)
    tr = _trained(_fn_stream(exs), "weighted")  # two passes: 1,200 impressions scored
    run = tr.runs["feed"]
    for window in (run.online, run.base):
        assert window.count == 2 * len(exs)  # one pair per impression, not one per row
        assert window.positives == 2 * clicks  # the click labels its impression's pair
    # the frozen base's window is exactly the base model's AUC on the impressions, final labels
    batch = featurize(exs, CFG)
    with torch.no_grad():
        base_p = torch.sigmoid(tr.bank.base_logits(batch)).numpy()
    y = np.array([e.click for e in exs])
    assert run.base.auc() == pytest.approx(
        rank_auc(np.concatenate([base_p, base_p]), np.concatenate([y, y])), abs=1e-9
    )
