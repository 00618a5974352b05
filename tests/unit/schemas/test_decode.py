"""The contract's one fast decoder (`schemas.decode`) takes exactly what the contract takes.

Whatever `BatchDecoder.fast` accepts, `model_validate_json` accepts as an equal event (fields,
fields set, JSON); what it does not accept gets the contract's own verdict from `decode`, so a
bad record is dead-lettered with the same reason on either path. Its Structs are derived from
the models, so they cannot drift: a field the fast path could not read turns it off (tested).
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any

import msgspec
import pytest
from pydantic import AfterValidator

from schemas import topics
from schemas.codec import decode, encode, model_for_topic
from schemas.decode import BatchDecoder, derive_struct, is_fast
from schemas.errors import SchemaError
from schemas.events import (
    AdCreative,
    Click,
    Conversion,
    Dwell,
    Impression,
    Message,
    TrainingExample,
    UserEvent,
)
from workloads.config import MarketConfig
from workloads.market import Market

USER_MODELS: tuple[type[Message], ...] = (Impression, Click, Dwell, Conversion)
# every model the worker decodes, from the contract's own list: a new kind of event on the
# worker's topics is held to the fast path here without a test edit
WORKER_MODELS: tuple[type[Message], ...] = tuple(model_for_topic(t) for t in topics.USER_INPUTS)


@functools.cache
def market_events(n: int, seed: int) -> list[Message]:
    market = Market(MarketConfig(seed=seed, n_users=300, n_ads=60, rate=20.0))
    out: list[Message] = []
    for e in market.open_loop(n):
        out.append(e)
        if sum(not isinstance(x, AdCreative) for x in out) >= n:
            break
    return out


TIMES = [
    "2026-01-01T00:00:00Z", "2026-01-01T00:00:00.5+01:00", "2026-01-01 00:00:00+01:00",
    "2026-01-01t00:00:00z", "2026-01-01T00:00:00.1234567Z", "2026-01-01T00:00Z", "2026-01-01T00Z",
    "2026-02-30T00:00:00Z", "2026-01-01T24:00:00Z", "2026-01-01T23:59:60Z", "2026-01-01T00:00:00+24:00",
    "2026-01-01T00:00:00", "2026-01-01", "20260101T000000Z", "2026-W01-1T00:00:00Z",
    "2026-01-01T00:00:00 +01:00", "1969-12-31T23:59:59Z", "1970-01-01T00:00:00Z",
    "2105-12-31T23:59:59.999999Z", "2106-01-01T00:00:00Z", "0001-01-01T00:00:00Z",
    "9999-12-31T23:59:59Z", "1700000000", "1700000000.5", "-1", "0", "123e-5", "1234-5",
    "2026-01-01T00:00:00-00:00", "2026-01-01T00:00:00+00:00", "  2026-01-01T00:00:00Z",
    "2026-01-01T00:00:00.000001-23:59", "1970-01-01T00:30:00+01:00", "2105-12-31T23:30:00-01:00",
    "2026-01-01T00:00:00Z\n", "2026-01-01T00:00:00.Z", "2026-01-01T00:00:00,5Z",
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
    for field in [k for k, v in obj.items() if isinstance(v, int | float) and not isinstance(v, bool)]:
        for number in (-1, 0, 1.0, 1.5, 1e400, 2**64, 10_001, "1", True):
            out.append(json.dumps({**obj, field: number}).encode().replace(b"Infinity", b"1e400"))
    for field in ("sig", "click_token"):  # patterns end in `$`: a final newline is no match
        if obj.get(field):
            out.append(json.dumps({**obj, field: obj[field] + "\n"}, ensure_ascii=False).encode())
            out.append(json.dumps({**obj, field: obj[field].upper()}).encode())
    text = raw.decode()
    out += [
        text.replace('"ts":', '"ts":"1700000000","ts":', 1).encode(),  # duplicate keys: the last wins
        text.replace('"ts":', '"\\u0074s":', 1).encode(),  # an escaped key
        (text[:-1] + ',"ts":"1700000000"}').encode(),
        (text[:-1] + ',"ts":"2026-02-01T00:00:00Z"}').encode(),
        (text[:-1] + ',"extra":"ts"}').encode(),
        text.replace('"ts":"', '"ts":"\\u0032', 1).encode(),  # escaped digit in the text
        json.dumps({k: v for k, v in obj.items() if k != "ts"}).encode(),
        json.dumps({k: v for k, v in obj.items() if k != "kind"}).encode(),
        json.dumps({**obj, "kind": "other"}).encode(),
        json.dumps({**obj, "kind": None}).encode(),
        json.dumps([obj]).encode(),
        b"\xef\xbb\xbf" + raw,
        b"null",
        b"",
    ]
    # raw (unescaped) bytes in an id: control characters, DEL, non-ASCII, invalid UTF-8
    uid = f'"{obj["user_id"]}"'.encode()
    for bad in (b"\x01", b"\t", b"\x7f", b"\xc2\x85", b"\xe2\x80\xae", "é".encode() * 64, b"\xff", b"\x00"):
        out += [raw.replace(uid, b'"u' + bad + b'x"', 1), raw.replace(uid, b'"' + bad + b'"', 1)]
    return out


def contract(model: type[Message], raw: bytes | None) -> Message | None:
    try:
        return model.model_validate_json(raw)  # type: ignore[arg-type]
    except ValueError:
        return None


@pytest.mark.parametrize("model", USER_MODELS, ids=lambda m: m.__name__)
def test_the_fast_path_accepts_only_what_the_contract_accepts_as_the_same_event(
    model: type[Message],
) -> None:
    decoder = BatchDecoder(model)
    valid = [e for e in market_events(3000, seed=9) if type(e) is model][:40]
    assert valid, model
    assert decoder.fast([encode(e) for e in valid]) == valid  # the common case is the fast one
    accepted = refused = 0
    for e in valid:
        records = hostile(e)
        for raw, got in zip(records, decoder.fast(records), strict=True):
            want = contract(model, raw)
            if got is None:
                refused += 1
                continue
            accepted += 1
            assert want is not None, raw
            assert type(got) is model and got == want, raw
            assert got.model_fields_set == want.model_fields_set and encode(got) == encode(want)
            assert got.ts.timestamp() == want.ts.timestamp()
    assert accepted > len(valid) and refused > len(valid)


@pytest.mark.parametrize("model", USER_MODELS, ids=lambda m: m.__name__)
def test_every_record_gets_the_contracts_verdict_and_reason(model: type[Message]) -> None:
    """`decode`: the event, or the very SchemaError `codec.decode` raises (the dead letter's
    error and, from its cause, its reason), for every hostile record of a batch."""
    e = next(x for x in market_events(3000, seed=9) if type(x) is model)
    records: list[bytes | None] = [*hostile(e), None]
    for raw, got in zip(records, BatchDecoder(model).decode(records), strict=True):
        try:
            want: Message | str = decode(model, raw)  # type: ignore[arg-type]
        except SchemaError as exc:
            want = str(exc)
        if isinstance(got, SchemaError):
            assert str(got) == want and got.__cause__ is not None, raw
        else:
            assert got == want, raw


def test_a_batch_mixes_both_paths_in_order() -> None:
    events = [e for e in market_events(3000, seed=9) if type(e) is Impression][:5]
    bad = encode(events[1]).replace(b'"feed"', b'"Side bar"').replace(b'"search"', b'"Side bar"')  # no slot
    batch: list[bytes | None] = [encode(events[0]), bad, encode(events[2]), None, encode(events[3]) + b" "]
    got = BatchDecoder(Impression).decode(batch)
    assert [type(g).__name__ for g in got] == [
        "Impression",
        "SchemaError",
        "Impression",
        "SchemaError",
        "Impression",
    ]
    assert got[0] == events[0] and got[2] == events[2] and got[4] == events[3]


@pytest.mark.parametrize("model", [*WORKER_MODELS, TrainingExample], ids=lambda m: m.__name__)
def test_the_structs_are_the_models_fields(model: type[Message]) -> None:
    """Derived from the model, in its order, with its defaults: a field added to the contract
    (an Impression's optional fields, a new event) is in the Struct, or the fast path is off and
    this fails."""
    assert is_fast(model), model
    struct, _, defaults = derive_struct(model)
    assert struct.__struct_fields__ == tuple(model.model_fields)
    required = {n for n, f in model.model_fields.items() if f.is_required()}
    assert set(model.model_fields) - set(defaults) == required
    assert all(defaults[n] == model.model_fields[n].default for n in defaults)
    every, _, _ = derive_struct(model, every=True)  # read first: the record writing every field
    assert every.__struct_fields__ == struct.__struct_fields__ and not every.__struct_defaults__
    assert BatchDecoder(model).enabled


def test_a_validator_it_does_not_know_turns_the_fast_path_off() -> None:
    def odd(v: str) -> str:
        if v == "odd":
            raise ValueError("odd")
        return v

    class Odd(UserEvent):
        note: Annotated[str, AfterValidator(odd)]

    decoder = BatchDecoder(Odd)
    assert not decoder.enabled and not is_fast(Odd)
    raw = b'{"event_id":"e","ts":"2026-01-01T00:00:00Z","user_id":"u","note":"odd"}'
    assert decoder.fast([raw]) == [None]
    assert isinstance(decoder.decode([raw])[0], SchemaError)


def test_an_added_optional_field_is_read_and_its_default_kept() -> None:
    class Wider(Click):
        ab_arm: Annotated[str, msgspec.Meta()] | None = None  # type: ignore[valid-type]
        weight: float = 1.0

    decoder = BatchDecoder(Wider)
    assert decoder.enabled
    base = json.loads(encode(next(e for e in market_events(3000, seed=9) if type(e) is Click)))
    plain = json.dumps(base).encode()
    armed = json.dumps({**base, "ab_arm": "control", "weight": 2}).encode()
    got = decoder.fast([plain, armed])
    assert got == [Wider.model_validate_json(plain), Wider.model_validate_json(armed)]
    assert got[0] is not None and got[0].model_fields_set == Wider.model_validate_json(plain).model_fields_set


def test_the_examples_json_is_pydantics_at_the_contracts_bounds() -> None:
    """`schemas.codec.example_json` (msgspec) writes the bytes `encode` (pydantic) writes, for
    every float the contract lets a TrainingExample carry and text with control characters."""
    from schemas.codec import example_json

    base = TrainingExample.model_validate_json(
        json.dumps(
            {
                "event_id": "te-1", "ts": "2026-01-01T00:00:00.5+02:00", "adapter_id": "feed",
                "impression_id": "i1", "impression_ts": "2026-01-01T00:00:00Z", "user_id": "u1",
                "ad_id": "a1", "campaign_id": "c1", "advertiser_id": "v1", "category": "shoes",
                "slot": "feed", "position": 3, "hour": 0, "user_vector": [], "intent_score": 0.0,
                "click": False, "model_version": "m\x01\n\u2028é\"\\",
            }
        )
    )  # fmt: skip
    floats = [0.0, -0.0, 1e6, -1e6, 999999.9999999999, 1e-7, 5e-324, 0.1, 1 / 3, 123456.789, 1e-300, 2.5e-5]
    for x in floats:
        ex = base.model_copy(update={"user_vector": floats, "intent_score": x, "recall_score": -x})
        assert example_json(ex) == encode(ex)
    assert example_json(base) == encode(base)


SLOTS = ["feed", "Feed", "feed\n", "side bar", "x" * 33, "-feed", "", "feed\u00e9", "s" * 32, "a_b-c9"]


@pytest.mark.parametrize("remembered", [2, 16_384])
def test_texts_it_remembers_never_pass_one_the_contract_refuses(
    monkeypatch: pytest.MonkeyPatch, remembered: int
) -> None:
    """The decoder checks the contract's text patterns (slot, sig, click token) and timestamps
    itself and remembers the texts that passed (forgetting them all past a bound): a valid
    record seen first never lets a near copy through, before or after the bound, and every
    verdict is the contract's."""
    import schemas.decode

    monkeypatch.setattr(schemas.decode, "_REMEMBERED", remembered)
    decoder = BatchDecoder(Impression)
    assert {name for name, _, _ in decoder.patterns} == {"slot", "sig"}  # the Struct checks no pattern
    events = [e for e in market_events(3000, seed=9) if type(e) is Impression][:12]
    valid = [encode(e) for e in events]
    variants = []
    for e in events[:4]:
        obj = json.loads(encode(e))
        variants += [json.dumps({**obj, "slot": slot}, ensure_ascii=False).encode() for slot in SLOTS]
        variants += [json.dumps({**obj, "ts": ts}, ensure_ascii=False).encode() for ts in TIMES]
        sig = obj["sig"] or "0" * 64
        sigs = (sig + "\n", sig.upper(), sig[:-1], "g" * 64)
        variants += [json.dumps({**obj, "sig": s}).encode() for s in sigs]
    for batch in (valid, variants, valid, variants):
        for raw, got in zip(batch, decoder.fast(batch), strict=True):
            want = contract(Impression, raw)
            assert got is None or (want is not None and got == want and encode(got) == encode(want)), raw
            assert got is not None or raw in variants  # the valid ones stay on the fast path
    assert len(decoder._parsed) <= remembered and all(len(m) <= remembered for _, _, m in decoder.patterns)
