"""The worker's fast paths give exactly what the validating paths give.

* `streams.join.unchecked_example`: the join builds TrainingExamples without validating them (every
  field is valid by construction); each must equal its validated twin and survive the wire.
* `streams.ingest.FastDecoder`: input records decoded without the contract's Python validators,
  whose rules are checked afterwards; whatever it accepts the contract accepts as the same
  event, and what it does not accept goes to the contract's path (dead letter, same reason).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from schemas.codec import decode, encode, encoder
from schemas.events import AdCreative, Click, Conversion, Dwell, Impression, Message, TrainingExample
from schemas.settings import Settings
from streams.in_memory import replay
from streams.ingest import FastDecoder
from streams.join import unchecked_example
from workloads.config import MarketConfig
from workloads.market import Market


def market_events(n: int, seed: int) -> list[Message]:
    market = Market(MarketConfig(seed=seed, n_users=300, n_ads=60, rate=20.0))
    out: list[Message] = []
    for e in market.open_loop(n):
        out.append(e)
        if sum(not isinstance(x, AdCreative) for x in out) >= n:
            break
    return out


@pytest.mark.parametrize(
    ("label_mode", "scheme"),
    [("hold", "slot"), ("fn_weighted", "slot+advertiser"), ("fn_calibrated", "advertiser")],
)
def test_every_example_the_join_emits_equals_its_validated_twin(label_mode: str, scheme: str) -> None:
    s = Settings(
        online={"label_mode": label_mode}, adapter_scheme=scheme, streams={"attribution_window_s": 120.0}
    )
    examples = replay(market_events(4000, seed=5), s).examples
    kinds = {e.label_kind for e in examples}
    assert len(examples) > 50 and (kinds == {"final"}) == (label_mode == "hold"), kinds
    for ex in examples:
        assert tuple(ex.__dict__) == tuple(TrainingExample.model_fields)
        twin = TrainingExample.model_validate(ex.model_dump())
        assert twin == ex and twin.model_dump() == ex.model_dump()
        assert decode(TrainingExample, encode(ex)) == ex
        assert encode(twin) == encode(ex) == encoder(TrainingExample)(ex)  # as the worker encodes it


def test_an_unchecked_example_is_the_validated_one() -> None:
    ex = replay(market_events(300, seed=6), Settings()).examples[0]
    assert unchecked_example(dict(ex.__dict__)) == TrainingExample(**ex.__dict__)


USER_MODELS: tuple[type[Message], ...] = (Impression, Click, Dwell, Conversion)
TIMES = [
    "2026-01-01T00:00:00Z", "2026-01-01T00:00:00.5+01:00", "2026-01-01 00:00:00+01:00",
    "2026-01-01t00:00:00z", "2026-01-01T00:00:00.1234567Z", "2026-01-01T00:00Z", "2026-01-01T00Z",
    "2026-02-30T00:00:00Z", "2026-01-01T24:00:00Z", "2026-01-01T23:59:60Z", "2026-01-01T00:00:00+24:00",
    "2026-01-01T00:00:00", "2026-01-01", "20260101T000000Z", "2026-W01-1T00:00:00Z",
    "2026-01-01T00:00:00 +01:00", "1969-12-31T23:59:59Z", "1970-01-01T00:00:00Z",
    "2105-12-31T23:59:59.999999Z", "2106-01-01T00:00:00Z", "0001-01-01T00:00:00Z",
    "9999-12-31T23:59:59Z", "1700000000", "1700000000.5", "-1", "0", "123e-5", "1234-5",
    "2026-01-01T00:00:00-00:00", "2026-01-01T00:00:00+00:00", "  2026-01-01T00:00:00Z",
]  # fmt: skip
TIME_VALUES: list[Any] = [*TIMES, 1700000000, 1.7e9, None, True, [], {}]
IDS = [
    "\u202e", "a\nb", "tab\tx", " ", "", "é" * 64, "😀" * 64, "😀" * 63 + "a", "😀" * 32,
    "x" * 64, "x" * 65, "x" * 128, "x" * 129, "😀" * 128, "a\u200bb", "\x7f", 12345, None,
]  # fmt: skip


def hostile(e: Message) -> list[bytes]:
    """Variants of one valid event: every timestamp and id above, escapes, duplicate keys, …"""
    raw = encode(e)
    obj: dict[str, Any] = json.loads(raw)
    out = [raw, raw.replace(b'"ts":', b'"ts" :\n '), b" " + raw + b"\n", raw[:-1], b"\xff" + raw]
    for ts in TIME_VALUES:
        out.append(json.dumps({**obj, "ts": ts}, ensure_ascii=False).encode())
    for field in [k for k, v in obj.items() if isinstance(v, str) and k not in ("ts", "kind", "slot")]:
        for value in IDS:
            out.append(json.dumps({**obj, field: value}, ensure_ascii=False).encode())
            out.append(json.dumps({**obj, field: value}).encode())  # \u escapes
    text = raw.decode()
    out += [
        text.replace('"ts":', '"ts":"1700000000","ts":', 1).encode(),  # duplicate keys: the last wins
        text.replace('"ts":', '"\\u0074s":', 1).encode(),  # an escaped key
        (text[:-1] + ',"ts":"1700000000"}').encode(),
        (text[:-1] + ',"extra":"ts"}').encode(),
        text.replace('"ts":"', '"ts":"\\u0032', 1).encode(),  # escaped digit in the text
        json.dumps({k: v for k, v in obj.items() if k != "ts"}).encode(),
        json.dumps({k: v for k, v in obj.items() if k != "kind"}).encode(),
        json.dumps({**obj, "kind": "other"}).encode(),
        json.dumps([obj]).encode(),
        b"null",
        b"",
    ]
    # raw (unescaped) bytes in an id: control characters, DEL, non-ASCII, invalid UTF-8
    uid = f'"{obj["user_id"]}"'.encode()
    for bad in (b"\x01", b"\t", b"\x7f", b"\xc2\x85", b"\xe2\x80\xae", "é".encode() * 64, b"\xff", b"\x00"):
        out += [raw.replace(uid, b'"u' + bad + b'x"', 1), raw.replace(uid, b'"' + bad + b'"', 1)]
    return out


def contract(model: type[Message], raw: bytes) -> Message | None:
    try:
        return model.model_validate_json(raw)
    except ValueError:
        return None


@pytest.mark.parametrize("model", USER_MODELS, ids=lambda m: m.__name__)
def test_the_fast_decoder_accepts_only_what_the_contract_accepts_as_the_same_event(
    model: type[Message],
) -> None:
    fast = FastDecoder(model)
    valid = [e for e in market_events(3000, seed=9) if type(e) is model][:40]
    assert valid, model
    accepted = refused = 0
    for e in valid:
        assert fast.decode(encode(e)) == e  # the common case is the fast one
        for raw in hostile(e):
            got, want = fast.decode(raw), contract(model, raw)
            if got is None:
                refused += 1
                continue
            accepted += 1
            assert want is not None, raw
            assert type(got) is model and got == want, raw
            assert got.model_fields_set == want.model_fields_set and encode(got) == encode(want)
            timed = fast.decode_ts(raw)
            assert timed is not None and timed[0] == want and timed[1] == want.ts.timestamp()
    assert accepted > len(valid) and refused > len(valid)


def test_the_fast_decoder_knows_the_validators_it_takes_out() -> None:
    assert FastDecoder(Impression).ids == [
        "event_id", "user_id", "request_id", "ad_id", "campaign_id", "advertiser_id",
    ]  # fmt: skip
    assert FastDecoder(Conversion).times == ["ts"]
    with pytest.raises(TypeError, match="does not know"):
        FastDecoder(TrainingExample)  # its vector's validator
