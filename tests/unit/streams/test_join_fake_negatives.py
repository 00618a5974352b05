"""Delayed feedback in the label join: fake-negative modes emit at once, hold emits final labels."""

from __future__ import annotations

import pytest
from streams_helpers import click, creative, dwell, impression

from schemas.settings import Settings
from streams.in_memory import replay, training_examples
from streams.join import example_id

FN = Settings(
    streams={"attribution_window_s": 60.0, "watermark_window": 1}, online={"label_mode": "fn_weighted"}
)
HOLD = FN.model_copy(update={"online": FN.online.model_copy(update={"label_mode": "hold"})})


def _events() -> list:  # type: ignore[type-arg]
    return [
        creative(),
        impression("i1", 0),
        impression("i2", 1),
        click("c1", 5, "i1"),
        dwell("d1", 25, "i1", 20_000),
        dwell("d2", 6, "i2", 1500),
        click("c0", 7, "i0"),  # before its impression
        impression("i0", 7.5),
        click("c2", 200, "i2"),  # after i2's window: late in both modes
        impression("i3", 300),  # closes every window
    ]


def test_fake_negative_mode_emits_every_label_when_it_is_known() -> None:
    out = replay(_events(), FN).examples
    got = [(e.impression_id, e.label_kind, e.click, e.dwell_ms) for e in out]
    assert got == [
        ("i1", "fake_negative", False, 0),  # at the impression, not 60 s later
        ("i2", "fake_negative", False, 0),
        ("i1", "click", True, 0),
        ("i1", "dwell", True, 20_000),
        ("i2", "dwell", False, 1500),
        ("i0", "fake_negative", False, 0),
        ("i0", "click", True, 0),
        ("i3", "fake_negative", False, 0),
    ]
    by = {(e.impression_id, e.label_kind): e for e in out}
    assert by["i1", "fake_negative"].ts == impression("i1", 0).ts
    assert by["i1", "click"].ts == click("c1", 5, "i1").ts
    assert by["i1", "fake_negative"].event_id == example_id("i1")
    assert by["i1", "click"].event_id == example_id("i1", "click") != example_id("i1")
    assert len({e.event_id for e in out}) == len(out)  # dedupe by event id keeps each label
    assert by["i0", "click"].ts == impression("i0", 7.5).ts  # the orphan joined at its impression


def test_hold_mode_emits_one_final_example_per_impression() -> None:
    out = replay(_events(), HOLD).examples
    got = [(e.impression_id, e.label_kind, e.click, e.dwell_ms) for e in out]
    assert got == [("i1", "final", True, 0), ("i0", "final", True, 0), ("i2", "final", False, 1500)]
    assert {e.event_id for e in out} == {example_id(i) for i in ("i0", "i1", "i2")}


def test_both_modes_carry_the_same_clicks_and_features() -> None:
    fn = replay(_events(), FN).examples
    hold = replay(_events(), HOLD).examples
    clicked = {e.impression_id for e in hold if e.click}
    assert clicked == {e.impression_id for e in fn if e.label_kind == "click"}
    final = {e.impression_id: e for e in hold}
    for e in fn:
        if e.impression_id in final:
            assert e.user_vector == final[e.impression_id].user_vector
            assert e.intent_score == final[e.impression_id].intent_score


def test_offline_training_data_has_final_labels_whatever_the_worker_mode() -> None:
    out = list(training_examples(_events(), FN))
    assert {e.label_kind for e in out} == {"final"} and len(out) == 4
    fn = list(training_examples(_events(), FN, label_mode="fn_calibrated"))
    assert {e.label_kind for e in fn} == {"fake_negative", "click", "dwell"}


def test_default_mode_learns_at_once() -> None:
    assert Settings().online.label_mode in ("fn_weighted", "fn_calibrated")
    with pytest.raises(ValueError, match="label_mode"):
        Settings(online={"label_mode": "later"})  # type: ignore[arg-type]


def test_an_example_takes_its_event_s_own_utc_time_and_a_utc_copy_of_any_other_offset() -> None:
    from datetime import UTC, datetime, timedelta, timezone

    from schemas.codec import decode, encode
    from schemas.events import Click, Impression, TrainingExample

    # decoded from the wire, as the worker has them ("Z", and an offset the producer chose)
    utc = decode(Impression, encode(impression("iz", 0)))
    east = impression("ie", 0.5).model_copy(
        update={"ts": impression("ie", 0.5).ts.astimezone(timezone(timedelta(hours=2)))}
    )
    clk = decode(Click, encode(click("cz", 3.25, "iz")))
    out = replay([creative(), utc, east, clk], FN).examples
    by = {(e.impression_id, e.label_kind): e for e in out}
    for (iid, kind), source in {("iz", "fake_negative"): utc, ("ie", "fake_negative"): east,
                                ("iz", "click"): clk}.items():  # fmt: skip
        ex = by[iid, kind]
        fresh = datetime.fromtimestamp(source.ts.timestamp(), tz=UTC)
        assert ex.ts == fresh and ex.ts.utcoffset() == timedelta(0)
        # the bytes on the training topic are those of a freshly made UTC time
        assert encode(ex) == encode(ex.model_copy(update={"ts": fresh}))
        assert TrainingExample.model_validate(ex.model_dump()) == ex
    assert by["ie", "fake_negative"].ts.tzinfo is UTC  # the +02:00 event's time, in UTC
