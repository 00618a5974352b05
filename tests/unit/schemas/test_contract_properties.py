"""Property tests: whatever the contract accepts survives the wire unchanged."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.codec import decode, decode_any, encode
from schemas.events import (
    SLOTS,
    AdapterDelta,
    Click,
    Conversion,
    DeadLetter,
    Dwell,
    Impression,
    TrainingExample,
)

# ids refuse control, format and separator characters (`str.isprintable`); the ASCII space is fine
_printable = st.characters(
    codec="utf-8", exclude_categories=("Cs", "Cc", "Cf", "Co", "Cn", "Zl", "Zp", "Zs"), include_characters=" "
)
ids = st.text(_printable, min_size=1, max_size=64).filter(lambda v: len(v.encode()) <= 255)
offsets = st.integers(-14 * 60, 14 * 60).map(lambda m: timezone(timedelta(minutes=m)))
stamps = st.builds(
    lambda d, tz: d.replace(tzinfo=UTC).astimezone(tz),
    st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1)),
    offsets,
)
money = st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False)

impressions = st.builds(
    Impression,
    event_id=ids,
    ts=stamps,
    user_id=ids,
    request_id=ids,
    ad_id=ids,
    campaign_id=ids,
    advertiser_id=ids,
    slot=st.sampled_from(SLOTS),
    position=st.integers(0, 10_000),
    price=money,
    pctr=st.none() | st.floats(0, 1),
    model_version=st.none() | ids,
    adapter_version=st.none() | ids,
)
clicks = st.builds(Click, event_id=ids, ts=stamps, user_id=ids, impression_id=ids, ad_id=ids, campaign_id=ids)
dwells = st.builds(
    Dwell,
    event_id=ids,
    ts=stamps,
    user_id=ids,
    impression_id=ids,
    ad_id=ids,
    dwell_ms=st.integers(0, 3_600_000),
)
conversions = st.builds(
    Conversion,
    event_id=ids,
    ts=stamps,
    user_id=ids,
    campaign_id=ids,
    advertiser_id=ids,
    value=money,
    ad_id=st.none() | ids,
)
dead_letters = st.builds(
    DeadLetter,
    event_id=ids,
    ts=stamps,
    source_topic=ids,
    partition=st.integers(-1, 1000),
    offset=st.integers(-1, 2**62),
    error=ids,
    raw=st.binary(max_size=512),
)
deltas = st.builds(
    AdapterDelta,
    event_id=ids,
    ts=stamps,
    adapter_id=ids,
    base_version=ids,
    seq=st.integers(0, 2**53 - 1),
    rank=st.integers(1, 256),
    payload=st.binary(min_size=1, max_size=256),
    norm=money,
    created_at=stamps,
    snapshot=st.booleans(),
)
examples = st.builds(
    TrainingExample,
    event_id=ids,
    ts=stamps,
    adapter_id=ids,
    impression_id=ids,
    impression_ts=stamps,
    user_id=ids,
    ad_id=ids,
    campaign_id=ids,
    advertiser_id=ids,
    category=ids,
    slot=st.sampled_from(SLOTS),
    position=st.integers(0, 100),
    hour=st.integers(0, 23),
    user_vector=st.lists(st.floats(-1e6, 1e6, allow_nan=False), max_size=64),
    intent_score=st.floats(-1e6, 1e6),
    click=st.booleans(),
    dwell_ms=st.integers(0, 3_600_000),
)
any_message = st.one_of(impressions, clicks, dwells, conversions, dead_letters, deltas, examples)


@settings(max_examples=150, deadline=None)
@given(any_message)
def test_round_trip_through_the_wire(msg: object) -> None:
    wire = encode(msg)  # type: ignore[arg-type]
    assert decode(type(msg), wire) == msg  # type: ignore[arg-type]
    assert decode_any(wire) == msg


@settings(max_examples=100, deadline=None)
@given(impressions)
def test_timestamps_keep_their_instant(msg: Impression) -> None:
    back = decode(Impression, encode(msg))
    assert back.ts == msg.ts and back.ts.utcoffset() is not None
