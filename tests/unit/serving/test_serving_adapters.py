"""The adapter bank: same scores as the trainers' PEFT bank for mixed batches; guarded swaps."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch

from schemas.errors import AdapterError
from schemas.settings import LoraSettings, Settings
from serving.adapters import CANDIDATE, STABLE
from serving.ranking import RankInput, RankModel
from trainers.models.features import featurize
from trainers.models.lora import AdapterBank as PeftBank
from trainers.models.ranker import Ranker, RankerConfig

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
    peft = PeftBank(base, LoraSettings(rank=4, alpha=8.0), "v0")
    settings = Settings(lora={"rank": 4, "alpha": 8.0}, serving={"adapter_capacity": 16})
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


def test_rollback_restores_what_was_written_though_the_caller_changed_its_tensors(
    models: tuple[RankModel, PeftBank, Ranker],
) -> None:
    """The bank keeps the weights it wrote for a rollback (not re-read from its buffers on each
    put): they must be its own, so a caller that reuses or changes its tensors after `put`
    does not change what a rollback puts back."""
    bank = models[0].bank
    shapes = bank.shapes
    w1 = {m: (torch.full((4, s.fan_in), 0.02), torch.full((s.fan_out, 4), 0.02)) for m, s in shapes.items()}
    w2 = {m: (torch.full((4, s.fan_in), 0.03), torch.full((s.fan_out, 4), 0.03)) for m, s in shapes.items()}
    bank.put("adv:own", w1, version="seq-0", seq=0, base_version="v0")
    for a, b in w1.values():  # the caller reuses its buffers
        a.fill_(9.0)
        b.fill_(9.0)
    bank.put("adv:own", w2, version="seq-1", seq=1, base_version="v0")
    meta = bank.rollback("adv:own")
    m = next(iter(shapes))
    assert meta.version == "seq-0"
    assert torch.all(bank.weights("adv:own")[m][0] == 0.02) and torch.all(
        bank.weights("adv:own")[m][1] == 0.02
    )
    w3 = {m: (torch.full((4, s.fan_in), 0.01), torch.full((s.fan_out, 4), 0.01)) for m, s in shapes.items()}
    bank.put("adv:own", w3, version="seq-2", seq=2, base_version="v0")
    for a, _ in w3.values():
        a.fill_(7.0)
    bank.put("adv:own", w1 | w2, version="seq-3", seq=3, base_version="v0")
    assert bank.rollback("adv:own").version == "seq-2"
    assert torch.all(bank.weights("adv:own")[m][0] == 0.01)
    bank.evict("adv:own")


# -- the batch plan: merged groups + per-sample tail, against an independent reference ---------

N_ADAPTERS = 30


# the factor layers (cross, deep) follow the plan; head and the table are served from ΔW; plan
# thresholds small enough for tiny batches to hit every case
PLAN_SETTINGS = Settings(
    lora={"rank": 4, "alpha": 8.0, "targets": ("cross", "deep", "head", "wide.category")},
    serving={"adapter_capacity": N_ADAPTERS + 4, "merge_group_limit": 2, "merge_min": 3, "merge_max": 2},
)


@pytest.fixture(scope="module")
def planned() -> tuple[RankModel, Ranker, dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]]:
    """A rank model whose plan thresholds are small enough for tiny batches to hit every case:
    ≤ 2 distinct rows are all merged, else the 2 busiest rows with ≥ 3 samples."""
    torch.manual_seed(1)
    base = Ranker(CFG).eval()
    rank = RankModel(copy.deepcopy(base), "v0", PLAN_SETTINGS, torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    weights = {}
    for i in range(N_ADAPTERS):
        w = {
            m: (torch.randn(4, s.fan_in, generator=g) * 0.2, torch.randn(s.fan_out, 4, generator=g) * 0.2)
            for m, s in rank.bank.shapes.items()
        }
        rank.bank.put(f"adv:{i}", w, version="seq-0", seq=0, base_version="v0")
        weights[f"adv:{i}"] = w
    return rank, base, weights


def _reference(
    base: Ranker,
    scale: float,
    weights: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]],
    dense: torch.Tensor,
    ids: torch.Tensor,
    adapters: list[str | None],
) -> torch.Tensor:
    """pCTR of each sample from the base model with its own adapter merged in (W + scale·B·A),
    one sample at a time: what any batching of the bank must reproduce."""
    params = dict(base.named_parameters())
    out = []
    with torch.no_grad():
        for i, a in enumerate(adapters):
            p = dict(params)
            for m, (wa, wb) in (weights[a] if a is not None else {}).items():
                delta = wb @ wa  # [out, in]; an id table is stored [num_embeddings, dim]
                if isinstance(base.get_submodule(m), torch.nn.Embedding):
                    delta = delta.T
                p[f"{m}.weight"] = params[f"{m}.weight"] + scale * delta
            out.append(torch.sigmoid(torch.func.functional_call(base, p, (dense[i : i + 1], ids[i : i + 1]))))
    return torch.cat(out) if out else torch.zeros(0)


def _layout(name: str, n: int) -> list[str | None]:
    """Which adapter each of n samples uses (None: no adapter), in a deliberately unsorted order."""
    if name == "one":
        ids: list[str | None] = ["adv:3"] * n
    elif name == "none":
        ids = [None] * n
    elif name == "two":  # ≤ group_limit distinct rows: all merged
        ids = ["adv:1" if i % 3 else "adv:2" for i in range(n)]
    elif name == "all_different":  # every sample its own adapter: all per sample
        ids = [f"adv:{i % N_ADAPTERS}" for i in range(n)]
    else:  # "heavy_and_tail": adv:5 ×9 and adv:6 ×6 merged, adv:7 ×3 (≥ merge_min but not top-2) in the tail
        ids = ["adv:5"] * 9 + ["adv:6"] * 6 + ["adv:7"] * 3 + [None] * 2
        ids += [f"adv:{10 + i % 15}" for i in range(n - len(ids))]
    return [ids[(7 * i) % n] for i in range(n)] if n else []  # 7 is coprime to the sizes used


@pytest.mark.parametrize("layout", ["one", "none", "two", "all_different", "heavy_and_tail"])
@pytest.mark.parametrize("chunk", [4096, 5])
def test_planned_batches_match_the_per_sample_reference(
    planned: tuple[RankModel, Ranker, dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]],
    layout: str,
    chunk: int,
) -> None:
    rank, base, weights = planned
    n = 37
    adapters = _layout(layout, n)
    batch = featurize([Ex(i) for i in range(n)], CFG)
    rows = torch.tensor([rank.bank.row(a, CANDIDATE) for a in adapters])
    want = _reference(base, rank.bank.scale, weights, batch.dense, batch.ids, adapters)
    rank.chunk = chunk  # 5: chunk boundaries cut through merged groups and the tail
    try:
        # three requests of uneven size, scored in one call
        cuts = [0, 11, 12, n]
        inputs = [RankInput(batch.dense[a:b], batch.ids[a:b], rows[a:b]) for a, b in itertools.pairwise(cuts)]
        got = np.concatenate(rank.score(inputs, use_adapters=True))
    finally:
        rank.chunk = 4096
    assert torch.allclose(torch.from_numpy(got), want, atol=1e-5)


def test_plan_of_an_ordered_batch_is_slices_and_any_order_is_exact(
    planned: tuple[RankModel, Ranker, dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]],
) -> None:
    rank, base, weights = planned
    n = 40
    adapters = _layout("heavy_and_tail", n)
    batch = featurize([Ex(i) for i in range(n)], CFG)
    rows = torch.tensor([rank.bank.row(a, CANDIDATE) for a in adapters])
    want = _reference(base, rank.bank.scale, weights, batch.dense, batch.ids, adapters)
    busy = sorted([rank.bank.row("adv:5", CANDIDATE), rank.bank.row("adv:6", CANDIDATE)])
    assert rank.ctx.merge_rows(rows).tolist() == busy
    order = rank.ctx.order(rows)
    with torch.inference_mode():
        with rank.ctx.use(rank.bank, rows[order]):
            assert [r for r, _ in rank.ctx.groups] == busy
            assert all(isinstance(w, slice) for _, w in rank.ctx.groups)
            assert isinstance(rank.ctx.tail, slice) and rank.ctx.tail.stop == n
            got_ordered = torch.sigmoid(rank.model(batch.dense[order], batch.ids[order]))
        with rank.ctx.use(rank.bank, rows):  # unordered: gathers and scatters, same scores
            assert not isinstance(rank.ctx.tail, slice)
            got_unordered = torch.sigmoid(rank.model(batch.dense, batch.ids))
    assert torch.allclose(got_ordered, want[order], atol=1e-5)
    assert torch.allclose(got_unordered, want, atol=1e-5)


def test_empty_batch(
    planned: tuple[RankModel, Ranker, dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]],
) -> None:
    rank = planned[0]
    batch = featurize([Ex(i) for i in range(3)], CFG)
    empty = RankInput(batch.dense[:0], batch.ids[:0], torch.zeros(0, dtype=torch.int64))
    for use in (True, False):
        out = rank.score([empty], use_adapters=use)
        assert len(out) == 1 and out[0].shape == (0,)
        two = rank.score([empty, RankInput(batch.dense, batch.ids, torch.zeros(3, dtype=torch.int64))], use)
        assert [p.shape for p in two] == [(0,), (3,)]


@pytest.mark.parametrize("layout", ["one", "all_different", "heavy_and_tail"])
def test_a_swap_during_a_batch_does_not_touch_it(layout: str) -> None:
    torch.manual_seed(3)
    base = Ranker(CFG).eval()
    rank = RankModel(copy.deepcopy(base), "v0", PLAN_SETTINGS, torch.device("cpu"))
    shapes = rank.bank.shapes
    weights = {
        f"adv:{i}": {
            m: (torch.full((4, s.fan_in), 0.01 * (i % 5 + 1)), torch.full((s.fan_out, 4), 0.02))
            for m, s in shapes.items()
        }
        for i in range(N_ADAPTERS)
    }
    for a, w in weights.items():
        rank.bank.put(a, w, version="seq-0", seq=0, base_version="v0")
    n = 30
    adapters = _layout(layout, n)
    batch = featurize([Ex(i) for i in range(n)], CFG)
    rows = torch.tensor([rank.bank.row(a, CANDIDATE) for a in adapters])
    want = _reference(base, rank.bank.scale, weights, batch.dense, batch.ids, adapters)
    new = {m: (torch.full((4, s.fan_in), 0.05), torch.full((s.fan_out, 4), -0.05)) for m, s in shapes.items()}
    with torch.inference_mode():
        with rank.ctx.use(rank.bank, rows):
            for a in {a for a in adapters if a is not None}:  # one swap per adapter of the batch
                rank.bank.put(a, new, version="seq-1", seq=1, base_version="v0")
            during = torch.sigmoid(rank.model(batch.dense, batch.ids))
        after = rank.score([RankInput(batch.dense, batch.ids, rows)], use_adapters=True)[0]
    assert torch.allclose(during, want, atol=1e-5)
    updated = {a: new for a in weights}
    assert torch.allclose(
        torch.from_numpy(after),
        _reference(base, rank.bank.scale, updated, batch.dense, batch.ids, adapters),
        atol=1e-5,
    )


@pytest.mark.parametrize(
    "targets",
    [
        ("cross", "deep", "wide.category", "emb.category"),
        ("wide.category",),
        ("head", "wide.category"),
        ("cross", "head"),
    ],
    ids=["mixed", "table", "head-table", "cross-head"],
)
def test_embedding_targets_match_peft(targets: tuple[str, ...]) -> None:
    """LoRA on id tables (PEFT's embedding LoRA, e.g. a per-category bias shift) serves the same
    scores as the trainers' PEFT bank, alone or with Linear targets, for any mix of adapters."""
    torch.manual_seed(1)
    base = Ranker(CFG).eval()
    peft = PeftBank(base, LoraSettings(rank=4, alpha=8.0, targets=targets), "v0")
    settings = Settings(lora={"rank": 4, "alpha": 8.0, "targets": targets}, serving={"adapter_capacity": 16})
    rank = RankModel(copy.deepcopy(base), "v0", settings, torch.device("cpu"))
    if "wide.category" in targets:
        assert rank.bank.shapes["wide.category"].fan_in == CFG.category_buckets
    # the narrow layers (head: out 1; the small id tables) take the ΔW path, the others the factors
    assert rank.bank.dense == {t for t in rank.bank.shapes if t in ("head", "wide.category", "emb.category")}
    peft.ensure("x")
    ids = [f"adv:{i}" for i in range(5)]
    for n, a in enumerate(ids):
        state = _random_state(peft, 100 + n)
        peft.set_state(a, state)
        weights = {m: (state[f"{m}.lora_A"], state[f"{m}.lora_B"]) for m in peft.modules}
        rank.bank.put(a, weights, version=f"seq-{n}", seq=n, base_version="v0")
    batch = featurize([Ex(i) for i in range(30)], CFG)
    for per_sample in (
        [ids[i % 5] if i % 4 else None for i in range(30)],  # mixed, some without adapter
        [ids[3]] * 30,  # one adapter (merged path of the Linear layers)
    ):
        want = torch.sigmoid(peft.logits(batch, per_sample))
        rows = torch.tensor([rank.bank.row(a, CANDIDATE) for a in per_sample])
        got = rank.score([RankInput(batch.dense, batch.ids, rows)], use_adapters=True)[0]
        assert torch.allclose(torch.from_numpy(got), want, atol=1e-5)
    # the embedding adapter really moves scores (a zero lora_A would make this test vacuous)
    plain = torch.sigmoid(base(batch.dense, batch.ids))
    assert not torch.allclose(torch.from_numpy(got), plain, atol=1e-3)


def test_dense_layers_follow_every_swap_and_match_the_factors() -> None:
    """Narrow layers serve from ΔW = scale·B A kept in the bank: per sample it equals the factors'
    LoRA, for out = 1 and out > 1, and it follows puts, promote and rollback in both arms."""
    from torch import nn

    from serving.adapters import AdapterStack
    from serving.banked import install, target_layers

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 3), nn.Tanh(), nn.Linear(3, 1)).eval()
    plain = copy.deepcopy(model)
    bank = AdapterStack(target_layers(model, ["0", "2"]), rank=4, alpha=8.0, capacity=4, max_norm=1e3)
    assert bank.dense == {"0", "2"}
    ctx = install(model, bank)
    assert not ctx.needs_plan

    def rand(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        return {
            n: (torch.randn(4, s.fan_in, generator=g) * 0.3, torch.randn(s.fan_out, 4, generator=g) * 0.3)
            for n, s in bank.shapes.items()
        }

    def reference(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Per sample: the plain model with W + scale·B A of that sample's row (from the factors)."""
        out = []
        buf = bank.active
        for i in range(x.shape[0]):
            m = copy.deepcopy(plain)
            r = int(rows[i])
            for name in ("0", "2"):
                layer = m.get_submodule(name)
                delta = bank.scale * (buf.b[name][r].T @ buf.a[name][r].T)
                layer.weight.data += delta
            out.append(m(x[i : i + 1]))
        return torch.cat(out)

    x = torch.randn(12, 6)
    bank.put("a", rand(1), version="1", seq=1, base_version="v")
    bank.put("b", rand(2), version="2", seq=2, base_version="v", arms=(STABLE, CANDIDATE))
    bank.put("a", rand(3), version="3", seq=3, base_version="v")
    checks = []
    for step in ("put", "promote", "rollback"):
        if step == "promote":
            bank.promote()
        elif step == "rollback":
            bank.rollback("a")
        rows = torch.tensor(
            [bank.row(["a", "b", None][i % 3], [STABLE, CANDIDATE][i % 2]) for i in range(12)]
        )
        with torch.inference_mode(), ctx.use(bank, rows):
            got = model(x)
        want = reference(x, rows)
        assert torch.allclose(got, want, atol=1e-5), step
        checks.append(got)
    assert not torch.allclose(checks[0], plain(x), atol=1e-3)  # the adapters really move the outputs
    assert not torch.allclose(checks[1], checks[2], atol=1e-4)  # rollback changed "a"


def test_promote_copies_the_held_adapters_rows_not_whole_tables() -> None:
    """A promotion is a swap on the replica's loop: copying every row of every table made its
    pause grow with `adapter_capacity` (4 ms at 2,048 rows), though only the rows of adapters
    the bank holds can differ between the arms. A row the bank does not hold is left as it is."""
    torch.manual_seed(0)
    settings = Settings(lora={"rank": 4, "alpha": 8.0}, serving={"adapter_capacity": 8})
    bank = RankModel(Ranker(CFG).eval(), "v0", settings, torch.device("cpu")).bank
    shapes = bank.shapes
    w = {m: (torch.full((4, s.fan_in), 0.02), torch.full((s.fan_out, 4), 0.03)) for m, s in shapes.items()}
    bank.put("adv:held", w, version="seq-0", seq=0, base_version="v0")
    free = bank.meta["adv:held"].slot + 1  # the next slot, not yet given to an adapter
    m = next(iter(shapes))
    for buf in bank._buffers:  # a stray value in a row nobody holds (never read: no adapter maps to it)
        buf.a[m][bank.stride + free].fill_(7.0)
    bank.promote()
    assert torch.allclose(bank.weights("adv:held", STABLE)[m][0], w[m][0])
    assert torch.allclose(bank.weights("adv:held", STABLE)[m][1], w[m][1])
    assert torch.count_nonzero(bank.active.a[m][free]) == 0  # not copied: only held rows are
    bank.promote()  # the replay onto the other buffer too
    assert torch.count_nonzero(bank.active.a[m][free]) == 0
