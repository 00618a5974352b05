"""The worker's fast paths give exactly what the validating paths give.

`streams.join.unchecked_example`: the join builds TrainingExamples without validating them (every
field is valid by construction); each must equal its validated twin and survive the wire. (The
input records' fast decoder is the contract's, `schemas.decode`: tests/unit/schemas/test_decode.py.)
"""

from __future__ import annotations

import pytest

from schemas.codec import decode, encode, example_json
from schemas.events import AdCreative, Message, TrainingExample
from schemas.settings import Settings
from streams.in_memory import replay
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
        assert encode(twin) == encode(ex) == example_json(ex)  # as the worker encodes it


def test_an_unchecked_example_is_the_validated_one() -> None:
    ex = replay(market_events(300, seed=6), Settings()).examples[0]
    assert unchecked_example(dict(ex.__dict__)) == TrainingExample(**ex.__dict__)
