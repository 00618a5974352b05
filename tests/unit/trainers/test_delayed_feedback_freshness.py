"""Freshness bookkeeping: every delta says which input offsets its adapter has learned."""

from __future__ import annotations

import torch
from helpers_trainers import make_examples

from schemas import codec
from schemas.events import AdapterDelta
from schemas.settings import LoraSettings, OnlineSettings
from trainers.models.lora import AdapterBank
from trainers.models.ranker import Ranker, RankerConfig
from trainers.online import OnlineTrainer

CFG = RankerConfig(
    state_dim=8, ad_buckets=64, advertiser_buckets=16, campaign_buckets=16, category_buckets=8, deep_hidden=16
)


def _trainer() -> OnlineTrainer:
    torch.manual_seed(0)
    bank = AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8), "v1")
    return OnlineTrainer(bank, OnlineSettings(lr=0.05, min_step_examples=16, delta_percentile=50))


def test_deltas_and_snapshots_carry_the_offsets_they_contain() -> None:
    tr = _trainer()
    exs = make_examples(96, dim=8, adapters=("feed", "search"))
    offsets = [(i % 2, 100 + i) for i in range(len(exs))]  # two input partitions
    deltas = tr.learn(exs[:64], offsets[:64])
    assert deltas, "the step published nothing"
    for d in deltas:
        assert d.learned_offsets == tr.runs[d.adapter_id].offsets
    feed = next(d for d in deltas if d.adapter_id == "feed")
    mine = [off for (part, off), e in zip(offsets[:64], exs[:64], strict=True) if e.adapter_id == "feed"]
    assert feed.learned_offsets is not None and max(feed.learned_offsets.values()) == max(mine)
    # examples still waiting for a step are not claimed
    tr.learn(exs[64:70], offsets[64:70])
    snap = tr.snapshot("feed")
    assert snap.learned_offsets == feed.learned_offsets
    # it travels (JSON keys are strings on the wire, ints again once decoded)
    back = codec.decode(AdapterDelta, codec.encode(snap))
    assert isinstance(back, AdapterDelta) and back.learned_offsets == snap.learned_offsets


def test_replay_mode_claims_no_offsets() -> None:
    tr = _trainer()
    deltas = tr.learn(make_examples(64, dim=8), flush=True)
    assert deltas and all(d.learned_offsets is None for d in deltas)


def test_collect_returns_when_the_oldest_waiting_example_is_due() -> None:
    """A click collected at the start of a quiet window is learned when it is due, not at the
    end of the window plus the wait (the trainer hop was 1.0 s at P50 with micro_batch_s =
    trainer_max_wait_s = 0.5, then 0.53 s with the wait counted from the first record)."""
    from trainers.service import collect_deadline

    assert collect_deadline(100.0, 0.5, None) == 100.5  # nothing waits: the idle wake-up
    assert collect_deadline(100.0, 0.5, 100.03) == 100.03  # due before the window ends
    assert collect_deadline(100.0, 0.5, 102.0) == 100.5  # a long wait: the window ends first


def test_an_example_is_due_max_wait_after_it_was_produced() -> None:
    """The deadline counts the time an example already spent on the way (the broker's fetch
    wait), from its record's timestamp, but a skewed clock never moves it outside
    [arrival, arrival + max_wait_s]."""
    from trainers.service import due_at

    assert due_at(10.0, 1000.0, 999_990, 0.03) == 10.0 + 0.03 - (1000.0 - 999.99)
    assert due_at(10.0, 1000.0, 999_000, 0.03) == 10.0  # produced long ago: learned at once
    assert due_at(10.0, 1000.0, 1_000_900, 0.03) == 10.03  # a producer clock ahead: the whole wait
    assert due_at(10.0, 1000.0, None, 0.03) == due_at(10.0, 1000.0, -1, 0.03) == 10.03  # no timestamp


def test_a_step_below_min_step_examples_takes_its_share_of_the_rates() -> None:
    """A deadline cuts a quiet adapter's examples into small steps; each is taken at
    n / min_step_examples of the learning rates, so 8 examples move the adapter exactly as a
    trainer whose rates are 8/64 of them would (Adam and the id tables' SGD alike), and a full
    group steps at the full rates."""
    exs = [e for e in make_examples(200, dim=8, adapters=("feed",)) if e.label_kind != "dwell"]

    def weights(spec: OnlineSettings, batch: list) -> dict[str, torch.Tensor]:  # type: ignore[type-arg]
        torch.manual_seed(0)
        bank = AdapterBank(
            Ranker(CFG), LoraSettings(rank=4, alpha=8, targets=("head", "wide.category")), "v1"
        )
        tr = OnlineTrainer(bank, spec)
        tr.learn(batch, flush=True)
        return bank.get_state("feed")

    small = weights(OnlineSettings(lr=0.01, embedding_lr=0.2, min_step_examples=64), exs[:8])
    scaled = weights(
        OnlineSettings(lr=0.01 * (8 / 64), embedding_lr=0.2 * (8 / 64), min_step_examples=1), exs[:8]
    )
    unscaled = weights(OnlineSettings(lr=0.01, embedding_lr=0.2, min_step_examples=1), exs[:8])
    assert all(torch.equal(small[k], scaled[k]) for k in small)
    assert not all(torch.equal(small[k], unscaled[k]) for k in small)
    full = weights(OnlineSettings(lr=0.01, embedding_lr=0.2, min_step_examples=64), exs[:64])
    same = weights(OnlineSettings(lr=0.01, embedding_lr=0.2, min_step_examples=1), exs[:64])
    assert all(torch.equal(full[k], same[k]) for k in full)


def test_every_step_publishes_a_delta_so_learned_clicks_reach_replicas() -> None:
    """Sparsification publishes a step's strongest directions; a step where none passes the
    percentile threshold still publishes its single strongest one (stamped with the offsets it
    learned), so a click never waits for a later step to reach replicas (freshness)."""
    torch.manual_seed(0)
    bank = AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8), "v1")
    tr = OnlineTrainer(bank, OnlineSettings(lr=0.05, min_step_examples=1, delta_percentile=99.9))
    exs = make_examples(40 * 8, dim=8)
    for i in range(40):
        chunk = exs[i * 8 : (i + 1) * 8]
        deltas = tr.learn(chunk, [(0, i * 8 + j) for j in range(8)])
        assert len(deltas) == 1, f"step {i} published {len(deltas)} deltas"
        assert deltas[0].learned_offsets == {0: i * 8 + 7}
