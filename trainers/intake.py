"""The trainer's edge: raw `ad.training-examples` records → TrainingExamples, fast and exact.

`ExampleDecoder` is the contract's one fast decoder (`schemas.decode.BatchDecoder`) for
TrainingExample: a micro-batch is validated against a Struct derived from the model, the rules
of its Python validators (ids, both timestamps, the user vector's bound) re-applied to the whole
batch, and a record that fails anything is decided by the contract's `schemas.codec.decode`,
which gives the SchemaError the trainer dead-letters. So the trainer takes exactly what
`TrainingExample.model_validate_json` takes, and the same objects, at a fraction of the cost.

`take_ready(held, decoded, features)` is the reordering step of the service (`DelayBuffer`):
what to learn now, and whether the batch's features still describe it.
"""

from __future__ import annotations

from schemas.decode import BatchDecoder
from schemas.events import TrainingExample
from trainers.models.features import RankerBatch
from trainers.reorder import DelayBuffer, Position


class ExampleDecoder(BatchDecoder[TrainingExample]):
    """`BatchDecoder` of TrainingExample: `decode` gives, per record, the example or a SchemaError."""

    def __init__(self) -> None:
        super().__init__(TrainingExample)


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
