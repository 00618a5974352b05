"""deploy.live_figures: the parts' decomposition (position-0 gap), history covariate, CUPED and
expected-click lifts, and the saved arrays, on hand-made runs."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from deploy.live_figures import (
    PreCounts,
    Run,
    Served,
    decompose,
    history_rows,
    load_run,
    pool_runs,
    position_gap,
    read_history,
    save_run,
    shadow_figures,
    shadow_of,
    summarize,
    variance_reduced,
)
from schemas.stats import auc
from workloads.closed_loop import ShadowSlate


def _sig(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = 1 / (1 + np.exp(-x))
    return out


def _run(n: int = 3000, seed: int = 0) -> tuple[Run, dict[str, np.ndarray]]:
    """Served impressions of three arms: the trainer's base logit b at the real position, serving's
    at position 0 (b + gap[position]); the correction c in two arms, the adapter a in the learning
    arm's (and every arm's trainer score)."""
    rng = np.random.default_rng(seed)
    arm = np.array(["control", "correction", "learning"])[rng.integers(0, 3, n)]
    position = rng.integers(0, 3, n)
    gap = np.array([0.0, 0.3, 0.6])[position]
    b = rng.normal(-2.5, 0.8, n)
    a = rng.normal(0.5, 0.3, n)
    c = rng.normal(0.2, 0.5, n)
    served_logit = b + gap + np.where(arm == "learning", a, 0) + np.where(arm == "control", 0, c)
    oracle = _sig(b + 0.7 * c)
    clicked = (rng.random(n) < oracle).astype(np.float64)
    users = np.array([f"u{k % 200}" for k in range(n)])
    served = Served(
        impression_id=np.array([f"i{k}" for k in range(n)]),
        user=users,
        request=np.array([f"r{k // 3}" for k in range(n)]),
        price=np.ones(n),
        clicked=clicked,
        after=np.arange(n) >= n // 2,
        arm=arm,
        explored=np.zeros(n, dtype=bool),
        propensity=np.ones(n),
        pctr=_sig(served_logit),
        oracle=oracle,
        slot=np.full(n, "feed"),
        position=position,
    )
    hist_users = np.array([f"u{k}" for k in range(200)])
    pre = PreCounts(hist_users, np.full(200, 30.0), rng.binomial(30, 0.1, 200).astype(np.float64))
    run = Run(served, _sig(b + a), _sig(b), 0, 3, 600.0, pre)
    return run, {"b": b, "a": a, "c": c}


def test_position_gap_reads_serving_position_zero_off_the_control_arm() -> None:
    run, _ = _run()
    gaps, table = position_gap(run)
    assert gaps == pytest.approx({"feed:0": 0.0, "feed:1": 0.3, "feed:2": 0.6}, abs=1e-5)
    assert table["feed:2"]["sd"] == pytest.approx(0.0, abs=1e-5)


def test_decompose_recovers_the_correction_and_scores_each_part_on_the_same_impressions() -> None:
    run, parts = _run()
    d = decompose(run)
    s = run.served
    for arm in ("learning", "correction"):
        m = s.after & (s.arm == arm)
        e = d["after"][arm]
        assert e["impressions"] == int(m.sum())
        assert e["correction"]["mean"] == pytest.approx(parts["c"][m].mean(), abs=1e-4)
        assert e["adapter"]["mean"] == pytest.approx(parts["a"][m].mean(), abs=1e-4)
        y = s.clicked[m]
        assert e["frozen"]["auc"] == pytest.approx(auc(parts["b"][m], y))
        assert e["frozen+correction"]["auc"] == pytest.approx(auc(parts["b"][m] + parts["c"][m], y), abs=1e-6)
        assert e["full"]["auc"] == pytest.approx(auc((parts["b"] + parts["a"] + parts["c"])[m], y), abs=1e-6)
        assert abs(e["corr_adapter_correction"]) < 0.1  # drawn independently
    assert "control" not in d["after"]


def test_history_rows_align_with_the_arm_users_and_zero_the_unknown(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    path.write_text(
        '{"kind": "impression", "user_id": "u1"}\n{"kind": "impression", "user_id": "u1"}\n'
        '{"kind": "click", "user_id": "u1"}\n{"kind": "ad", "ad_id": "a"}\n'
        '{"kind": "impression", "user_id": "u2"}\n'
    )
    pre = read_history(path)
    assert (
        pre.user.tolist() == ["u1", "u2"]
        and pre.impressions.tolist() == [2, 1]
        and pre.clicks.tolist() == [1, 0]
    )
    rows = history_rows(np.array(["u2", "u9", "u1"]), "control", pre)
    assert rows.impressions.tolist() == [1, 0, 2] and rows.clicks.tolist() == [0, 0, 1]


def test_variance_reduced_lifts_and_the_saved_arrays(tmp_path: Path) -> None:
    run, _ = _run()
    v = variance_reduced(run, n_boot=100, seed=0)
    for key in ("ctr_lift_after_cuped", "adapter_lift_after_cuped", "ctr_lift_after_cuped_predrift",
                "ctr_lift_after_expected", "adapter_lift_before_expected"):  # fmt: skip
        assert v[key]["ci_low"] <= v[key]["mean"] <= v[key]["ci_high"], key
    assert v["ctr_lift_after_cuped"]["covariate"] == "history CTR"
    save_run(run, tmp_path / "run.npz")
    back = load_run(tmp_path / "run.npz")
    assert back.served.position is not None and run.served.position is not None
    assert back.served.position.tolist() == run.served.position.tolist()
    assert back.pre is not None and back.pre.user.tolist() == run.pre.user.tolist()  # type: ignore[union-attr]
    assert (back.resets, back.adapters, back.seconds) == (0, 3, 600.0)
    pooled, strata = pool_runs([back, run])
    out = summarize(pooled, strata, n_boot=50)
    assert out["ctr_lift_after_expected"]["users"] > 0 and math.isfinite(out["ctr_lift_after_cuped"]["mean"])
    assert set(out["decomposition"]["after"]) == {"learning", "correction"}


def test_a_run_without_the_oracle_pools_with_one_that_has_it() -> None:
    import dataclasses

    run, _ = _run()
    other, _ = _run(seed=1)
    blind = dataclasses.replace(other, served=dataclasses.replace(other.served, oracle=None))
    pooled, _ = pool_runs([run, blind])
    assert pooled.served.oracle is not None and np.isnan(pooled.served.oracle[run.served.n :]).all()
    alone = variance_reduced(run, n_boot=50, seed=0)["ctr_lift_after_expected"]
    both = variance_reduced(pooled, n_boot=50, seed=0)["ctr_lift_after_expected"]
    assert both["mean"] == pytest.approx(alone["mean"]) and both["users"] == alone["users"]
    assert "oracle" not in decompose(pooled)["after"]["learning"]


def test_season_figures_split_the_adapters_shift_and_the_arms_by_the_season_of_the_ad() -> None:
    """Hand-made: the adapters move the new season's ads +1.0 logit, the old season's -0.5 and the
    others +0.2 (so +0.8 / -0.7 over the others); each arm's season shares are counted by hand;
    the season survives saving and pooling."""
    import dataclasses

    from deploy.live_figures import season_figures

    run, _ = _run(n=1200)
    n = run.served.n
    season = np.tile(np.array([1, -1, 0, 0], dtype=np.int8), n // 4)
    base = np.full(n, 0.2)
    shift = np.where(season == 1, 1.0, np.where(season == -1, -0.5, 0.2))
    served = dataclasses.replace(run.served, season=season)
    run = dataclasses.replace(run, served=served, base=base, online=_sig(np.log(0.2 / 0.8) + shift))
    out = season_figures(run)
    for phase in ("before", "after"):
        over = out[phase]["adapter_shift_over_other"]
        assert over["new_season"] == pytest.approx(0.8) and over["old_season"] == pytest.approx(-0.7)
        mask = served.after if phase == "after" else ~served.after
        for arm in ("control", "correction", "learning"):
            m = mask & (served.arm == arm)
            row = out[phase]["arms"][arm]
            assert row["impressions"] == int(m.sum())
            assert row["new_season_share"] == pytest.approx((m & (season == 1)).sum() / m.sum())
            assert row["old_season_true_ctr"] == pytest.approx(served.oracle[m & (season == -1)].mean())
    assert "season" in summarize(run, n_boot=20)


def test_the_season_is_saved_and_pooled(tmp_path: Path) -> None:
    import dataclasses

    run, _ = _run(n=400)
    season = np.resize(np.array([1, 0, -1], dtype=np.int8), 400)
    run = dataclasses.replace(run, served=dataclasses.replace(run.served, season=season))
    save_run(run, tmp_path / "run.npz")
    back = load_run(tmp_path / "run.npz")
    assert back.served.season is not None and back.served.season.tolist() == season.tolist()
    pooled, _ = pool_runs([back, run])
    assert pooled.served.season is not None and pooled.served.season.shape == (800,)
    without, _ = _run(n=400, seed=2)  # a run saved before seasons pools without them
    assert pool_runs([run, without])[0].served.season is None


def _pairs() -> list[ShadowSlate]:
    """Shadow pairs of three users: u0's served slates earn 1.5× their shadows', u1's the same
    (its slates never differ), u2's half; u2's last request is after the drift only."""
    rows = [("u0", 0, 0.3, 0.2, False), ("u1", 5, 0.4, 0.4, True), ("u0", 9, 0.6, 0.4, False),
            ("u2", 12, 0.1, 0.2, False), ("u0", 20, 0.9, 0.6, False), ("u1", 24, 0.2, 0.2, True),
            ("u2", 30, 0.3, 0.6, False)]  # fmt: skip
    return [ShadowSlate(f"r{k}", u, i, a, b, same) for k, (u, i, a, b, same) in enumerate(rows)]


def test_shadow_figures_are_the_served_slates_expected_clicks_over_their_shadows() -> None:
    shadow = shadow_of(_pairs(), drift_index=20)
    assert shadow is not None and shadow.n == 7
    assert shadow.after.tolist() == [False, False, False, False, True, True, True]
    assert shadow_of([], 20) is None
    figs = shadow_figures(shadow, n_boot=400, seed=1)
    before, after = figs["before"], figs["after"]
    # before: served 0.3 + 0.4 + 0.6 + 0.1 = 1.4 against 0.2 + 0.4 + 0.4 + 0.2 = 1.2
    assert before["mean"] == pytest.approx(1.4 / 1.2 - 1)
    assert (before["users"], before["requests"]) == (3, 4)
    assert before["differ_share"] == pytest.approx(0.75)
    assert before["served_per_request"] == pytest.approx(1.4 / 4)
    assert before["shadow_per_request"] == pytest.approx(1.2 / 4)
    # after: 0.9 + 0.2 + 0.3 = 1.4 against 0.6 + 0.2 + 0.6 = 1.4
    assert after["mean"] == pytest.approx(0.0, abs=1e-12)
    assert after["ci_low"] < 0 < after["ci_high"]  # u0 gains, u2 loses: the users' spread
    # the users are resampled with both totals: a bootstrap draw is a mix of u0, u1, u2, so
    # every bound lies between u2's ratio (0.5) and u0's (1.5)
    assert -0.5 <= after["ci_low"] and after["ci_high"] <= 0.5


def test_shadow_pairs_are_saved_pooled_and_summarized(tmp_path: Path) -> None:
    run, _ = _run()
    assert "adapter_lift_after_shadow" not in summarize(run, n_boot=50)  # no shadow slates: no figure
    with_shadow = dataclasses.replace(run, shadow=shadow_of(_pairs(), drift_index=20))
    save_run(with_shadow, tmp_path / "run.npz")
    back = load_run(tmp_path / "run.npz")
    assert back.shadow is not None and with_shadow.shadow is not None
    for f in ("user", "after", "served", "shadow", "same"):
        assert getattr(back.shadow, f).tolist() == getattr(with_shadow.shadow, f).tolist()
    assert load_run_without_shadow(run, tmp_path).shadow is None
    pooled, _ = pool_runs([back, run, with_shadow])  # the run without pairs adds none
    assert pooled.shadow is not None and pooled.shadow.n == 14
    assert set(pooled.shadow.user.tolist()) == {"0:u0", "0:u1", "0:u2", "2:u0", "2:u1", "2:u2"}
    figs = summarize(pooled, n_boot=50)
    assert figs["adapter_lift_before_shadow"]["mean"] == pytest.approx(1.4 / 1.2 - 1)
    assert figs["adapter_lift_after_shadow"]["users"] == 6


def load_run_without_shadow(run: Run, tmp_path: Path) -> Run:
    save_run(run, tmp_path / "plain.npz")
    return load_run(tmp_path / "plain.npz")
