"""The trainer's edge: raw `ad.training-examples` records → TrainingExamples, fast and exact.

`ExampleDecoder.decode(values)` validates a micro-batch of records against the contract's own
core schema with its Python validators taken out, then re-applies those validators' rules to
the whole batch at once; a record that fails anything (or looks unusual) is decided by the
contract's `schemas.codec.decode`, which dead-letters it with its reason. So the trainer takes
exactly what `TrainingExample.model_validate_json` takes, and the same objects, at a fraction
of the cost (Python validators called from the schema cost more than the rest of validation:
eight ids, two timestamps and the user vector per record). The pattern is the streams worker's
`streams.ingest.FastDecoder`, for the trainer's model; the rules re-applied:

- ids (`_fits_bytes`): printable text of at most 255 UTF-8 bytes (the length limits stay in the
  schema);
- timestamps (`_not_a_number`, `_in_range`): given as text that starts with a four-digit year
  and a dash (numeric text would be read as unix seconds by the datetime schema; the contract
  refuses it), found in the raw bytes, which is exact only without escapes or a second key of
  that name: a record with a backslash, or with `"ts"`/`"impression_ts"` not exactly once,
  goes to the contract's path; within 1970 … 2106 (`_in_range`);
- the user vector (`_finite_vector`): every component finite and within ±`MAX_FEATURE`,
  checked for the batch in one numpy pass.

`take_ready(held, decoded, features)` is the reordering step of the service (`DelayBuffer`):
what to learn now, and whether the batch's features still describe it.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np
from pydantic_core import SchemaValidator

from schemas import codec
from schemas.errors import SchemaError
from schemas.events import (
    MAX_FEATURE,
    MAX_TS,
    MIN_TS,
    TrainingExample,
    _fits_bytes,
    _in_range,
    _not_a_number,
    ids_fit,
)
from trainers.models.features import RankerBatch
from trainers.reorder import DelayBuffer, Position

log = logging.getLogger(__name__)
# local years whose instants lie inside MIN_TS … MAX_TS whatever the offset (±1 day)
_SAFE_YEARS = (MIN_TS.year + 1, MAX_TS.year - 2)
_YEAR_TEXT = r"^[0-9]{4}-"
_new = object.__new__
_setattr = object.__setattr__


class ExampleDecoder:
    """Contract validation of TrainingExample records without the per-field Python validators
    (see the module docstring); `decode` gives, per record, the example or a SchemaError."""

    def __init__(self, model: type[TrainingExample] = TrainingExample) -> None:
        self.model = model
        self.ids: list[str] = []
        self.times: list[str] = []
        self.vectors: list[str] = []
        self.validator: SchemaValidator | None = None
        try:
            fields = self._stripped()
        except TypeError as exc:  # the contract grew a rule this path does not know: every record
            log.warning("fast TrainingExample decoding off, the contract decides each record: %s", exc)
            return
        self._ids: Callable[[dict[str, Any]], tuple[str, ...]] = itemgetter(*self.ids)
        self._times: Callable[[dict[str, Any]], Any] = itemgetter(*self.times)
        self._nullable = any(fields[n]["schema"].get("type") == "default" for n in self.ids)

    def _stripped(self) -> dict[str, Any]:
        """The model's fields schema without its Python validators (set as `self.validator`)."""
        schema = copy.deepcopy(self.model.__pydantic_core_schema__)
        if schema.get("type") != "model" or schema["schema"].get("type") != "model-fields":
            raise TypeError(f"{self.model.__name__}: not a plain model schema")
        fields: dict[str, Any] = schema["schema"]["fields"]
        for name, field in fields.items():
            field["schema"] = self._strip(field["schema"], name)
        if self.vectors != ["user_vector"] or not self.times or len(self.ids) < 2:
            raise TypeError(f"{self.model.__name__}: not the TrainingExample the fast path knows")
        # the fields alone: a model schema of a built model class would reuse its own validator
        self.validator = SchemaValidator(schema["schema"], schema.get("config"))
        return fields

    def _strip(self, node: Any, name: str) -> Any:
        kind = node.get("type")
        if kind in ("function-after", "function-before"):
            fn = node.get("function", {}).get("function")
            if fn is _fits_bytes:
                self.ids.append(name)
            elif fn is _in_range:
                self.times.append(name)
            elif fn is _not_a_number:
                # text starting with a four-digit year and a dash (never a number, which the
                # datetime schema would read as unix seconds), then parsed as the contract parses
                # it (lax datetime from text, `_not_a_number`); strict JSON: only a string gets here
                inner = self._strip(node["schema"], name)
                return {
                    "type": "chain",
                    "steps": [{"type": "str", "pattern": _YEAR_TEXT}, {**inner, "strict": False}],
                }
            elif getattr(fn, "__func__", None) is getattr(self.model._finite_vector, "__func__", ()):
                self.vectors.append(name)
            else:
                raise TypeError(
                    f"{self.model.__name__}.{name}: a validator the fast path does not know: {fn}"
                )
            return self._strip(node["schema"], name)
        if isinstance(node.get("schema"), dict):
            node = {**node, "schema": self._strip(node["schema"], name)}
        return node

    def _fast(self, value: bytes | None) -> dict[str, Any] | None:
        """The record's fields when they pass the stripped schema and the per-record rules."""
        if self.validator is None or value is None:
            return None
        try:
            fields: dict[str, Any]
            fields, _, fields_set = self.validator.validate_json(value)
        except ValueError:  # ValidationError; invalid UTF-8
            return None
        times = self._times(fields)
        for t in times if len(self.times) > 1 else (times,):
            # `_in_range`; a year well inside needs no look at the offset
            if not _SAFE_YEARS[0] <= t.year <= _SAFE_YEARS[1] and not MIN_TS <= t < MAX_TS:
                return None
        ids: Sequence[str] = self._ids(fields)
        if self._nullable:
            ids = [v for v in ids if v is not None]
        if not ids_fit(ids):  # `_fits_bytes`
            return None
        fields["__fields_set__"] = fields_set
        return fields

    def decode(self, values: Sequence[bytes | None]) -> list[TrainingExample | SchemaError]:
        """Per record, its TrainingExample, or the SchemaError `codec.decode` raises for it."""
        found = [self._fast(v) for v in values]
        vectors = [f["user_vector"] for f in found if f is not None]
        bad_rows: set[int] = set()
        if vectors:
            flat = np.fromiter(chain.from_iterable(vectors), dtype=np.float64, count=sum(map(len, vectors)))
            bad = ~(np.abs(flat) <= MAX_FEATURE)  # NaN compares False: refused as well
            if bad.any():  # `_finite_vector`: the rows holding a bad component
                ends = np.cumsum([len(v) for v in vectors])
                bad_rows = set(np.searchsorted(ends, np.flatnonzero(bad), side="right").tolist())
        out: list[TrainingExample | SchemaError] = []
        k = -1
        for value, fields in zip(values, found, strict=True):
            if fields is not None:
                k += 1
                if k not in bad_rows:
                    out.append(self._event(fields))
                    continue
            out.append(_contract(value))
        return out

    def _event(self, fields: dict[str, Any]) -> TrainingExample:
        fields_set = fields.pop("__fields_set__")
        event: TrainingExample = _new(self.model)  # as the model's own validator makes it
        _setattr(event, "__dict__", fields)
        _setattr(event, "__pydantic_fields_set__", fields_set)
        _setattr(event, "__pydantic_extra__", None)
        _setattr(event, "__pydantic_private__", None)
        return event


def _contract(value: bytes | None) -> TrainingExample | SchemaError:
    try:
        # a tombstone (None) too: refused there with pydantic's message, as before
        msg = codec.decode(TrainingExample, value)  # type: ignore[arg-type]
    except SchemaError as exc:
        return exc
    assert isinstance(msg, TrainingExample)
    return msg


def take_ready(
    held: DelayBuffer | None,
    decoded: list[tuple[TrainingExample, Position]],
    features: RankerBatch | None,
) -> tuple[list[tuple[TrainingExample, Position]], RankerBatch | None]:
    """What to learn now, in order, and its features when `features` (of `decoded`) still fit.

    Without a hold everything goes at once. With one (`settings.online.hold_labels`), examples
    with final labels wait in `held` until their window closes, the others go at once, then come
    those the hold releases; the features are kept only when that is `decoded` itself (nothing
    held back, nothing released: the fake-negative modes), else the step featurizes.
    """
    if held is None:
        return decoded, features
    at_once = []
    for ex, (part, off) in decoded:
        if ex.label_kind == "final":
            held.push(ex, part, off)
        else:
            at_once.append((ex, (part, off)))
    ready = held.pop_ready()
    if len(at_once) != len(decoded) or ready:
        features = None
    return at_once + ready, features
