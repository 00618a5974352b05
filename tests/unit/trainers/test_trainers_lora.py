"""PEFT LoRA bank on the ranker: base frozen, mixed adapters per batch, state round trip."""

from __future__ import annotations

import pytest
import torch
from helpers_trainers import make_examples

from schemas.delta import AdapterState, apply_delta, empty_state, full_parts, make_delta
from schemas.errors import AdapterError, ConfigError
from schemas.ids import adapter_id_for
from schemas.settings import LoraSettings
from trainers.models.features import featurize
from trainers.models.lora import AdapterBank, target_modules
from trainers.models.ranker import Ranker, RankerConfig

CFG = RankerConfig(
    state_dim=8, ad_buckets=64, advertiser_buckets=16, campaign_buckets=16, category_buckets=8, deep_hidden=16
)


@pytest.fixture
def bank() -> AdapterBank:
    torch.manual_seed(0)
    return AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8), "ranker-v1")


def test_spec_validation_names_field_and_value() -> None:
    with pytest.raises(ConfigError, match=r"rank.*0"):
        LoraSettings(rank=0)
    with pytest.raises(ConfigError, match=r"alpha.*-1"):
        LoraSettings(alpha=-1)
    with pytest.raises(ConfigError, match="match no Linear"):
        target_modules(Ranker(CFG), ["nothing"])


def test_targets_and_adapter_ids() -> None:
    assert target_modules(Ranker(CFG), ("cross", "deep")) == ["cross.0", "cross.1", "deep.0", "deep.2"]
    assert adapter_id_for("feed", "v1", "slot") == "feed"
    assert len(adapter_id_for("feed", "x" * 100, "slot+advertiser")) == 64
    with pytest.raises(ConfigError, match=r"adapter_scheme.*bogus"):
        adapter_id_for("feed", "v1", "bogus")


def test_new_adapter_equals_base_and_base_is_frozen(bank: AdapterBank) -> None:
    batch = featurize(make_examples(32, dim=8), CFG)
    bank.ensure("adv:v.1")  # dots in ids are fine
    base = bank.base_logits(batch)
    assert torch.allclose(bank.logits(batch, ["adv:v.1"] * 32), base)
    out = bank.train_logits(batch, "adv:v.1")
    torch.nn.functional.binary_cross_entropy_with_logits(out, batch.label).backward()
    trainable = {n for n, p in bank.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.grad is None for n, p in bank.model.named_parameters() if "lora_" not in n)


def test_mixed_batch_matches_per_adapter_scoring(bank: AdapterBank) -> None:
    batch = featurize(make_examples(30, dim=8), CFG)
    for i, a in enumerate(["slot:feed", "slot:search"]):
        bank.ensure(a)
        state = bank.get_state(a)
        g = torch.Generator().manual_seed(i)
        bank.set_state(a, {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in state.items()})
    ids = ["slot:feed"] * 10 + ["slot:search"] * 10 + [None] * 10
    mixed = bank.logits(batch, ids)
    feed = bank.logits(batch, ["slot:feed"] * 30)
    search = bank.logits(batch, ["slot:search"] * 30)
    base = bank.base_logits(batch)
    assert torch.allclose(mixed[:10], feed[:10], atol=1e-6)
    assert torch.allclose(mixed[10:20], search[10:20], atol=1e-6)
    assert torch.allclose(mixed[20:], base[20:], atol=1e-6)
    assert not torch.allclose(feed, search)


def test_state_round_trip_through_delta_reproduces_scores(bank: AdapterBank) -> None:
    batch = featurize(make_examples(16, dim=8), CFG)
    bank.ensure("slot:feed")
    opt = torch.optim.SGD(bank.parameters_of("slot:feed"), lr=0.5)
    for _ in range(5):
        opt.zero_grad()
        out = bank.train_logits(batch, "slot:feed")
        torch.nn.functional.binary_cross_entropy_with_logits(out, batch.label).backward()
        opt.step()
    trained = bank.logits(batch, ["slot:feed"] * 16)
    assert not torch.allclose(trained, bank.base_logits(batch))
    state = AdapterState("slot:feed", "ranker-v1", 4, 0, bank.get_state("slot:feed"))
    snap = make_delta(state, full_parts(state.tensors, 4), seq=1, snapshot=True)
    replica = apply_delta(empty_state("slot:feed", "ranker-v1", bank.shapes, 4), snap, max_norm=1.0)
    torch.manual_seed(0)
    other = AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8), "ranker-v1")
    other.set_state("slot:feed", dict(replica.tensors))
    assert torch.allclose(other.logits(batch, ["slot:feed"] * 16), trained, atol=1e-6)


