"""The label join carries the creative variant an impression showed, and the probability it was
chosen with, onto every example it makes of it: what teaches serving's variant bandit."""

from __future__ import annotations

import numpy as np
import pytest
from streams_helpers import click, creative, dwell, impression

from schemas.codec import decode, encode
from schemas.events import TrainingExample
from schemas.settings import Settings
from streams.in_memory import training_examples
from streams.join import Pending

S = Settings(streams={"attribution_window_s": 60.0, "watermark_window": 1})


def _events() -> list:
    shown = {"i1": ("zh-h0b1c0", 0.8), "i2": ("zh-h1b0c0", 0.05)}
    events = [creative()]
    for k, (eid, (vid, p)) in enumerate(shown.items()):
        events.append(impression(eid, k).model_copy(update={"variant_id": vid, "variant_propensity": p}))
    events.append(impression("i3", 2))  # an ad without variants
    events += [click("c1", 5, "i1"), dwell("d1", 6, "i1", 3000)]
    return events


@pytest.mark.parametrize("mode", ["hold", "fn_weighted"])
def test_every_example_of_an_impression_names_its_variant_and_propensity(mode: str) -> None:
    out = list(training_examples(_events(), S, label_mode=mode))  # type: ignore[arg-type]
    want = {"i1": ("zh-h0b1c0", 0.8), "i2": ("zh-h1b0c0", 0.05), "i3": (None, None)}
    assert {e.impression_id for e in out} == set(want)
    for e in out:
        assert (e.variant_id, e.variant_propensity) == want[e.impression_id], e.label_kind
        # the join builds examples unvalidated: validation gives the same example, and the wire too
        assert TrainingExample.model_validate(e.model_dump()) == e
        assert decode(TrainingExample, encode(e)) == e
    kinds = sorted(e.label_kind for e in out if e.impression_id == "i1")
    assert kinds == (["final"] if mode == "hold" else ["click", "dwell", "fake_negative"])


def test_a_pending_impression_keeps_its_variant_across_a_restart() -> None:
    imp = impression("i1", 0).model_copy(update={"variant_id": "v2", "variant_propensity": 0.25})
    p = Pending(imp, "shoes", np.ones(4, dtype=np.float32), 0.5, 60.0)
    back = Pending.from_bytes(p.to_bytes())
    assert back.same(p) and back.impression.variant_id == "v2"
    assert back.impression.variant_propensity == 0.25
