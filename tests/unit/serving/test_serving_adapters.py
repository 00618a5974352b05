"""The adapter bank: same scores as the trainers' PEFT bank for mixed batches; guarded swaps."""

from __future__ import annotations

import copy

import pytest
import torch

from schemas.errors import AdapterError
from schemas.settings import Settings
from serving.adapters import CANDIDATE, STABLE
from serving.ranking import RankInput, RankModel
from trainers.features import featurize
from trainers.lora import AdapterBank as PeftBank
from trainers.lora import LoraSpec
from trainers.ranker import Ranker, RankerConfig

CFG = RankerConfig(
    state_dim=8,
    emb_dim=4,
    ad_buckets=64,
    advertiser_buckets=16,
    campaign_buckets=32,
    category_buckets=8,
    deep_hidden=16,
)


class Ex:
    def __init__(self, i: int) -> None:
        g = torch.Generator().manual_seed(i)
        self.user_vector = torch.randn(8, generator=g).tolist()
        self.intent_score = float(i % 3)
        self.recall_score = 0.1 * i
        self.ad_id, self.advertiser_id, self.campaign_id = f"a{i}", f"v{i % 5}", f"c{i % 7}"
        self.category, self.slot, self.position, self.hour = f"k{i % 4}", "feed", 0, i % 24


@pytest.fixture(scope="module")
def models() -> tuple[RankModel, PeftBank, Ranker]:
    torch.manual_seed(0)
    base = Ranker(CFG).eval()
    peft = PeftBank(base, LoraSpec(rank=4, alpha=8.0), "v0")
    settings = Settings(lora_rank=4, lora_alpha=8.0, serve_adapter_capacity=16)
    return RankModel(copy.deepcopy(base), "v0", settings, torch.device("cpu")), peft, base


def _random_state(peft: PeftBank, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in peft.get_state("x").items()}


def test_mixed_batch_matches_peft(models: tuple[RankModel, PeftBank, Ranker]) -> None:
    rank, peft, base = models
    peft.ensure("x")
    ids = [f"adv:{i}" for i in range(6)]
    for n, a in enumerate(ids):
        state = _random_state(peft, n)
        peft.set_state(a, state)
        weights = {m: (state[f"{m}.lora_A"], state[f"{m}.lora_B"]) for m in peft.modules}
        rank.bank.put(a, weights, version=f"seq-{n}", seq=n, base_version="v0")
    exs = [Ex(i) for i in range(40)]
    batch = featurize(exs, CFG)
    per_sample = [ids[i % 6] if i % 7 else None for i in range(40)]
    want = torch.sigmoid(peft.logits(batch, per_sample))
    rows = torch.tensor([rank.bank.row(a, CANDIDATE) for a in per_sample])
    got = rank.score([RankInput(batch.dense, batch.ids, rows)], use_adapters=True)[0]
    assert torch.allclose(torch.from_numpy(got), want, atol=1e-5)
    # one adapter for the whole batch (merged-weight path) and the base model path
    one = torch.full((40,), rank.bank.row(ids[2], CANDIDATE))
    got_one = rank.score([RankInput(batch.dense, batch.ids, one)], use_adapters=True)[0]
    assert torch.allclose(
        torch.from_numpy(got_one), torch.sigmoid(peft.logits(batch, [ids[2]] * 40)), atol=1e-5
    )
    got_base = rank.score([RankInput(batch.dense, batch.ids, one)], use_adapters=False)[0]
    assert torch.allclose(torch.from_numpy(got_base), torch.sigmoid(base(batch.dense, batch.ids)), atol=1e-6)
    # a few adapters (grouped path) and the stable arm (still zero: equals the base)
    few = torch.tensor([rank.bank.row(ids[i % 3], CANDIDATE) for i in range(40)])
    got_few = rank.score([RankInput(batch.dense, batch.ids, few)], use_adapters=True)[0]
    assert torch.allclose(
        torch.from_numpy(got_few),
        torch.sigmoid(peft.logits(batch, [ids[i % 3] for i in range(40)])),
        atol=1e-5,
    )
    stable = torch.full((40,), rank.bank.row(ids[2], STABLE))
    got_stable = rank.score([RankInput(batch.dense, batch.ids, stable)], use_adapters=True)[0]
    assert torch.allclose(torch.from_numpy(got_stable), torch.from_numpy(got_base), atol=1e-6)


def test_bad_weights_are_rejected_and_the_old_version_stays(
    models: tuple[RankModel, PeftBank, Ranker],
) -> None:
    bank = models[0].bank
    good = {
        m: (torch.full((4, s.fan_in), 0.01), torch.full((s.fan_out, 4), 0.01)) for m, s in bank.shapes.items()
    }
    bank.put("slot:feed", good, version="seq-0", seq=0, base_version="v0")
    before = bank.weights("slot:feed")
    m0 = next(iter(bank.shapes))
    s0 = bank.shapes[m0]
    bad_cases = [
        {m0: (torch.full((4, s0.fan_in), float("nan")), torch.zeros(s0.fan_out, 4))},
        {m0: (torch.zeros(3, s0.fan_in), torch.zeros(s0.fan_out, 3))},
        {m0: (torch.full((4, s0.fan_in), 100.0), torch.full((s0.fan_out, 4), 100.0))},
        {"nope.0": (torch.zeros(4, 2), torch.zeros(2, 4))},
    ]
    for bad in bad_cases:
        with pytest.raises(AdapterError):
            bank.put("slot:feed", bad, version="seq-1", seq=1, base_version="v0")
    after = bank.weights("slot:feed")
    assert all(
        torch.equal(before[m][0], after[m][0]) and torch.equal(before[m][1], after[m][1]) for m in before
    )
    assert bank.meta["slot:feed"].rejected == len(bad_cases) and bank.meta["slot:feed"].version == "seq-0"


def test_swap_rollback_and_promote(models: tuple[RankModel, PeftBank, Ranker]) -> None:
    bank = models[0].bank
    shapes = bank.shapes
    w1 = {m: (torch.full((4, s.fan_in), 0.02), torch.full((s.fan_out, 4), 0.02)) for m, s in shapes.items()}
    w2 = {m: (torch.full((4, s.fan_in), 0.03), torch.full((s.fan_out, 4), 0.03)) for m, s in shapes.items()}
    bank.put("adv:z", w1, version="seq-0", seq=0, base_version="v0")
    active_before, swaps = bank.active, bank.swaps
    bank.put("adv:z", w2, version="seq-1", seq=1, base_version="v0")
    assert bank.active is not active_before and bank.swaps == swaps + 1  # a reference swap
    m = next(iter(shapes))
    assert torch.allclose(bank.weights("adv:z")[m][0], w2[m][0])
    assert torch.count_nonzero(bank.weights("adv:z", STABLE)[m][0]) == 0  # stable arm untouched
    bank.promote()
    assert torch.allclose(bank.weights("adv:z", STABLE)[m][0], w2[m][0])
    meta = bank.rollback("adv:z")
    assert meta.version == "seq-0" and torch.allclose(bank.weights("adv:z", STABLE)[m][0], w1[m][0])
    with pytest.raises(AdapterError, match="no previous"):
        bank.rollback("adv:z")
    with pytest.raises(AdapterError, match="unknown"):
        bank.rollback("adv:unknown")
