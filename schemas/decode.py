"""The contract's one fast decoder: a fetch of JSON records → models, validated as the models do.

`BatchDecoder(model)` derives from the model's own pydantic core schema a msgspec Struct with the
same fields, types and constraints (`derive_struct`: strict types, unknown fields refused, the
same length, range, pattern and literal rules), so it cannot drift from the model: a field or
constraint it does not know turns the fast path off for that model (every record then goes to
the contract) instead of being skipped. The rules the schema runs as Python validators are
re-applied afterwards, for the batch:

- ids (`_fits_bytes`): printable text of at most 255 UTF-8 bytes (the length limits stay in the
  Struct); a record of ASCII bytes without DEL has only such ids (JSON text holds no raw control
  character, and its longest id is 128 characters), so `ids_fit` runs only on other records;
- timestamps (`_not_a_number`, `_in_range`): read as text matching `TS_TEXT` (RFC 3339 with a
  four-digit year, `T`, at most six fractional digits and an offset: text the contract's
  datetime parser reads as the same instant, never a number), then parsed
  (`datetime.fromisoformat`) and kept within 1970 … 2106; each text once (the times of texts
  that passed are kept, up to `_REMEMBERED` a decoder);
- text patterns (slot names, signatures, click tokens): the contract's own, checked after the
  Struct (which keeps the lengths) with the texts that matched remembered the same way: msgspec
  ran `re` on every value, half of an impression's decode;
- vectors (`TrainingExample._finite_vector`): every component finite and within ±`MAX_FEATURE`,
  one numpy pass over the batch.

Records with a backslash anywhere go to the contract (escapes could hide a key or a character
from these checks). A record the fast path does not accept is decided by the contract
(`schemas.codec.decode`): a SchemaError with the reason the contract gives, which the caller
dead-letters. So every record the fast path accepts, the contract accepts as an equal event
(same fields, same fields set, same JSON), and every other record gets the contract's own
verdict; `tests/unit/schemas/test_decode.py` holds both on valid and hostile records. The
events are built as pydantic builds them (`__dict__` in declaration order), at a fraction of
`model_validate_json`'s cost: the Python validators called from the schema cost more than the
rest of validation. A record is read first by a Struct that requires every field (what producers
write: `model_dump_json` writes them all), so the common event's fields set is every field
without a look for left-out ones; a record that fails it is read again by the Struct whose
optional fields may be left out.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from datetime import datetime
from itertools import chain
from typing import Annotated, Any, Final, Generic, Literal, TypeVar

import msgspec
import numpy as np

from schemas import codec
from schemas.errors import SchemaError
from schemas.events import (
    MAX_FEATURE,
    MAX_ID_BYTES,
    MAX_TS,
    MIN_TS,
    Message,
    TrainingExample,
    _fits_bytes,
    _in_range,
    _not_a_number,
    ids_fit,
)

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

# RFC 3339 text both parsers read as the same instant (no week dates, no space, no leap second,
# no 24:00, an offset below a day); anything else goes to the contract
TS_TEXT: Final = (
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?"
    r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])\Z"
)
_TS_TEXT: Final = re.compile(TS_TEXT)
_REMEMBERED: Final = 16_384  # matched texts kept per field (then forgotten, and checked again)
_MIN_S: Final = MIN_TS.timestamp()
_MAX_S: Final = MAX_TS.timestamp()
_new = object.__new__
_setattr = object.__setattr__
_fromiso = datetime.fromisoformat
_UNSET = msgspec.UNSET

# core-schema keys that change nothing a JSON record can carry past the Struct's own checks
_HARMLESS: Final = frozenset({"type", "metadata", "serialization", "ref", "strict"})
_BOUNDS: Final = ("ge", "le", "gt", "lt")
_FINITE_VECTOR = getattr(TrainingExample._finite_vector, "__func__", TrainingExample._finite_vector)


def _anchored(pattern: str) -> str:
    """`pattern` as Python's `re` must read it to match what the contract's (Rust) regex does:
    a final `$` there matches only at the very end, in Python also before a final newline."""
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        return pattern[:-1] + r"\Z"
    return pattern


def _meta(node: dict[str, Any], allowed: frozenset[str], **extra: Any) -> msgspec.Meta:
    unknown = set(node) - _HARMLESS - allowed
    if unknown:
        raise TypeError(f"a {node['type']} constraint the fast path does not know: {sorted(unknown)}")
    kw = {k: node[k] for k in allowed if k in node}
    if "pattern" in kw:
        kw["pattern"] = _anchored(kw["pattern"])
    return msgspec.Meta(**kw, **extra)


def _time(text: str) -> datetime | None:
    """The time of a timestamp's text if the contract takes it (TS_TEXT, a real date, within
    1970 … 2106), else None (the contract words why)."""
    if _TS_TEXT.search(text) is None:
        return None
    try:
        t = _fromiso(text)
    except ValueError:  # Feb 30 and such
        return None
    return t if _MIN_S <= t.timestamp() < _MAX_S else None


class _Rules:
    """The Python validators found while deriving a Struct: which fields each one guards."""

    def __init__(self, model: type[Message]) -> None:
        self.model = model
        self.ids: list[str] = []
        self.times: list[str] = []
        self.vectors: list[str] = []
        # a text field's pattern, checked after the Struct (`BatchDecoder._fields`) with the
        # values already matched remembered: msgspec runs `re` on every value (three an
        # impression, half of its decode), where a stream repeats few slots and timestamps
        self.patterns: list[tuple[str, re.Pattern[str]]] = []

    def annotation(self, node: dict[str, Any], name: str, field: bool = True) -> Any:
        """The msgspec type of a core-schema node; TypeError for anything not known here.
        `field`: the node is the field's own value (not a list's item), whose pattern the
        decoder checks itself (`patterns`)."""
        kind = node.get("type")
        if kind == "str":
            if field and "pattern" in node:
                self.patterns.append((name, re.compile(_anchored(node["pattern"]))))
                node = {k: v for k, v in node.items() if k != "pattern"}
            return Annotated[str, _meta(node, frozenset({"min_length", "max_length", "pattern"}))]
        if kind == "int":
            return Annotated[int, _meta(node, frozenset({*_BOUNDS, "multiple_of"}))]
        if kind == "float":  # msgspec reads no inf or nan from JSON (1e400 is refused): `allow_inf_nan`
            plain = {k: v for k, v in node.items() if k != "allow_inf_nan"}
            return Annotated[float, _meta(plain, frozenset(_BOUNDS))]
        if kind == "bool":
            return Annotated[bool, _meta(node, frozenset())]
        if kind == "literal":
            expected = node["expected"]
            if not expected or not all(isinstance(v, str) for v in expected):
                raise TypeError(f"{name}: a literal of other than text")
            return Literal[tuple(expected)]
        if kind == "nullable":
            return self.annotation(node["schema"], name, field) | None
        if kind == "list":
            items = node.get("items_schema", {"type": "any"})
            item = self.annotation(items, name, field=False)
            limits = {k: v for k, v in node.items() if k != "items_schema"}
            return Annotated[list[item], _meta(limits, frozenset({"min_length", "max_length"}))]  # type: ignore[valid-type]
        if kind in ("function-after", "function-before"):
            return self._validated(node, name)
        raise TypeError(f"{name}: a {kind!r} field the fast path does not know")

    def _validated(self, node: dict[str, Any], name: str) -> Any:
        fn = node.get("function", {}).get("function")
        fn = getattr(fn, "__func__", fn)
        inner = node["schema"]
        if fn is _fits_bytes and node["type"] == "function-after":
            # no id longer than this in characters: an all-ASCII record's ids fit (`_fields`)
            if (
                inner.get("type") != "str"
                or not 0 < inner.get("max_length", MAX_ID_BYTES + 1) <= MAX_ID_BYTES
            ):
                raise TypeError(f"{name}: an id without a length limit within {MAX_ID_BYTES}")
            self.ids.append(name)
            return self.annotation(inner, name)
        if fn is _in_range and node["type"] == "function-after":
            if (
                inner.get("type") != "function-before"
                or inner["function"].get("function") is not _not_a_number
            ):
                raise TypeError(f"{name}: a time range without the contract's timestamp text rule")
            dt = inner["schema"]
            if dt.get("type") != "datetime" or dt.get("tz_constraint") != "aware" or set(dt) - _HARMLESS - {
                "tz_constraint", "microseconds_precision"
            }:  # fmt: skip
                raise TypeError(f"{name}: a timestamp other than the contract's aware datetime")
            self.times.append(name)  # TS_TEXT, checked by the decoder with the parsed times kept
            return str
        if fn is _FINITE_VECTOR and node["type"] == "function-after":
            if inner.get("type") != "list" or inner.get("items_schema") != {"type": "float"}:
                raise TypeError(f"{name}: a vector rule on other than a list of floats")
            self.vectors.append(name)
            return self.annotation(inner, name)
        raise TypeError(f"{self.model.__name__}.{name}: a validator the fast path does not know: {fn}")


def derive_struct(
    model: type[Message], *, every: bool = False
) -> tuple[type[msgspec.Struct], _Rules, dict[str, Any]]:
    """The model's fields as a msgspec Struct (optional fields default to UNSET, so that the
    fields a record sets are known; with `every`, every field is required), the Python
    validators' rules, and the defaults."""
    schema = model.__pydantic_core_schema__
    if schema.get("type") != "model" or schema["schema"].get("type") != "model-fields":
        raise TypeError(f"{model.__name__}: not a plain model schema (a model validator?)")
    config = schema.get("config") or {}
    if not config.get("strict") or config.get("extra_fields_behavior") != "forbid":
        raise TypeError(f"{model.__name__}: not strict with unknown fields refused")
    if schema["schema"].get("computed_fields") or schema.get("custom_init"):
        raise TypeError(f"{model.__name__}: computed fields or a custom __init__")
    rules = _Rules(model)
    fields: list[tuple[str, Any, Any]] = []
    defaults: dict[str, Any] = {}
    for name, field in schema["schema"]["fields"].items():
        if set(field) - {"type", "schema", "metadata", "serialization_exclude", "frozen"}:
            raise TypeError(f"{model.__name__}.{name}: an alias or other field option")
        node = field["schema"]
        if node.get("type") == "default":
            if "default" not in node or set(node) - _HARMLESS - {"schema", "default"}:
                raise TypeError(f"{model.__name__}.{name}: a default the fast path does not know")
            if not isinstance(node["default"], str | int | float | bool | type(None)):
                raise TypeError(f"{model.__name__}.{name}: a default that is not a constant")
            defaults[name] = node["default"]
            kind = rules.annotation(node["schema"], name)
            fields.append(
                (name, kind, msgspec.NODEFAULT) if every else (name, kind | msgspec.UnsetType, _UNSET)
            )
        else:
            fields.append((name, rules.annotation(node, name), msgspec.NODEFAULT))
    struct = msgspec.defstruct(
        f"{model.__name__}{'Every' if every else ''}Struct",
        fields,
        kw_only=True,
        forbid_unknown_fields=True,
        frozen=True,
    )
    if struct.__struct_fields__ != tuple(model.model_fields):
        raise TypeError(f"{model.__name__}: the Struct's fields are not in the model's order")
    return struct, rules, defaults


