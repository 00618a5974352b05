"""The trainer's fast decoder takes exactly what the contract takes (trainers.intake)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers_trainers import make_examples

from schemas import codec
from schemas.errors import SchemaError
from schemas.events import TrainingExample
from trainers.intake import ExampleDecoder, take_ready
from trainers.models.features import featurize
from trainers.models.ranker import RankerConfig
from trainers.reorder import DelayBuffer

BASE = json.loads(codec.encode(make_examples(1, dim=4)[0]))


def _record(**changes: Any) -> bytes:
    fields = {**BASE, **changes}
    return json.dumps({k: v for k, v in fields.items() if v is not _GONE}, ensure_ascii=False).encode()


_GONE = object()
HOSTILE: list[bytes | None] = [
    None,
    b"",
    b"not json",
    b"[]",
    b'{"event_id": "e1"}',
    b"\xff\xfe",
    _record(extra_field=1),
    _record(click=_GONE),
    _record(adapter_id=_GONE),
    _record(kind="impression"),
    _record(slot="Side bar"),  # no slot under any contract (issue 34 opens slots to a pattern)
    _record(label_kind="bogus"),
    _record(position="3"),
    _record(position=3.0),
    _record(position=True),
    _record(position=-1),
    _record(position=10_001),
    _record(hour=24),
    _record(hour=-1),
    _record(dwell_ms=3_600_001),
    _record(click=1),
    _record(intent_score="0.5"),
    _record(intent_score=1e7),
    _record(served_pctr=1.5),
    _record(recall_score=-2e6),
    _record(user_vector=[0.1] * 1025),
    _record(user_vector=[0.1, 2e6]),
    _record(user_vector=[-1e6 - 1]),
    _record(user_vector="0.1"),
    _record(user_vector=[0.1, "0.2"]),
    _record(ad_id=""),
    _record(ad_id="a" * 65),
    _record(ad_id="\U0001f600" * 64),  # 64 characters, 256 UTF-8 bytes
    _record(ad_id="ad\u200b1"),  # zero width space: not printable
    _record(user_id="u\u202e1"),  # bidi override
    _record(category="c\x001"),  # escaped NUL
    _record(ts="1700000000"),
    _record(ts=1700000000),
    _record(ts="2026-01-01T00:00:00"),  # naive
    _record(ts="2200-01-01T00:00:00Z"),
    _record(ts="1969-12-31T23:59:59Z"),
    _record(ts="2026-01-01"),
    _record(impression_ts="1700000000.5"),
    _record(impression_ts="2026-13-01T00:00:00Z"),
    _record(impression_ts=None),
    _record(event_id="x" * 65),
]
# the rules' edges and spellings the contract takes; some take the contract's path (escapes)
VALID: list[bytes] = [
    _record(),
    _record(position=10_000, hour=23, dwell_ms=3_600_000, served_pctr=1.0, recall_score=-1e6),
    _record(user_vector=[1e6, -1e6, 0.0, 5e-324]),
    _record(user_vector=[]),
    _record(ad_id="é" * 64, category="\u00e9t\u00e9"),
    _record(ad_id="\U0001f600" * 63),  # 252 bytes
    _record(ts="2026-01-01T01:00:00+01:00", impression_ts="2026-01-01 00:00:00.5Z"),
    _record(ts="2105-12-31T23:59:59.999999Z", impression_ts="1970-01-01T00:00:00Z"),
    _record(category="ts"),  # a second `"ts"`: the contract decides
    _record(ad_id='a"d'),  # an escape: the contract decides
    b'{"ts": "2026-01-01T00:00:00Z", ' + _record(ts=_GONE)[1:],
]

# spellings whose fate the test does not presume: only that both paths agree
EDGE: list[bytes] = [
    _record(ts="2026-01-01T00:00:00.1234567Z"),
    _record(ts="2026-01-01T00:00:00z"),
    _record(ts="2026-01-01T23:59:60Z"),
    _record(ts="2026-01-01T00:00:00+24:00"),
    _record(ts="1970-01-01T00:30:00+01:00"),  # local 1970, before MIN_TS in UTC
    _record(ts="2105-12-31T23:30:00-01:00"),  # local 2105, MAX_TS in UTC
    _record(ts="0001-01-01T00:00:00Z"),
    _record(ts=" 2026-01-01T00:00:00Z"),
    _record(ts="2026-01-01T00:00:00Z ", impression_ts="20260101T000000Z"),
    _record(ts="2026-01-01T00:00:00 Z"),
    _record(ts="1e9"),
    _record(ts="nan"),
    _record(position=1e2),
    _record(position=12345678901234567890),
    _record(intent_score=1e400),
    _record(user_vector=[1e400]),
    b'{"ts": "1700000000", ' + _record()[1:],  # a second `ts`, numeric text first
    _record()[:-1] + b', "ts": "1700000000"}',  # ... or last
    _record()[:-1] + b', "ts": "2026-02-01T00:00:00Z"}',
    _record().replace(b'"ts": "2', b'"ts": "\\u0032'),  # an escaped first digit
    _record().replace(b'"ts"', b'"t\\u0073"'),  # an escaped key
    b"  " + _record() + b"\n",
    _record(ad_id="X").replace(b'"X"', rb'"a\u0000b"'),  # an escaped NUL
    _record(ad_id="X").replace(b'"X"', rb'"\ud800"'),  # a lone surrogate
]


def _contract(value: bytes | None) -> TrainingExample | str:
    try:
        return TrainingExample.model_validate_json(value)  # type: ignore[arg-type]
    except Exception as exc:  # any refusal
        return type(exc).__name__


@pytest.mark.parametrize("value", HOSTILE + VALID + EDGE)
def test_the_fast_path_accepts_and_refuses_what_the_contract_does(value: bytes | None) -> None:
    want = _contract(value)
    (got,) = ExampleDecoder().decode([value])
    if isinstance(want, str):
        assert isinstance(got, SchemaError)
        with pytest.raises(SchemaError) as ref:
            codec.decode(TrainingExample, value)  # type: ignore[arg-type]
        assert str(got) == str(ref.value)  # the same dead-letter reason
    else:
        assert isinstance(got, TrainingExample)
        assert got == want
        assert got.model_fields_set == want.model_fields_set
        assert got.model_dump() == want.model_dump()


def test_hostile_records_are_refused_by_the_contract_too() -> None:
    """The hostile list really is hostile (a record the contract takes would test nothing)."""
    assert all(isinstance(_contract(v), str) for v in HOSTILE)
    assert all(isinstance(_contract(v), TrainingExample) for v in VALID)


def test_plain_records_take_the_fast_path_and_a_batch_mixes_both() -> None:
    decoder = ExampleDecoder()
    plain = [codec.encode(e) for e in make_examples(50, dim=8)]
    assert all(e is not None for e in decoder.fast(plain))
    batch = [plain[0], HOSTILE[26], plain[1], HOSTILE[3], VALID[9], plain[2]]  # a bad vector among good
    got = decoder.decode(batch)
    assert [isinstance(g, TrainingExample) for g in got] == [True, False, True, False, True, True]
    for value, g in zip(batch, got, strict=True):
        want = _contract(value)
        assert g == want if isinstance(g, TrainingExample) else isinstance(want, str)


def _fn_examples(n: int, kind: str) -> list[tuple[TrainingExample, tuple[int, int]]]:
    exs = make_examples(n, dim=4)
    return [(e.model_copy(update={"label_kind": kind}), (0, i)) for i, e in enumerate(exs)]


def test_take_ready_keeps_the_features_when_nothing_is_held_or_released() -> None:
    cfg = RankerConfig(state_dim=4)
    decoded = _fn_examples(8, "fake_negative")
    features = featurize([e for e, _ in decoded], cfg)
    ready, rows = take_ready(DelayBuffer(60.0), decoded, features)
    assert ready == decoded
    assert rows is features  # the step reuses them instead of featurizing again


def test_take_ready_drops_the_features_when_the_hold_reorders() -> None:
    cfg = RankerConfig(state_dim=4)
    held = DelayBuffer(60.0)
    decoded = _fn_examples(3, "fake_negative") + _fn_examples(2, "final")
    ready, rows = take_ready(held, decoded, featurize([e for e, _ in decoded], cfg))
    assert ready == decoded[:3]
    assert rows is None
    assert len(held) == 2
    nothing, rows = take_ready(None, decoded, None)
    assert nothing == decoded