def test_reset_and_unknown(bank: AdapterBank) -> None:
    batch = featurize(make_examples(8, dim=8), CFG)
    bank.ensure("slot:feed")
    bank.set_state("slot:feed", {k: v + 0.5 for k, v in bank.get_state("slot:feed").items()})
    bank.reset("slot:feed")
    assert torch.allclose(bank.logits(batch, ["slot:feed"] * 8), bank.base_logits(batch))
    with pytest.raises(AdapterError, match="not in the bank"):
        bank.get_state("nope")
    with pytest.raises(AdapterError, match="shape"):
        bank.set_state("slot:feed", {k: v[:1] for k, v in bank.get_state("slot:feed").items()})
    # unknown ids score with the base model (a replica that has not heard of an adapter yet)
    assert torch.allclose(bank.logits(batch, ["unknown"] * 8), bank.base_logits(batch))


def test_deterministic_adapter_init() -> None:
    a = AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8), "v")
    b = AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8), "v")
    a.ensure("slot:feed")
    torch.randn(100)  # global RNG state must not matter
    b.ensure("slot:feed")
    sa, sb = a.get_state("slot:feed"), b.get_state("slot:feed")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


TABLES = ("cross", "emb.category", "wide.category")


def test_embedding_targets_follow_peft_layout_and_start_at_the_base() -> None:
    torch.manual_seed(0)
    bank = AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8, targets=TABLES), "ranker-v1")
    assert bank.embedding_modules == ["emb.category", "wide.category"]
    assert bank.shapes["emb.category"] == (8, CFG.emb_dim) and bank.shapes["wide.category"] == (8, 1)
    bank.ensure("feed")
    state = bank.get_state("feed")
    # A [r, num_embeddings] starts at zero, B [dim, r] random (PEFT's embedding init)
    assert state["wide.category.lora_A"].shape == (4, 8) and state["wide.category.lora_B"].shape == (1, 4)
    assert float(state["wide.category.lora_A"].abs().sum()) == 0
    assert float(state["wide.category.lora_B"].abs().sum()) > 0
    batch = featurize(make_examples(24, dim=8), CFG)
    assert torch.allclose(bank.logits(batch, ["feed"] * 24), bank.base_logits(batch))
    assert len(bank.parameters_of("feed")) == 2 * len(bank.modules)


def test_every_adapters_tables_start_at_the_same_learning_rate() -> None:
    """While A is zero, SGD moves a table row by embedding_lr · scaling² · B Bᵀ times its
    gradient: each embedding target's B has the Frobenius norm sqrt(out · r) in every adapter
    (PEFT's normal draw alone gave `feed` 2.6 × `search`'s rate on the default ranker), a
    random direction seeded by the adapter id, and the adapter still starts at the base."""
    from schemas.settings import Settings

    lora = Settings().lora
    bank = AdapterBank(Ranker(RankerConfig()), lora, "v")
    rates = {}
    for aid in ("feed", "search", "splash", "adv:v1", "feed/adv:v2"):
        bank.ensure(aid)
        for module, (a, b) in bank.lora_params(aid).items():
            if module in bank.embedding_modules:
                assert float(a.abs().sum()) == 0
                rates[aid, module] = float((b * b).sum()) / b.numel()
    assert rates and all(r == pytest.approx(1.0, rel=1e-5) for r in rates.values()), rates
    directions = {aid: bank.lora_params(aid)["wide.category"][1].detach() for aid in ("feed", "search")}
    assert not torch.allclose(directions["feed"], directions["search"])
    batch = featurize(make_examples(16, dim=RankerConfig().state_dim), RankerConfig())
    assert torch.allclose(bank.logits(batch, ["search"] * 16), bank.base_logits(batch))
    bank.reset("search")  # a reset starts at the same rate again
    b = bank.lora_params("search")["wide.category"][1]
    assert float((b * b).sum()) / b.numel() == pytest.approx(1.0, rel=1e-5)


def test_embedding_delta_moves_only_the_listed_ids_and_round_trips() -> None:
    torch.manual_seed(0)
    bank = AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8, targets=TABLES), "ranker-v1")
    bank.ensure("feed")
    bank.ensure("search")
    exs = make_examples(60, dim=8)
    batch = featurize(exs, CFG)
    base = bank.base_logits(batch)
    state = bank.get_state("feed")
    col = int(batch.ids[0, 3])  # the category bucket of the first example
    state["wide.category.lora_A"][:, col] = 0.25
    bank.set_state("feed", state)
    moved = bank.logits(batch, ["feed"] * 60) - base
    same = batch.ids[:, 3] == col
    a, b = state["wide.category.lora_A"], state["wide.category.lora_B"]
    expected = bank.spec.scaling * float(b @ a[:, col])
    assert torch.allclose(moved[same], torch.full((int(same.sum()),), expected), atol=1e-5)
    assert torch.allclose(moved[~same], torch.zeros(int((~same).sum())), atol=1e-6)
    # a mixed batch applies each row's own adapter; a replica rebuilt from a snapshot agrees
    mixed = bank.logits(batch, ["feed"] * 30 + ["search"] * 30)
    assert torch.allclose(mixed[:30], (base + moved)[:30], atol=1e-6)
    assert torch.allclose(mixed[30:], base[30:], atol=1e-6)
    snap = make_delta(
        AdapterState("feed", "ranker-v1", 4, 0, state), full_parts(state, 4), seq=1, snapshot=True
    )
    replica = apply_delta(empty_state("feed", "ranker-v1", bank.shapes, 4), snap, max_norm=1.0)
    torch.manual_seed(0)
    other = AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8, targets=TABLES), "ranker-v1")
    other.set_state("feed", dict(replica.tensors))
    assert torch.allclose(other.logits(batch, ["feed"] * 60), base + moved, atol=1e-6)


