"""The per-user correction (`UserState.bias`, `state.feedback_lr`): SGD on log loss split into
−lr·pctr at the impression and +lr at its click, its record (format 2, format 1 still read), and
serving's use of it (the candidate's logit offset)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from streams_helpers import click, creative, impression

from schemas.errors import StoreError
from schemas.settings import StateSettings
from schemas.user_record import UserState, bias_at, decode_state, encode_state
from serving.ranking import RankInput, build_input
from streams.state import AdInfo, apply_event, same_state

DIM = 8
AD = AdInfo.from_creative(creative(), DIM)
AD2 = AdInfo.from_creative(creative("ad2", "travel", "Cheap flights to Rome"), DIM)
P = StateSettings(feedback_lr=0.5)


def test_an_impression_moves_its_category_down_by_lr_times_pctr_and_its_click_up_by_lr() -> None:
    s = apply_event(UserState.empty("u1", DIM), impression("i1", 0.0), AD, P)  # pctr 0.1
    assert s.bias == {"shoes": pytest.approx(-0.05)}
    s = apply_event(s, click("c1", 0.0, "i1"), AD, P)
    # one SGD step on log loss at the served probability: lr · (y − p)
    assert s.bias == {"shoes": pytest.approx(0.5 * (1 - 0.1))}


def test_no_pctr_teaches_nothing_and_a_click_alone_moves_no_category() -> None:
    unserved = impression("i1", 0.0).model_copy(update={"pctr": None})
    s = apply_event(UserState.empty("u1", DIM), unserved, AD, P)
    assert s.bias == {}
    s = apply_event(s, click("c1", 1.0, "i1"), AD, P)
    assert s.bias == {}  # its +lr has no −p to balance it


def test_off_by_default_setting_zero() -> None:
    off = StateSettings(feedback_lr=0.0)
    s = apply_event(UserState.empty("u1", DIM), impression("i1", 0.0), AD, off)
    s = apply_event(s, click("c1", 1.0, "i1"), AD, off)
    assert s.bias == {}
    assert encode_state(s)[2] == 1  # no bias: the record stays format 1


def test_the_bias_is_clamped_and_fades_with_the_clock_half_life_only() -> None:
    p = StateSettings(feedback_lr=3.0, feedback_max=4.0, half_life_s=100.0, session_gap_s=1.0)
    s = UserState.empty("u1", DIM)
    for i in range(5):
        s = apply_event(s, impression(f"i{i}", float(i)), AD, p)
        s = apply_event(s, click(f"c{i}", float(i), f"i{i}"), AD, p)
    assert s.bias["shoes"] == pytest.approx(4.0)
    later = s.last_ts + 100.0  # past the session gap too: the bias takes no session discount
    assert bias_at(s, later, p)["shoes"] == pytest.approx(2.0)
    s2 = apply_event(s, impression("j", 104.0), AD2, p)  # the helper's times are offsets: 4 + 100
    assert s2.bias["shoes"] == pytest.approx(2.0)
    assert s2.bias["travel"] == pytest.approx(-0.3)


def test_only_the_largest_biases_are_kept() -> None:
    p = StateSettings(feedback_lr=1.0, max_intents=2)
    s = UserState.empty("u1", DIM)
    for i, (cat, pctr) in enumerate((("a", 0.1), ("b", 0.5), ("c", 0.3))):
        ad = AdInfo(f"ad-{cat}", cat, "v", "c", np.zeros(DIM, dtype=np.float32))
        imp = impression(f"i{i}", float(i)).model_copy(update={"ad_id": ad.ad_id, "pctr": pctr})
        s = apply_event(s, imp, ad, p)
    assert set(s.bias) == {"b", "c"}


def test_a_duplicate_impression_steps_once() -> None:
    s = apply_event(UserState.empty("u1", DIM), impression("i1", 0.0), AD, P)
    assert apply_event(s, impression("i1", 0.0), AD, P) is s


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["shoes", "travel", "tech"]), st.floats(-20, 20, allow_nan=False)),
        max_size=20,
    )
)
def test_the_record_round_trips_the_bias(entries: list[tuple[str, float]]) -> None:
    s = UserState.empty("u1", DIM)
    s = replace(s, bias=dict(entries))
    back = decode_state("u1", encode_state(s))
    assert same_state(back, s)
    assert encode_state(s)[2] == (2 if entries else 1)


def test_a_format_1_record_is_still_read_and_a_non_finite_bias_is_refused() -> None:
    s = apply_event(UserState.empty("u1", DIM), impression("i1", 0.0), AD, StateSettings(feedback_lr=0))
    old = encode_state(s)
    assert old[2] == 1 and decode_state("u1", old).bias == {}
    biased = replace(s, bias={"shoes": math.inf})
    with pytest.raises(StoreError, match="corrupt"):
        decode_state("u1", encode_state(biased))
    with pytest.raises(StoreError, match="corrupt"):
        decode_state(
            "u1",
            encode_state(replace(s, bias={"x": 1.0}))[:-3],
        )  # type: ignore[arg-type]


def test_serving_adds_the_users_bias_of_each_candidates_category_to_its_logit() -> None:
    from trainers.models.ranker import Ranker, RankerConfig

    bias = np.asarray([0.0, 1.5, -2.0], dtype=np.float32)  # per category code
    cats = np.asarray([2, 0, 1, 1])
    ids = np.zeros((4, 4), dtype=np.int64)
    inp = build_input(np.zeros(DIM, np.float32), np.zeros(3, np.float32), ids, cats, "feed", 3, DIM, bias)
    assert inp.offset is not None
    assert inp.offset.tolist() == [-2.0, 0.0, 1.5, 1.5]
    plain = build_input(np.zeros(DIM, np.float32), np.zeros(3, np.float32), ids, cats, "feed", 3, DIM)
    assert plain.offset is None

    from schemas.settings import Settings
    from serving.ranking import RankModel

    torch.manual_seed(0)
    model = Ranker(RankerConfig(state_dim=DIM, query_features=False)).eval()  # build_input's default
    rank = RankModel(model, "v", Settings(state_dim=DIM), torch.device("cpu"))
    with torch.inference_mode():
        logit = model(plain.dense, plain.ids)
    for use in (False, True):
        got, base = rank.score([inp, plain], use_adapters=use)
        torch.testing.assert_close(torch.from_numpy(base), torch.sigmoid(logit))
        torch.testing.assert_close(torch.from_numpy(got), torch.sigmoid(logit + inp.offset))
    # an input without offsets beside one with: zeros for it, in input order
    only = RankInput(inp.dense, inp.ids, inp.rows)
    first, second = rank.score([only, inp], use_adapters=True)
    torch.testing.assert_close(torch.from_numpy(first), torch.sigmoid(logit))
    torch.testing.assert_close(torch.from_numpy(second), torch.sigmoid(logit + inp.offset))


def test_corrected_scores_replays_the_correction_progressively_per_user_and_category() -> None:
    """A replay of the correction on a model's scores (the drift and peer benchmarks): each
    impression is scored with the bias before its own outcome, users and categories apart."""
    from datetime import UTC, datetime, timedelta

    from schemas.events import TrainingExample
    from streams.in_memory import corrected_scores

    t0 = datetime(2026, 1, 1, tzinfo=UTC)

    def ex(i: int, user: str, cat: str, clicked: bool) -> TrainingExample:
        return TrainingExample(
            event_id=f"x{i}", ts=t0 + timedelta(seconds=i), adapter_id="feed", impression_id=f"i{i}",
            impression_ts=t0 + timedelta(seconds=i), user_id=user,
            ad_id=f"ad-{cat}", campaign_id="c", advertiser_id="v", category=cat, slot="feed", position=0,
            hour=0, user_vector=[0.0], intent_score=0.0, click=clicked,
        )  # fmt: skip

    stream = [ex(0, "u1", "shoes", True), ex(1, "u1", "shoes", False), ex(2, "u2", "shoes", False)]
    stream += [ex(3, "u1", "travel", False), ex(4, "u1", "shoes", False)]
    raw = np.full(len(stream), 0.2)
    p = StateSettings(feedback_lr=1.0)
    got = corrected_scores(stream, raw, p)
    assert got[0] == pytest.approx(0.2)  # nothing learned yet
    b = 1.0 * (1 - 0.2)  # one step: lr · (y − p), faded 1 s by the 1 h half-life
    assert math.log(got[1] / (1 - got[1])) == pytest.approx(math.log(0.25) + b, abs=1e-3)
    assert got[2] == pytest.approx(0.2)  # another user
    assert got[3] == pytest.approx(0.2)  # another category
    assert got[4] < got[1]  # the non-click at 1 moved shoes down by lr · its served pctr
    np.testing.assert_allclose(corrected_scores(stream, raw, StateSettings(feedback_lr=0.0)), raw)


def test_serving_reads_the_bias_decayed_and_clamped_and_not_at_all_when_turned_off() -> None:
    from schemas.settings import Settings
    from serving.io import UserRecordCodec

    s = apply_event(UserState.empty("u1", DIM), impression("i1", 0.0), AD, P)
    forged = replace(s, bias={"shoes": 9.0, "tech": -0.5})
    data = encode_state(forged)
    codec = UserRecordCodec(Settings(state={"feedback_max": 4.0, "half_life_s": 10.0}).state)
    view = codec.view("u1", data, forged.last_ts + 10.0)
    assert view.bias == {"shoes": 4.0, "tech": pytest.approx(-0.25)}
    off = UserRecordCodec(Settings(state={"feedback_lr": 0.0}).state)
    assert off.view("u1", data, forged.last_ts).bias == {}
