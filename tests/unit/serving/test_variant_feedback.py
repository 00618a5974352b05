"""A replica's variant bandit learns from labelled examples: each impression's label once, under
replays and duplicates, in either label mode, with bounded memory (`serving.variant_feedback`)."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pytest

from schemas.events import TrainingExample
from schemas.settings import Settings
from serving.variant_feedback import VariantFeedback, wanted
from serving.variants import VariantSelector

TS = datetime(2026, 12, 1, 12, tzinfo=UTC)
DIM = 4


def example(
    iid: str, variant: str | None, click: bool, kind: str = "final", ad: str = "ad1"
) -> TrainingExample:
    vec = [0.5, -0.25, 0.0, 1.0] if int(iid[1:]) % 2 else [0.0, 0.5, 0.25, 0.0]
    return TrainingExample(
        event_id=f"te-{iid}-{kind}", ts=TS, adapter_id="feed", impression_id=iid, impression_ts=TS,
        user_id=f"u{iid}", ad_id=ad, campaign_id="c1", advertiser_id="adv", category="shoes",
        slot="feed", position=0, hour=12, user_vector=vec, intent_score=0.0, click=click,
        label_kind=kind, variant_id=variant, variant_propensity=None if variant is None else 0.5,
    )  # fmt: skip


def feedback(**variants: object) -> VariantFeedback:
    s = Settings(state_dim=DIM, variants={"learn_batch": 10_000, **variants})
    sel = VariantSelector.from_settings(s, seed=0)
    sel.register("ad1", ["a", "b"])
    return VariantFeedback(s, sel)


def hold_labels() -> list[TrainingExample]:
    return [example(f"i{k}", "b" if k % 2 else "a", click=k % 4 == 1) for k in range(40)]


def fn_labels() -> list[TrainingExample]:
    out = [example(f"i{k}", "b" if k % 2 else "a", False, "fake_negative") for k in range(40)]
    out += [example(f"i{k}", "b", True, "click") for k in range(1, 40, 4)]
    out += [example("i1", "b", True, "dwell")]  # a dwell update teaches the bandit nothing
    return out


def posterior(fb: VariantFeedback) -> tuple[np.ndarray, np.ndarray]:
    return fb.selector.state.precision.copy(), fb.selector.state.target.copy()


def test_clicks_on_one_variant_move_its_share() -> None:
    fb = feedback()
    before = fb.selector.shares("ad1", np.array([0.5, -0.25, 0.0, 1.0]))
    assert before == pytest.approx({"a": 0.5, "b": 0.5})
    assert fb.learn(hold_labels()) == 40
    after = fb.selector.shares("ad1", np.array([0.5, -0.25, 0.0, 1.0]))
    assert after["b"] > 0.9 and after["a"] < 0.1  # b was clicked for these users, a never


def test_both_label_modes_end_at_the_same_posterior() -> None:
    hold, fn = feedback(), feedback()
    hold.learn(hold_labels())
    fn.learn(fn_labels()[:25])  # in two fetches: corrections may come in a later one
    fn.learn(fn_labels()[25:])
    for a, b in zip(posterior(hold), posterior(fn), strict=True):
        assert np.allclose(a, b)
    assert fn.counts["learned"] == 40 + 10


@pytest.mark.parametrize("labels", [hold_labels, fn_labels])
def test_a_replayed_or_duplicated_topic_changes_nothing(labels: object) -> None:
    fb = feedback()
    fb.learn(labels())  # type: ignore[operator]
    once = posterior(fb)
    fb.learn(labels())  # type: ignore[operator]  # a replay of everything
    fb.learn([labels()[3], labels()[-2]])  # type: ignore[operator]  # duplicates of single records
    for a, b in zip(once, posterior(fb), strict=True):
        assert np.array_equal(a, b)
    assert fb.counts["duplicate"] >= 40


def test_a_click_before_its_fake_negative_is_learned_once() -> None:
    fb, ref = feedback(), feedback()
    fb.learn([example("i1", "b", True, "click"), example("i1", "b", False, "fake_negative")])
    ref.learn([example("i1", "b", True)])
    for a, b in zip(posterior(fb), posterior(ref), strict=True):
        assert np.array_equal(a, b)


def test_memory_is_bounded_and_unknown_ads_are_skipped() -> None:
    fb = feedback(remembered=16)
    fb.learn(hold_labels())
    assert len(fb.learned) == 16 and fb.counts["forgotten"] == 24
    assert list(fb.learned)[-1] == "i39"  # the newest are kept
    got = fb.learn([example("i100", "a", True, ad="ad-unknown"), example("i102", "zz", True)])
    assert got == 0 and fb.counts["unknown_ad_or_variant"] == 2


def test_offer_buffers_until_a_batch_or_the_interval() -> None:
    fb = feedback(learn_batch=5, learn_interval_s=3600)
    labels = hold_labels()
    for ex in labels[:4]:
        fb.offer(ex)
    assert fb.counts["learned"] == 0 and fb.due() is False
    fb.offer(example("i90", None, True))  # no variant: not buffered
    fb.offer(labels[4])
    assert fb.counts["learned"] == 5 and fb.counts["no_variant"] == 1
    fb.offer(labels[5])
    fb._since -= 3600  # the oldest pending example has waited the interval
    assert fb.due() and fb.flush() == 1


def test_wanted_follows_the_settings() -> None:
    assert wanted(Settings())
    assert not wanted(Settings(variants={"learn": False}))
    assert not wanted(Settings(variants={"enabled": False}))


def test_the_replica_pipeline_takes_its_variant_policy_from_settings() -> None:
    """The pipeline built its selector with the defaults, so `variants.*` did nothing in a replica."""
    import torch

    from schemas.settings import Settings
    from serving.catalog import Catalog
    from serving.pipeline import AdPipeline, content_vectorizer
    from serving.ranking import RankModel
    from trainers.models.ranker import Ranker, RankerConfig

    cfg = RankerConfig(state_dim=16, emb_dim=4, deep_hidden=16)
    s = Settings(state_dim=16, variants={"enabled": False, "floor": 0.2, "prior": 3.0})
    pipe = AdPipeline(
        s,
        RankModel(Ranker(cfg).eval(), "v0", s, torch.device("cpu")),
        Catalog(16, cfg, content_vectorizer(16)),
    )
    assert pipe.variants.enabled is False
    assert pipe.variants.policy.floor == 0.2 and pipe.variants.policy.prior == 3.0
