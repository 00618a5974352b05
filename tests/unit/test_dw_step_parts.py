"""benchmarks/dw_step.py's split of `learn()` into its parts: the parts and the rest add up to
`learn()`, and the trainer module is left as it was (its functions are wrapped for the pass)."""

from __future__ import annotations

import argparse

import pytest

import trainers.online as online
from schemas.settings import Settings
from tests.support.benchmarks import load_benchmark


def test_learn_parts_add_up_and_unwrap() -> None:
    bench = load_benchmark("dw_step")
    featurize, click_loss = online.featurize, online.click_loss
    args = argparse.Namespace(
        device="cpu", label_mode="fn_weighted", batch=64, steps=6, warmup=1, also_targets=()
    )
    settings = Settings()
    exs = bench._examples(64 * 8, "fn_weighted")
    parts = bench.learn_parts(1, args, exs, settings, tuple(settings.lora.targets))
    assert {"featurize", "forward (LoRA, base logit)", "loss", "progressive validation"} <= set(parts)
    assert all(v >= 0 for v in parts.values())
    inner = sum(v for k, v in parts.items() if k != "learn()")
    assert inner == pytest.approx(parts["learn()"], rel=0.5)  # medians of parts: close, not equal
    assert online.featurize is featurize and online.click_loss is click_loss


def test_measure_times_the_live_learn_without_featurizing_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """`live_learn_*` is the service's own `learn()` call, given the features it made: featurize
    runs once per service batch (its validation), never inside that `learn()`."""
    bench = load_benchmark("dw_step")
    calls: list[str] = []
    real = online.featurize
    monkeypatch.setattr(online, "featurize", lambda *a, **k: calls.append("learn") or real(*a, **k))
    args = argparse.Namespace(device="cpu", label_mode="fn_weighted", batch=64, steps=4, warmup=1)
    settings = Settings()
    exs = bench._examples(64 * 6, "fn_weighted")
    run = bench.measure(1, args, exs, settings, tuple(settings.lora.targets))
    assert 0 < run["live_learn_p50_ms"] <= run["live_learn_p99_ms"]
    assert run["live_learn_p50_ms"] < run["service_p50_ms"]
    # only the timed learn() of the plain loop featurizes (5 steps); the service's never does
    assert calls == ["learn"] * 5
