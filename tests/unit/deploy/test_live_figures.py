"""deploy.live_figures: per-arm user rows, pooling, paired AUC, reset rate and exploration cost by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from attribution.ope import EstimationError
from deploy.live_figures import (
    Run,
    Served,
    arm_data,
    exploration_cost,
    lift_entry,
    paired_auc_diff,
    pool,
    pool_runs,
    read_scores,
    resets_per_adapter_hour,
    scores_on,
    summarize,
)


def _served(arm: list[str], user: list[str], request: list[str], clicked: list[int], after: list[bool],
            explored: list[bool] | None = None) -> Served:  # fmt: skip
    n = len(arm)
    return Served(
        impression_id=np.array([f"i{k}" for k in range(n)]),
        user=np.array(user),
        request=np.array(request),
        price=np.arange(1, n + 1, dtype=np.float64),
        clicked=np.array(clicked, dtype=np.float64),
        after=np.array(after),
        arm=np.array(arm),
        explored=np.array(explored or [False] * n),
        propensity=np.full(n, math.nan),
    )


def test_arm_rows_count_distinct_requests_and_clicked_prices_per_user() -> None:
    s = _served(
        arm=["learning", "learning", "learning", "control", ""],
        user=["u1", "u1", "u2", "u3", "u4"],
        request=["r1", "r1", "r2", "r3", "r4"],
        clicked=[1, 0, 1, 0, 1],
        after=[False] * 5,
    )
    arms = arm_data(s)
    assert sorted(arms) == ["control", "learning"]  # no arm: left out
    ln = arms["learning"]
    assert ln.requests.tolist() == [1, 1] and ln.impressions.tolist() == [2, 1]
    assert ln.clicks.tolist() == [1, 1] and ln.revenue.tolist() == [1.0, 3.0]  # prices 1 and 3 clicked
    assert arms["control"].clicks.tolist() == [0]
    only_first = arm_data(s, np.array([True, False, False, False, False]))
    assert list(only_first) == ["learning"] and only_first["learning"].impressions.tolist() == [1]


def test_pooling_keeps_users_of_different_runs_apart() -> None:
    a = _served(["control"], ["u1"], ["r1"], [1], [True])
    b = _served(["control"], ["u1"], ["r1"], [0], [True])
    p = pool([a, b])
    assert p.user.tolist() == ["0:u1", "1:u1"] and p.request.tolist() == ["0:r1", "1:r1"]
    assert arm_data(p)["control"].users == 2
    with pytest.raises(EstimationError, match="no run"):
        pool([])


def test_lift_of_an_arm_without_traffic_or_clicks_says_why() -> None:
    s = _served(["learning", "control"], ["u1", "u2"], ["r1", "r2"], [1, 0], [True, True])
    arms = arm_data(s)
    assert "no traffic" in lift_entry(arms, "learning", "correction")["error"]
    assert "is 0" in lift_entry(arms, "learning", "control")["error"]


def test_paired_auc_difference_by_hand() -> None:
    y = np.array([0, 1, 0, 1, 0, 1.0])
    users = np.array(list("abcdef"))
    same = paired_auc_diff(y * 0.5, y * 0.5, y, users, n_boot=100)
    assert same["mean"] == same["ci_low"] == same["ci_high"] == 0.0  # paired: no noise of its own
    # two strata weighted by their examples: perfect (+1.0) in 6 examples, reversed (−1.0) in 2
    online = np.concatenate([y, [0.0, 1.0]])
    base = np.concatenate([1 - y, [1.0, 0.0]])
    labels = np.concatenate([y, [1.0, 0.0]])
    strata = np.array([0] * 6 + [1] * 2)
    d = paired_auc_diff(online, base, labels, np.array(list("abcdefgh")), strata, n_boot=50)
    assert d["mean"] == pytest.approx((6 * 1.0 + 2 * -1.0) / 8)
    with pytest.raises(EstimationError, match="one class"):
        paired_auc_diff(np.ones(3), np.ones(3), np.zeros(3), np.array(list("abc")))


def test_reset_rate_by_hand_and_refused_without_adapters() -> None:
    assert resets_per_adapter_hour(0, 3, 600.0) == 0.0
    assert resets_per_adapter_hour(22, 1, 360.0) == pytest.approx(220.0)  # issue 32's 22 in 6 minutes
    with pytest.raises(EstimationError, match="adapters > 0"):
        resets_per_adapter_hour(1, 0, 60.0)


def test_exploration_cost_by_hand() -> None:
    clicked = np.array([1, 0, 0, 0, 1, 1, 0, 0.0])
    explored = np.array([1, 1, 1, 1, 0, 0, 0, 0], dtype=bool)
    c = exploration_cost(clicked, explored)
    assert c["relative_cost"]["mean"] == 0.5 and c["overall_ctr_cost"] == 0.25
    assert c["relative_cost"]["ci_low"] < 0.5 < c["relative_cost"]["ci_high"]
    assert "no explored" in exploration_cost(clicked, np.zeros(8, dtype=bool))["error"]


def test_score_log_first_row_per_impression_joined_to_served(tmp_path: Path) -> None:
    path = tmp_path / "scores.json"
    # i1's second row is its click's duplicate, scored after learning: not the pre-learning score
    body = {
        "online": [0.1, 0.2, 0.9, 0.3],
        "base": [0.5, 0.6, 0.7, 0.8],
        "labels": [0, 0, 1, 0],
        "adapters": ["feed"] * 4,
        "impression_ids": ["i1", "i0", "i1", "zz"],
        "resets": {"feed": 2},
    }
    path.write_text(json.dumps(body))
    scores = read_scores(path)
    assert scores.impression_id.tolist() == ["i1", "i0", "zz"] and scores.resets == {"feed": 2}
    s = _served(["learning"] * 3, ["u"] * 3, ["r"] * 3, [0, 1, 0], [False] * 3)
    online, base = scores_on(s, scores)
    assert online[:2].tolist() == [0.2, 0.1] and base[:2].tolist() == [0.6, 0.5] and math.isnan(online[2])


def test_summary_of_pooled_runs_has_every_figure() -> None:
    rng = np.random.default_rng(0)
    runs = []
    for _ in range(2):
        n = 400
        arm = rng.choice(["learning", "control", "correction"], n)
        user = np.char.add("u", (np.arange(n) % 40).astype(str))
        clicked = (rng.random(n) < 0.3).astype(int)
        s = _served(arm.tolist(), user.tolist(), np.arange(n).astype(str).tolist(), clicked.tolist(),
                    (np.arange(n) >= n // 2).tolist(), (rng.random(n) < 0.1).tolist())  # fmt: skip
        online = clicked + rng.normal(size=n)
        runs.append(Run(s, online, online - 0.5 * clicked, resets=1, adapters=3, seconds=600.0))
    pooled, strata = pool_runs(runs)
    out = summarize(pooled, strata, n_boot=50)
    for key in ("ctr_lift_before", "ctr_lift_after", "adapter_lift_after", "auc_online_minus_frozen_after"):
        assert out[key]["ci_low"] <= out[key]["mean"] <= out[key]["ci_high"], key
    assert out["auc_online_minus_frozen_after"]["mean"] > 0  # online carries the clicks more strongly
    assert out["resets_per_adapter_hour"] == pytest.approx(2 / 6 / (600 / 3600))
    assert "relative_cost" in out["exploration_ctr_cost"]


def test_auc_curves_have_bands_around_each_window() -> None:
    from deploy.live_figures import auc_curves

    rng = np.random.default_rng(1)
    n = 3000
    clicked = (rng.random(n) < 0.1).astype(int)
    s = _served(["learning"] * n, ["u"] * n, ["r"] * n, clicked.tolist(), (np.arange(n) >= 1500).tolist())
    online = clicked + rng.normal(size=n)
    online[:10] = np.nan  # not scored by the trainer: left out
    curves = auc_curves(Run(s, online, online.copy(), 0, 1, 60.0), window=1000, step=500)
    assert len(curves) == 5 and curves[-1]["after_drift"] == 1.0 and curves[0]["after_drift"] == 0.0
    for c in curves:
        assert c["online_lo"] < c["online"] < c["online_hi"] and c["online"] == c["frozen"]


def test_adapter_shift_is_the_logit_difference_per_phase() -> None:
    from deploy.live_figures import adapter_shift

    s = _served(["learning"] * 4, list("abcd"), list("abcd"), [1, 0, 0, 1], [False, False, True, True])
    base = np.array([0.5, 0.5, 0.5, 0.5])
    online = np.array([0.5, 0.5, 1 / (1 + math.exp(-1.0)), 1 / (1 + math.exp(1.0))])  # logits 0, 0, +1, −1
    shift = adapter_shift(Run(s, online, base, 0, 1, 1.0))
    assert shift["before"]["mean"] == pytest.approx(0.0) and shift["before"]["sd"] == pytest.approx(0.0)
    assert shift["after"]["mean"] == pytest.approx(0.0) and shift["after"]["sd"] == pytest.approx(1.0)
    assert shift["after"]["ctr"] == 0.5 and shift["after"]["examples"] == 2


def test_trainer_score_log_round_trips_into_read_scores(tmp_path: Path) -> None:
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainers"))
    from helpers_trainers import make_examples

    from deploy.cli_trainers import write_score_log
    from schemas.settings import LoraSettings, OnlineSettings
    from trainers.models.lora import AdapterBank
    from trainers.models.ranker import Ranker, RankerConfig
    from trainers.online import OnlineTrainer
    from trainers.replay import replay

    torch.manual_seed(0)
    cfg = RankerConfig(state_dim=8, ad_buckets=64, advertiser_buckets=16, campaign_buckets=16,
                       category_buckets=8, deep_hidden=16)  # fmt: skip
    trainer = OnlineTrainer(AdapterBank(Ranker(cfg), LoraSettings(rank=4, alpha=8), "v1"),
                            OnlineSettings(min_step_examples=16), keep_log=True)  # fmt: skip
    examples = make_examples(200, dim=8, seed=1)
    replay(examples, trainer, micro_batch=64)
    path = tmp_path / "scores.json"
    write_score_log(path, trainer)
    scores = read_scores(path)
    assert scores.impression_id.shape[0] == 200 and set(scores.adapter.tolist()) == {"feed"}
    assert scores.resets == {"feed": 0}
    assert np.all((scores.online > 0) & (scores.online < 1) & (scores.base > 0) & (scores.base < 1))
