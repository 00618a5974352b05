"""Live learning's A/B arms (`serving.arms`) and exploration with logged propensities
(`serving.explore`): stable, independent arms at their shares; propensities that are the exact
probabilities of each pick."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from schemas.errors import ConfigError
from schemas.settings import AbSettings, Settings
from serving.arms import ab_arm_for, ab_bucket, uses_adapters, uses_correction
from serving.canary import user_bucket
from serving.explore import explore

USERS = [f"user-{i}" for i in range(40_000)]


def _within(count: int, n: int, p: float, z: float = 4.0) -> bool:
    return abs(count - n * p) <= z * math.sqrt(n * p * (1 - p))


def test_arms_are_stable_and_take_their_shares() -> None:
    ab = AbSettings(control_share=0.1, correction_share=0.15)
    arms = [ab_arm_for(u, ab) for u in USERS]
    assert arms == [ab_arm_for(u, ab) for u in USERS]  # the same user, the same arm
    counts = Counter(arms)
    n = len(USERS)
    assert _within(counts["control"], n, 0.1)
    assert _within(counts["correction"], n, 0.15)
    assert _within(counts["learning"], n, 0.75)


def test_arms_are_independent_of_the_canary_and_follow_the_salt() -> None:
    ab = AbSettings(control_share=0.5, correction_share=0.0)
    control = np.array([ab_arm_for(u, ab) == "control" for u in USERS])
    canary = np.array([user_bucket(u) < 0.5 for u in USERS])
    # the four cells of the 2 x 2 table each hold a quarter of the users
    for a in (True, False):
        for b in (True, False):
            assert _within(int(np.sum((control == a) & (canary == b))), len(USERS), 0.25)
    other = AbSettings(control_share=0.5, correction_share=0.0, salt="ab-v2")
    moved = sum(ab_arm_for(u, ab) != ab_arm_for(u, other) for u in USERS)
    assert _within(moved, len(USERS), 0.5)


def test_what_each_arm_uses() -> None:
    assert (uses_adapters("learning"), uses_correction("learning")) == (True, True)
    assert (uses_adapters("correction"), uses_correction("correction")) == (False, True)
    assert (uses_adapters("control"), uses_correction("control")) == (False, False)
    off = AbSettings(control_share=0.0, correction_share=0.0)
    assert {ab_arm_for(u, off) for u in USERS[:1000]} == {"learning"}
    assert 0.0 <= ab_bucket("x", "s") < 1.0


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"control_share": 1.0}, "control_share"),
        ({"control_share": -0.1}, "control_share"),
        ({"control_share": 0.6, "correction_share": 0.5}, "0.6"),
    ],
)
def test_bad_shares_are_refused_naming_the_value(values: dict[str, float], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        AbSettings(**values)
    with pytest.raises(Exception, match=named):
        Settings(ab=values)


def test_propensities_are_exact_by_hand() -> None:
    # epsilon 0.2 over the best 4: the greedy ad 0.8 + 0.05 = 0.85, any other of the 4 0.05
    seen = set()
    for seed in range(200):
        e = explore(10, 3, 0.2, 4, np.random.default_rng(seed))
        for pos, (pick, p, explored) in enumerate(zip(e.picks, e.propensity, e.explored, strict=True)):
            greedy = min(set(range(10)) - set(e.picks[:pos].tolist()))
            assert explored == (pick != greedy)
            assert p == pytest.approx(0.85 if pick == greedy else 0.05)
            seen.add(bool(explored))
        assert len(set(e.picks.tolist())) == 3  # never the same ad twice
    assert seen == {True, False}


def test_pick_frequencies_match_the_logged_propensities() -> None:
    rng = np.random.default_rng(7)
    n_runs, eps, m = 40_000, 0.3, 5
    firsts = Counter()
    logged: dict[int, float] = {}
    for _ in range(n_runs):
        e = explore(12, 2, eps, m, rng)
        firsts[int(e.picks[0])] += 1
        logged[int(e.picks[0])] = float(e.propensity[0])
    assert set(firsts) == set(range(m))  # only the best m are ever explored at position 0
    for pick, count in firsts.items():
        assert _within(count, n_runs, logged[pick])
    # the share of explored first positions is eps * (m - 1) / m
    explored = n_runs - firsts[0]
    assert _within(explored, n_runs, eps * (m - 1) / m)


def _explore_loop(n: int, k: int, epsilon: float, top_m: int, rng: np.random.Generator) -> tuple:  # type: ignore[type-arg]
    """`explore` as it was first written: one position at a time, the greedy ad by argmin."""
    slots = min(k, n)
    picks, prop, remaining = [], [], list(range(n))
    draws = rng.random(slots) if epsilon > 0 else np.ones(slots)
    for pos in range(slots):
        m = min(top_m, len(remaining))
        j = int(rng.integers(m)) if draws[pos] < epsilon and m > 1 else 0
        picks.append(remaining.pop(j))
        prop.append((1.0 - epsilon) * (j == 0) + (epsilon / m if m > 1 else epsilon))
    taken, greedy = np.zeros(n, dtype=bool), []
    for p in picks:
        greedy.append(int(np.argmin(taken)))
        taken[p] = True
    return picks, prop, [p != g for p, g in zip(picks, greedy, strict=True)]


@pytest.mark.parametrize("eps", [0.0, 0.05, 0.3, 0.9])
def test_explore_equals_the_position_loop_bit_for_bit(eps: float) -> None:
    """The greedy fast path (no position explored: most requests at small epsilon) and the
    loop give the same picks, propensities (the same floats) and flags for the same stream."""
    for seed in range(300):
        n, k, m = seed % 13, 1 + seed % 11, 2 + seed % 6
        got = explore(n, k, eps, m, np.random.default_rng(seed))
        picks, prop, explored = _explore_loop(n, k, eps, m, np.random.default_rng(seed))
        assert got.picks.tolist() == picks
        assert got.propensity.tolist() == prop
        assert got.explored.tolist() == explored


def test_no_exploration_is_the_greedy_order_with_propensity_one() -> None:
    e = explore(6, 6, 0.0, 4, np.random.default_rng(0))
    assert e.picks.tolist() == list(range(6))
    assert e.propensity.tolist() == [1.0] * 6 and not e.explored.any()
    assert explore(0, 5, 0.1, 4, np.random.default_rng(0)).picks.shape == (0,)
    with pytest.raises(ValueError, match="epsilon"):
        explore(5, 2, 1.0, 4, np.random.default_rng(0))


def _served(tmp_path: object, ab_arm: str, epsilon: float, request_id: str) -> list:  # type: ignore[type-arg]
    import torch
    from test_serving_recall import CFG, TS, ad

    from schemas.api import AdRequest
    from serving.catalog import Catalog
    from serving.pipeline import AdPipeline, RequestContext, content_vectorizer
    from serving.ranking import RankModel
    from trainers.models.ranker import Ranker

    torch.manual_seed(0)
    s = Settings(
        state_dim=16, recall={"k": 30}, state_dir=tmp_path, event_signing_key="s" * 40,
        explore={"epsilon": epsilon, "top_m": 6},
    )  # fmt: skip
    pipe = AdPipeline(
        s,
        RankModel(Ranker(CFG).eval(), "v0", s, torch.device("cpu")),
        Catalog(16, CFG, content_vectorizer(16)),
    )
    for i in range(40):
        pipe.add_ad(ad(i, cat=["shoes", "tech", "food"][i % 3]))
    req = AdRequest(user_id="u9", slot="feed", k=5)
    rec = pipe.recall(req, None, capped=[], hour=12)
    assert rec.rank_input is not None
    pctr = pipe.rank.score([rec.rank_input], use_adapters=False)[0]
    stage = {"recall": 1.0, "rank": 2.0, "rerank": 0.0}
    ctx = RequestContext(
        req, request_id, TS, rung="adapter", rows=rec.rows, pctr=pctr, stage_ms=stage, ab_arm=ab_arm
    )
    imps = pipe.finish(ctx).impressions
    return imps


def test_impressions_record_their_arm_propensity_and_exploration(tmp_path: object) -> None:
    greedy = [i.ad_id for i in _served(tmp_path, "learning", 0.0, "r0")]
    imps = _served(tmp_path, "control", 0.0, "r0")
    assert [i.ad_id for i in imps] == greedy
    assert {i.ab_arm for i in imps} == {"control"} and {i.propensity for i in imps} == {1.0}
    assert not any(i.explored for i in imps) and {i.adapter_version for i in imps} == {None}
    # with exploration: some request leaves the greedy order, and says so with its probability
    departures = 0
    for r in range(12):
        imps = _served(tmp_path, "learning", 0.5, f"req-{r}")
        assert imps == _served(tmp_path, "learning", 0.5, f"req-{r}")  # seeded by the request id
        for imp in imps:
            assert imp.propensity is not None and 0 < imp.propensity <= 1
            assert imp.propensity == pytest.approx(0.5 + 0.5 / 6 if not imp.explored else 0.5 / 6)
        departures += sum(bool(i.explored) for i in imps)
    assert departures > 0