def trained_ranker() -> Ranker:
    """A ranker as training leaves it: a fresh one has all-zero wide biases, which hid a training
    forward that left the wide tables out of the logit."""
    ranker = Ranker(CFG)
    with torch.no_grad():
        for table in ranker.wide.values():
            table.weight.normal_(0.0, 0.5)
    return ranker


@pytest.mark.parametrize(
    ("targets", "one_forward"),
    [(("head", "wide.category", "wide.slot", "wide.position"), True), (("cross", "wide.category"), False)],
)
def test_train_logits_and_base_equal_the_separate_forwards(
    targets: tuple[str, ...], one_forward: bool
) -> None:
    """The base logit taken out of the adapted forward (additive targets) is the frozen base's,
    also once the adapter has moved away from the base; other targets run the base forward."""
    torch.manual_seed(1)
    bank = AdapterBank(trained_ranker(), LoraSettings(rank=4, alpha=8, targets=targets), "ranker-v1")
    assert bank.base_from_lora_forward is one_forward
    bank.ensure("feed")
    state = bank.get_state("feed")
    bank.set_state("feed", {k: torch.randn_like(v) * 0.5 for k, v in state.items()})  # far from the base
    batch = featurize(make_examples(64, dim=8), CFG)
    logits, base = bank.train_logits_and_base(batch, "feed")
    assert logits.requires_grad and not base.requires_grad
    assert torch.allclose(logits.detach(), bank.train_logits(batch, "feed").detach(), atol=1e-6)
    assert torch.allclose(base, bank.base_logits(batch), atol=1e-5)
    assert not torch.allclose(base, logits.detach(), atol=1e-3)  # the adapter does change the scores
    logits.sum().backward()  # gradients still reach the adapter's tensors
    assert all(p.grad is not None for p in bank.parameters_of("feed"))


@pytest.mark.parametrize(
    "targets",
    [("head", "wide.category", "wide.slot", "wide.position"), ("head",), ("wide.category", "wide.hour")],
)
def test_additive_training_forward_equals_pefts_forward_and_gradients(targets: tuple[str, ...]) -> None:
    """The training forward that adds the LoRA terms itself (every target additive in the logit)
    gives PEFT's adapted logits, and the same gradients on the adapter's tensors."""
    torch.manual_seed(3)
    bank = AdapterBank(trained_ranker(), LoraSettings(rank=4, alpha=6, targets=targets), "ranker-v1")
    assert bank.base_from_lora_forward
    bank.ensure("feed")
    state = bank.get_state("feed")
    bank.set_state("feed", {k: torch.randn_like(v) * 0.5 for k, v in state.items()})
    batch = featurize(make_examples(64, dim=8), CFG)
    weights = torch.rand(64)
    ours = bank.train_logits(batch, "feed")
    (ours * weights).sum().backward()
    ours_grads = [p.grad.clone() for p in bank.parameters_of("feed")]  # type: ignore[union-attr]
    for p in bank.parameters_of("feed"):
        p.grad = None
    pefts = bank.model(batch.dense, batch.ids)  # the adapter is the active one
    (pefts * weights).sum().backward()
    assert torch.allclose(ours.detach(), pefts.detach(), atol=1e-5)
    assert not torch.allclose(ours.detach(), bank.base_logits(batch), atol=1e-3)
    for mine, theirs in zip(ours_grads, [p.grad for p in bank.parameters_of("feed")], strict=True):
        assert theirs is not None and torch.allclose(mine, theirs, rtol=1e-4, atol=1e-6)


def test_init_from_inputs_starts_new_adapters_on_the_principal_directions() -> None:
    torch.manual_seed(2)
    bank = AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8), "ranker-v1")
    batch = featurize(make_examples(256, dim=8), CFG)
    rows = bank.init_from_inputs(batch)
    assert set(rows) == {m for m in bank.modules if m not in bank.embedding_modules} == {"head"}
    a = rows["head"]
    gram = a @ a.T * 3  # unit rows scaled by 1/√3, mutually orthogonal
    assert torch.allclose(gram, torch.eye(4), atol=1e-4)
    bank.ensure("adv:new")
    assert torch.equal(bank.lora_params("adv:new")["head"][0].detach(), a)
    # B = 0: the new adapter still scores exactly like the base
    assert torch.allclose(bank.logits(batch, ["adv:new"] * len(batch)), bank.base_logits(batch), atol=1e-6)
