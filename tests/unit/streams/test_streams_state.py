"""Decay maths and user-state updates: unit and property tests of the pure functions."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from streams_helpers import click, creative, dwell, impression

from schemas.settings import StateSettings
from schemas.user_record import (
    UserState,
    decay,
    decay_factor,
    decode_state,
    encode_state,
    intent_score,
    intent_scores,
)
from streams.state import AdInfo, apply_event, same_state

P = StateSettings()
DIM = 32  # settings.state_dim
AD = AdInfo.from_creative(creative(), DIM)
AD2 = AdInfo.from_creative(creative("ad2", "travel", "Cheap flights to Rome"), DIM)


def _clicked_state(t: float = 0.0) -> UserState:
    s = apply_event(UserState.empty("u1", DIM), impression("i1", t), AD, P)
    return apply_event(s, click("c1", t + 1, "i1"), AD, P)


def test_decay_half_life() -> None:
    assert decay(8.0, 3600.0, 3600.0) == pytest.approx(4.0)
    assert decay(8.0, 0.0, 3600.0) == 8.0
    with pytest.raises(ValueError, match="dt_s"):
        decay(1.0, -1.0, 3600.0)


@given(
    score=st.floats(0, 1e6),
    dt1=st.floats(0, 1e6),
    dt2=st.floats(0, 1e6),
    half=st.floats(1, 1e5),
)
def test_decay_monotone_and_additive(score: float, dt1: float, dt2: float, half: float) -> None:
    a, b = sorted((dt1, dt2))
    assert decay(score, b, half) <= decay(score, a, half) + 1e-12
    # decaying in two steps equals decaying once (what makes lazy reads exact)
    assert decay(decay(score, dt1, half), dt2, half) == pytest.approx(
        decay(score, dt1 + dt2, half), rel=1e-9, abs=1e-300
    )


@settings(max_examples=60)
@given(t1=st.floats(2, 1e5), t2=st.floats(2, 1e5))
def test_lazy_read_monotone_without_events(t1: float, t2: float) -> None:
    s = _clicked_state()
    a, b = sorted((t1, t2))
    assert intent_score(s, "shoes", b, P) <= intent_score(s, "shoes", a, P) + 1e-12


@settings(max_examples=60)
@given(gap=st.floats(1.5, 1e5))
def test_lazy_read_equals_eager_update(gap: float) -> None:
    """Reading at t equals the state after an event at t that carries no evidence (unknown ad)."""
    s = _clicked_state()
    eager = apply_event(s, impression("tick", gap + 1), None, P)
    lazy = intent_scores(s, eager.last_ts, P)
    assert eager.intents.keys() == lazy.keys()
    for cat, v in lazy.items():
        assert eager.intents[cat] == pytest.approx(v, rel=1e-12)


def test_session_gap_applies_alpha_session() -> None:
    s = _clicked_state()
    within = apply_event(s, impression("x", 1 + 30.0), None, P)
    beyond = apply_event(s, impression("y", 1 + 30.5), None, P)
    base = s.intents["shoes"]
    assert within.intents["shoes"] == pytest.approx(decay(base, 30.0, P.half_life_s))
    assert beyond.intents["shoes"] == pytest.approx(decay(base, 30.5, P.half_life_s) * 0.85)
    assert (within.sessions, beyond.sessions) == (1, 2)
    assert beyond.session_events == 1 and within.session_events == 3


def test_contradicting_dwell_applies_alpha_contradict() -> None:
    s = _clicked_state()
    before = s.intents["shoes"]
    after = apply_event(s, dwell("d1", 2, "i1", 500), AD, P)
    assert after.intents["shoes"] == pytest.approx(decay(before, 1.0, P.half_life_s) * 0.62)
    # the quick skip is negative evidence for the vector
    assert float(np.dot(after.vector, AD.vector)) < float(np.dot(s.vector, AD.vector))


def test_quick_skip_without_click_is_not_a_contradiction() -> None:
    s = apply_event(UserState.empty("u1", DIM), impression("i1", 0), AD, P)
    after = apply_event(s, dwell("d1", 1, "i1", 500), AD, P)
    assert after.intents["shoes"] == pytest.approx(decay(s.intents["shoes"], 1.0, P.half_life_s))
    assert float(np.dot(after.vector, AD.vector)) < float(np.dot(s.vector, AD.vector))


def test_long_dwell_adds_intent() -> None:
    s = _clicked_state()
    after = apply_event(s, dwell("d1", 2, "i1", 30_000), AD, P)
    assert after.intents["shoes"] == pytest.approx(decay(s.intents["shoes"], 1.0, P.half_life_s) + 1.0)


def test_duplicate_event_id_changes_nothing() -> None:
    s = _clicked_state()
    again = apply_event(s, click("c1", 1, "i1"), AD, P)
    assert again is s


def test_late_event_does_not_move_time_back() -> None:
    s = apply_event(UserState.empty("u1", DIM), impression("i1", 100), AD, P)
    late = apply_event(s, click("c0", 40, "i1"), AD2, P)
    assert late.last_ts == s.last_ts and late.late == 1 and late.sessions == 1
    assert late.intents["travel"] == pytest.approx(decay(1.0, 60.0, P.half_life_s))


def test_categories_are_capped() -> None:
    params = StateSettings(max_intents=3)
    s = UserState.empty("u1", DIM)
    for i in range(6):
        ad = AdInfo.from_creative(creative(f"a{i}", f"cat{i}", "t"), DIM)
        s = apply_event(s, click(f"c{i}", i, "i"), ad, params)
    assert len(s.intents) == 3 and "cat5" in s.intents


def test_decay_factor_unit_for_fresh_state() -> None:
    assert decay_factor(UserState.empty("u", 4), 1e9, P) == 1.0


def test_record_round_trip() -> None:
    s = apply_event(_clicked_state(), dwell("d1", 2, "i1", 500), AD, P)
    s = apply_event(s, click("c2", 100, "i2"), AD2, P)
    back = decode_state("u1", encode_state(s))
    assert same_state(back, s, rtol=0.0)
    assert not same_state(back, _clicked_state())
    assert list(back.intents) == [c for c, _ in s.top_intents(10)]
    assert math.isfinite(back.intents["travel"])


def test_evidence_half_life_forgets_old_evidence_per_new_evidence() -> None:
    """With `evidence_half_life` H, each event's positive evidence w first scales the old vector
    and every intent by ½^(w/H): H units of new evidence halve the old, whatever the clock did."""
    params = StateSettings(evidence_half_life=2.0)
    s = apply_event(UserState.empty("u1", DIM), impression("i1", 0), AD, params)
    s = apply_event(s, click("c1", 1, "i1"), AD, params)
    before_vec, before_shoes = s.vector.copy(), s.intents["shoes"]
    after = apply_event(s, click("c2", 1, "i1"), AD2, params)  # same instant: no time decay
    f = 0.5 ** (1.0 / 2.0)
    assert after.intents["shoes"] == pytest.approx(before_shoes * f)
    assert after.intents["travel"] == pytest.approx(1.0)
    assert np.allclose(after.vector, before_vec * f + AD2.vector, atol=1e-6)
    # two half-lives of new evidence (four clicks of weight 1) leave a quarter of the old
    for i in range(3):
        after = apply_event(after, click(f"c{i + 3}", 1, "i1"), AD2, params)
    assert after.intents["shoes"] == pytest.approx(before_shoes * 0.25)


def test_evidence_half_life_off_keeps_sums() -> None:
    """The default (0: off) keeps the plain decayed sum: a second click adds to the first."""
    s = _clicked_state()
    after = apply_event(s, click("c2", 1, "i1"), AD2, P)
    assert P.evidence_half_life == 0.0
    assert after.intents["shoes"] == pytest.approx(s.intents["shoes"])


def test_evidence_half_life_rejects_negative() -> None:
    with pytest.raises(ValueError, match="evidence_half_life"):
        StateSettings(evidence_half_life=-1.0)


def test_evidence_surprise_forgets_less_for_agreeing_clicks() -> None:
    """With `evidence_surprise`, a click in the category that holds the state's intent mass
    barely forgets; one in a category the state lacks forgets a full ½^(w/H)."""
    params = StateSettings(evidence_half_life=2.0, evidence_surprise=True)
    s = UserState.empty("u1", DIM)
    for i in range(3):
        s = apply_event(s, click(f"c{i}", 1, "i1"), AD, params)
    shoes = s.intents["shoes"]
    assert shoes == pytest.approx(3.0)  # each click's category held all the mass: nothing forgotten
    new = apply_event(s, click("c9", 1, "i1"), AD2, params)
    assert new.intents["shoes"] == pytest.approx(shoes * 0.5 ** (1.0 / 2.0))
    mixed = apply_event(new, click("c10", 1, "i1"), AD2, params)
    share = 1.0 / (1.0 + new.intents["shoes"])  # travel's share of the mass before the click
    assert mixed.intents["shoes"] == pytest.approx(new.intents["shoes"] * 0.5 ** ((1 - share) / 2.0))