class BatchDecoder(Generic[M]):
    """A contract model's validation for a batch of records (see the module docstring):
    `fast` gives each record's event where the fast path accepts it, `decode` every record's
    verdict (the event, or the contract's SchemaError)."""

    def __init__(self, model: type[M]) -> None:
        self.model = model
        self.fields: tuple[str, ...] = tuple(model.model_fields)
        self.ids: list[str] = []
        self.times: list[str] = []
        self.vectors: list[str] = []
        self._decode: Callable[[bytes], Any] | None = None
        try:
            struct, rules, self.defaults = derive_struct(model)
        except TypeError as exc:  # the contract grew a rule this path does not know: every record
            log.warning("fast %s decoding off, the contract decides each record: %s", model.__name__, exc)
            return
        self.ids, self.times, self.vectors = rules.ids, rules.times, rules.vectors
        self.patterns = [(name, pattern, set[str]()) for name, pattern in rules.patterns]
        self._parsed: dict[str, datetime] = {}  # timestamp text → its time, checked (`_fields`)
        self.struct = struct
        self._decode = msgspec.json.Decoder(struct).decode
        # every field written, none left to its default: the common record, read first
        self._decode_every = msgspec.json.Decoder(derive_struct(model, every=True)[0]).decode
        self._optional = tuple(self.defaults)
        self._required = frozenset(self.fields) - frozenset(self._optional)
        self._every = set(self.fields)

    @property
    def enabled(self) -> bool:
        """Whether the fast path is on for this model (a Struct could be derived)."""
        return self._decode is not None

    def _fields(self, value: bytes | None) -> tuple[dict[str, Any], bool] | None:
        """The record's fields (times parsed) if it passes the Struct and the per-record rules,
        and whether it writes every field."""
        if value is None or b"\\" in value:
            return None
        every = True
        try:
            rec = self._decode_every(value)
        except (msgspec.DecodeError, msgspec.ValidationError):
            if not self._optional:  # the same Struct: it would fail again
                return None
            every = False
            try:
                rec = self._decode(value)  # type: ignore[misc]
            except (msgspec.DecodeError, msgspec.ValidationError):
                return None
        fields: dict[str, Any] = msgspec.structs.asdict(rec)
        if not self._matched(fields):
            return None
        parsed = self._parsed
        for name in self.times:  # `_not_a_number` (TS_TEXT) and `_in_range`, once a text
            text = fields[name]
            t = parsed.get(text)
            if t is None:
                t = _time(text)
                if t is None:
                    return None
                if len(parsed) >= _REMEMBERED:
                    parsed.clear()
                parsed[text] = t
            fields[name] = t
        if not value.isascii() or b"\x7f" in value:  # other than printable ASCII text: `_fits_bytes`
            ids = [v for n in self.ids if isinstance(v := fields[n], str)]
            if not ids_fit(ids):
                return None
        return fields, every

    def _matched(self, fields: dict[str, Any]) -> bool:
        """Whether the text fields match the contract's patterns (`_Rules.patterns`)."""
        for name, pattern, matched in self.patterns:
            v = fields[name]
            if v.__class__ is str and v not in matched:
                if pattern.search(v) is None:
                    return False
                if len(matched) >= _REMEMBERED:
                    matched.clear()
                matched.add(v)
        return True

    def _event(self, fields: dict[str, Any], every: bool) -> M:
        if not every and _UNSET in fields.values():  # an optional field left out: its default
            fields_set = set(self._required)
            for name in self._optional:
                if fields[name] is _UNSET:
                    fields[name] = self.defaults[name]
                else:
                    fields_set.add(name)
        else:  # the common case: a producer wrote every field
            fields_set = self._every.copy()
        event: M = _new(self.model)  # as the model's own validator makes it
        _setattr(event, "__dict__", fields)
        _setattr(event, "__pydantic_fields_set__", fields_set)
        _setattr(event, "__pydantic_extra__", None)
        _setattr(event, "__pydantic_private__", None)
        return event

    def fast(self, values: Sequence[bytes | None]) -> list[M | None]:
        """Per record, its event where the fast path accepts it; None: ask the contract."""
        if self._decode is None:
            return [None] * len(values)
        found = [self._fields(v) for v in values]
        if self.vectors:
            self._check_vectors(found)
        return [None if f is None else self._event(*f) for f in found]

    def _check_vectors(self, found: list[tuple[dict[str, Any], bool] | None]) -> None:
        """`_finite_vector` for the batch: the records holding a component that is not finite or
        beyond ±MAX_FEATURE are handed to the contract (set to None in `found`)."""
        for name in self.vectors:
            rows = [i for i, f in enumerate(found) if f is not None]
            vectors = [found[i][0][name] for i in rows]  # type: ignore[index]
            total = sum(map(len, vectors))
            if not total:
                continue
            flat = np.fromiter(chain.from_iterable(vectors), dtype=np.float64, count=total)
            bad = ~(np.abs(flat) <= MAX_FEATURE)  # NaN compares False: refused as well
            if bad.any():
                ends = np.cumsum([len(v) for v in vectors])
                for k in set(np.searchsorted(ends, np.flatnonzero(bad), side="right").tolist()):
                    found[rows[k]] = None

    def decode(self, values: Sequence[bytes | None]) -> list[M | SchemaError]:
        """Per record, its event, or the SchemaError the contract (`codec.decode`) raises for it
        (a tombstone, None, is refused there with pydantic's own message)."""
        out: list[M | SchemaError] = []
        for value, event in zip(values, self.fast(values), strict=True):
            out.append(event if event is not None else contract(self.model, value))
        return out


def contract(model: type[M], value: bytes | None) -> M | SchemaError:
    """The contract's verdict on one record: its event, or the SchemaError naming the reason."""
    try:
        event = codec.decode(model, value)  # type: ignore[arg-type]
    except SchemaError as exc:
        return exc
    assert isinstance(event, model)
    return event


def is_fast(model: type[Message]) -> bool:
    """Whether `BatchDecoder(model)` has its fast path (a test holds it for every model it serves)."""
    try:
        derive_struct(model)
    except TypeError:
        return False
    return True


__all__ = ["TS_TEXT", "BatchDecoder", "contract", "derive_struct", "is_fast"]
