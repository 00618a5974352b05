"""Online trainer core: progressive validation, sparse deltas that chain, guards, restore."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers_trainers import make_examples

from schemas.delta import apply_delta, decode_delta, empty_state
from schemas.errors import ConfigError
from schemas.settings import LoraSettings, OnlineSettings
from trainers.models.features import featurize
from trainers.models.lora import AdapterBank
from trainers.models.ranker import Ranker, RankerConfig
from trainers.online import AdapterRun, OnlineTrainer, module_thresholds
from trainers.replay import impression_order, progressive_report, replay

CFG = RankerConfig(
    state_dim=8, ad_buckets=64, advertiser_buckets=16, campaign_buckets=16, category_buckets=8, deep_hidden=16
)


def _trainer(spec: OnlineSettings | None = None, seed: int = 0) -> OnlineTrainer:
    torch.manual_seed(seed)
    bank = AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8), "ranker-v1")
    return OnlineTrainer(bank, spec or OnlineSettings(lr=0.01, min_step_examples=16), keep_log=True)


def test_spec_validation_names_field_and_value() -> None:
    with pytest.raises(ConfigError, match=r"delta_percentile.*100"):
        OnlineSettings(delta_percentile=100)
    with pytest.raises(ConfigError, match=r"lr.*0"):
        OnlineSettings(lr=0)


def test_progressive_scores_precede_learning_and_deltas_chain() -> None:
    tr = _trainer()
    exs = make_examples(600, dim=8, adapters=("feed", "search"))
    before = [e.model_dump() for e in exs]
    replicas = {a: empty_state(a, "ranker-v1", tr.bank.shapes, 4) for a in ("feed", "search")}
    published: list = []
    n = replay(exs, tr, micro_batch=64, on_deltas=published.extend)
    assert n == 600 and [e.model_dump() for e in exs] == before  # input not mutated
    assert len(tr.log.labels) == 600
    # the first micro-batch was scored by an untouched adapter: equal to the base
    first = tr.log.online[:32]
    assert first == pytest.approx(tr.log.base[:32], abs=1e-6)
    # replicas applying every delta in order (all guards on) end at the trainer's published state
    assert published and all(
        d.seq == i
        for a in ("feed", "search")
        for i, d in enumerate(x for x in published if x.adapter_id == a)
    )
    for d in published:
        replicas[d.adapter_id] = apply_delta(replicas[d.adapter_id], d, max_norm=10)
    for a, rep in replicas.items():
        run = tr.runs[a]
        assert rep.seq == run.seq
        for k, v in run.published.tensors.items():
            assert torch.equal(rep.tensors[k], v)
    # sparse: a delta carries only some of the 4 modules x 4 directions
    sizes = [
        sum(p.dirs.numel() for p in decode_delta(d.payload).values()) for d in published if not d.snapshot
    ]
    assert sizes and sum(sizes) / len(sizes) < 16
    report = progressive_report(tr)
    assert report["overall"]["n"] == 600
    assert set(report["adapters"]) == {"feed", "search"}


def test_online_learning_improves_on_a_shifted_world() -> None:
    tr = _trainer(OnlineSettings(lr=0.02, min_step_examples=32, delta_percentile=50))
    # the base is untrained: online adapters must beat it on a learnable signal
    exs = make_examples(3000, dim=8, seed=2)
    replay(exs, tr, micro_batch=128)
    rep = progressive_report(tr)["overall"]
    assert rep["auc_online"] > rep["auc_base"] + 0.05


def test_snapshot_makes_published_equal_to_full_state_and_restore_keeps_seq() -> None:
    tr = _trainer()
    replay(make_examples(300, dim=8), tr, micro_batch=64)
    run = tr.runs["feed"]
    last = run.seq
    snap = tr.snapshot("feed")
    assert snap.snapshot and snap.seq == last + 1
    full = tr.bank.get_state("feed")
    assert all(torch.equal(full[k], run.published.tensors[k]) for k in full)
    # a restarted trainer resumes from the snapshot, after the highest reserved seq
    other = _trainer(seed=1)
    other.restore("feed", snap, last_seq=snap.seq + 3)
    assert other.runs["feed"].seq == snap.seq + 3
    batch_scores = other.bank.get_state("feed")
    assert all(torch.equal(batch_scores[k], full[k]) for k in full)
    nxt = other.snapshot("feed")
    assert nxt.seq == snap.seq + 4


def test_poisoned_examples_are_dropped_not_learned() -> None:
    tr = _trainer(OnlineSettings(lr=1e6, embedding_lr=1e6, delta_max_norm=0.5, min_step_examples=16))
    replay(make_examples(200, dim=8), tr, micro_batch=64)
    assert tr.counts["dropped_oversized"] > 0
    state = tr.bank.get_state("feed")
    assert all(torch.isfinite(v).all() for v in state.values())
    # dropped steps leave the adapter unchanged (its zero-initialised half stays zero, so scores
    # equal the base): B of a Linear target, A of an id table (PEFT initialises them that way)
    tables = set(tr.bank.embedding_modules)
    zero_half = [f"{m}.lora_A" if m in tables else f"{m}.lora_B" for m in tr.bank.modules]
    assert zero_half and all(float(state[k].abs().sum()) == 0 for k in zero_half)


def test_guard_resets_an_adapter_worse_than_base() -> None:
    # a trained base vs an adapter sabotaged by a huge learning rate on flipped labels
    tr = _trainer(
        OnlineSettings(
            lr=0.05,
            # the sabotage needs the id tables' step too (the default embedding_lr became 0.02,
            # at which the flipped labels no longer pull the adapter far enough below the base)
            embedding_lr=0.2,
            min_step_examples=16,
            reset_patience=2,
            reset_patience_examples=128,  # two micro-batches of 64 (the default waits a window)
            reset_margin=0.0,
            min_guard_examples=100,
            min_guard_positives=5,
            progressive_window=300,
        )
    )
    good = make_examples(400, dim=8, seed=3)
    bank = tr.bank
    bank.ensure("feed")
    flipped = [e.model_copy(update={"click": not e.click}) for e in good]
    replay(flipped * 2, tr, micro_batch=64)
    replay(good, tr, micro_batch=64)
    resets = tr.counts["resets"]
    assert resets >= 1
    assert any(d.snapshot for d in tr.take_pending()) or tr.runs["feed"].counts["snapshots"] >= 1


def test_deterministic_under_seed() -> None:
    a, b = _trainer(seed=5), _trainer(seed=5)
    exs = impression_order(make_examples(300, dim=8, seed=4))
    da, db = [], []
    replay(exs, a, 64, da.extend)
    replay(exs, b, 64, db.extend)
    assert [d.payload for d in da] == [d.payload for d in db]
    assert a.log.online == b.log.online
    assert not math.isnan(progressive_report(a)["overall"]["auc_online"] or math.nan)


def test_embedding_lr_validated_and_tables_get_sgd() -> None:
    with pytest.raises(ConfigError, match=r"embedding_lr.*0"):
        OnlineSettings(embedding_lr=0)
    torch.manual_seed(0)
    bank = AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8, targets=("cross", "wide.category")), "v")
    tr = OnlineTrainer(bank, OnlineSettings(lr=0.01, embedding_lr=0.3, min_step_examples=16))
    opts = tr.run_for("feed").optimizer.optimizers
    assert [type(o).__name__ for o in opts] == ["Adam", "SGD"]
    table = {id(p) for p in bank.lora_params("feed")["wide.category"]}
    assert {id(p) for g in opts[1].param_groups for p in g["params"]} == table
    assert opts[1].param_groups[0]["lr"] == 0.3


def test_online_table_adapter_learns_a_category_effect_and_deltas_chain() -> None:
    # the base is untrained (every category bias 0); the data's click rate depends on the
    # category, so an adapter on the category bias table alone must beat the base
    torch.manual_seed(0)
    bank = AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8, targets=("wide.category",)), "ranker-v1")
    spec = OnlineSettings(embedding_lr=0.3, min_step_examples=16, delta_percentile=50)
    tr = OnlineTrainer(bank, spec, keep_log=True)
    exs = make_examples(2000, dim=8, seed=6)
    published: list = []
    replay(exs, tr, micro_batch=128, on_deltas=published.extend)
    rep = progressive_report(tr)["overall"]
    assert rep["auc_online"] > rep["auc_base"] + 0.03
    replica = empty_state("feed", "ranker-v1", bank.shapes, 4)
    for d in published:
        replica = apply_delta(replica, d, max_norm=10)
    assert replica.seq == tr.runs["feed"].seq >= 1
    for k, v in tr.runs["feed"].published.tensors.items():
        assert torch.equal(replica.tensors[k], v)


def test_each_module_publishes_against_its_own_percentile() -> None:
    # magnitudes of two modules on very different scales: a pooled percentile would publish
    # only the large one; per module, each publishes its own top directions
    step = np.array([[1.0, 2.0, 3.0, 4.0], [100.0, 200.0, 300.0, 400.0]])
    window = [step * (1 + i / 10) for i in range(10)]
    thr = module_thresholds(window, 90)
    assert thr[0] == pytest.approx(np.percentile([w[0] for w in window], 90))
    assert thr[1] == pytest.approx(100 * thr[0])
    torch.manual_seed(0)
    targets = ("cross", "deep", "emb.category")  # pooled, deep.* published nothing here
    bank = AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8, targets=targets), "v")
    tr = OnlineTrainer(bank, OnlineSettings(lr=0.01, min_step_examples=16, delta_percentile=80))
    published: list = []
    replay(make_examples(3000, dim=8, seed=7), tr, micro_batch=64, on_deltas=published.extend)
    dirs: dict[str, int] = {}
    for d in published:
        for m, part in decode_delta(d.payload).items():
            dirs[m] = dirs.get(m, 0) + part.dirs.numel()
    total = sum(dirs.values())
    assert set(dirs) == set(bank.modules)
    assert all(n >= total / 20 for n in dirs.values()), dirs


def test_replay_shows_each_micro_batch_before_it_is_learned() -> None:
    tr = _trainer()
    exs = make_examples(300, dim=8, adapters=("feed", "search"))
    seen: list[str] = []

    def before(chunk: list) -> None:
        # nothing of this chunk has been scored (nor learned) yet
        assert len(tr.log.labels) + tr.waiting() <= len(seen)
        seen.extend(e.impression_id for e in chunk)

    replay(exs, tr, micro_batch=64, before_learn=before)
    assert seen == [e.impression_id for e in exs]
    assert len(tr.log.labels) == 300


def test_a_steady_direction_is_published_once_its_summed_gradient_is_large() -> None:
    """Error feedback: a direction whose gradient is steady but never the largest of a step is
    still published (its magnitude is summed until it is), then its sum starts again."""
    tr = _trainer(OnlineSettings(lr=0.01, min_step_examples=16, delta_percentile=95))
    run = tr.run_for("feed")
    state = tr._state(run)
    n_modules, rank = len(tr.bank.modules), 4
    published_steady = []
    for step in range(40):
        mags = np.full((n_modules, rank), 0.1)
        mags[:, step % 3] = 5.0  # one spike per step among directions 0-2
        mags[:, 3] = 0.5  # direction 3: steady, a tenth of a spike
        delta = tr._sparse_delta(run, state, mags)
        assert delta is not None  # a spike passes every step
        dirs = decode_delta(delta.payload)
        if all(3 in part.dirs.tolist() for part in dirs.values()):
            published_steady.append(step)
            assert run.unpublished is not None and np.all(run.unpublished[:, 3] == 0)
    # a single step's 0.5 never reaches the window's 95th percentile (a spike, 5.0): without the
    # sum it would never be published; summed, it is, every ~10 steps
    assert len(published_steady) >= 3, published_steady
    assert published_steady[0] >= 5


def test_learning_from_the_callers_features_equals_featurizing_in_the_step() -> None:
    """`learn(features=featurize(examples))` (the service validates a batch by featurizing it)
    steps exactly as featurizing inside the step would, across buffered calls, several adapters
    and dwell label updates (which the step leaves out of the click loss)."""
    from trainers.models.features import featurize

    exs = make_examples(300, seed=5, adapters=("feed", "search"))
    exs = [e.model_copy(update={"label_kind": "dwell"}) if i % 7 == 3 else e for i, e in enumerate(exs)]
    spec = OnlineSettings(lr=0.05, min_step_examples=40, delta_percentile=50)
    a, b = _trainer(spec), _trainer(spec)
    out_a, out_b = [], []
    for i in range(0, len(exs), 50):  # groups of 25 per adapter: every other call waits
        chunk = exs[i : i + 50]
        out_a += a.learn(chunk)
        out_b += b.learn(chunk, features=featurize(chunk, CFG))
    out_a += a.flush()
    out_b += b.flush()
    assert [d.payload for d in out_a] == [d.payload for d in out_b] and out_a
    assert a.log is not None and b.log is not None and a.log.online == b.log.online
    assert a.counts == b.counts and a.counts["dwell_updates"] > 0
    with pytest.raises(ValueError, match="features has 3 rows for 50 examples"):
        a.learn(exs[:50], features=featurize(exs[:3], CFG))


def _guard_window(tr: OnlineTrainer, online: np.ndarray, base: np.ndarray, y: np.ndarray) -> AdapterRun:
    tr.bank.ensure("feed")
    run = tr.run_for("feed")
    run.online.extend(online, y)
    run.base.extend(base, y)
    return run


def test_the_guard_does_not_reset_on_a_difference_inside_its_noise() -> None:
    """~500 examples with ~30 clicks: an online AUC 0.02 below the base's is noise (the old guard,
    a plain `online < base - 0.01`, reset on it every time it held for `reset_patience` batches)."""
    rng = np.random.default_rng(0)
    y = (rng.random(500) < 0.06).astype(int)
    base = y * 0.8 + rng.normal(size=500)
    online = y * 0.8 + rng.normal(size=500)
    tr = _trainer(OnlineSettings(reset_patience=2, min_guard_examples=100, min_guard_positives=5))
    run = _guard_window(tr, 1 / (1 + np.exp(-online)), 1 / (1 + np.exp(-base)), y)
    assert run.online.auc() < run.base.auc() - 0.01  # the old rule's loss
    for _ in range(5):
        tr._guard(run, 1000)
    assert tr.counts["resets"] == 0
    assert run.paired is not None and run.paired[0] + 1.96 * run.paired[1] > -0.01


def test_the_guard_resets_on_a_significant_loss() -> None:
    rng = np.random.default_rng(1)
    y = (rng.random(2000) < 0.1).astype(int)
    base = y * 2.0 + rng.normal(size=2000)
    online = y * 0.3 + rng.normal(size=2000)  # much worse on the same examples
    tr = _trainer(OnlineSettings(reset_patience=2, min_guard_examples=100, min_guard_positives=5))
    run = _guard_window(tr, 1 / (1 + np.exp(-online)), 1 / (1 + np.exp(-base)), y)
    tr._guard(run, 1000)
    assert tr.counts["resets"] == 0  # patience: one bad batch is not enough
    tr._guard(run, 1000)
    assert tr.counts["resets"] == 1


def test_the_guard_waits_for_a_window_of_new_examples_not_a_count_of_small_steps() -> None:
    """Steps of a few examples (the trainer's deadline) are not independent looks: the loss must
    hold while `reset_patience_examples` new examples arrive, however many steps carry them."""
    rng = np.random.default_rng(1)
    y = (rng.random(2000) < 0.1).astype(int)
    base = y * 2.0 + rng.normal(size=2000)
    online = y * 0.3 + rng.normal(size=2000)  # significantly worse on the same examples
    spec = OnlineSettings(reset_patience=20, min_guard_examples=100, min_guard_positives=5)
    assert spec.reset_patience_examples == spec.progressive_window  # the default: one window
    tr = _trainer(spec)
    run = _guard_window(tr, 1 / (1 + np.exp(-online)), 1 / (1 + np.exp(-base)), y)
    for _ in range(499):  # 499 steps of 4 examples: 1,996 examples, 20 steps many times over
        tr._guard(run, 4)
    assert tr.counts["resets"] == 0 and run.below == 499 and run.below_examples == 1996
    tr._guard(run, 4)
    assert tr.counts["resets"] == 1 and run.below == run.below_examples == 0


def test_the_guard_starts_counting_again_when_the_loss_stops_being_significant() -> None:
    rng = np.random.default_rng(1)
    y = (rng.random(2000) < 0.1).astype(int)
    base = y * 2.0 + rng.normal(size=2000)
    tr = _trainer(OnlineSettings(reset_patience=1, min_guard_examples=100, min_guard_positives=5))
    run = _guard_window(tr, 1 / (1 + np.exp(-(y * 0.3 + rng.normal(size=2000)))), 1 / (1 + np.exp(-base)), y)
    tr._guard(run, 1500)
    assert run.below_examples == 1500
    run.online.extend(1 / (1 + np.exp(-base)), y)  # as good as the base again
    tr._guard(run, 1)
    assert run.below == run.below_examples == 0 and tr.counts["resets"] == 0


def _logit(p: list[float]) -> np.ndarray:
    q = np.clip(np.asarray(p), 1e-6, 1 - 1e-6)
    return np.log(q / (1 - q))


def test_an_offset_that_explains_the_clicks_leaves_the_adapter_at_the_base() -> None:
    """The per-user correction as a fixed offset: clicks drawn at base + 1.5 teach an adapter
    trained without it to shift the logit up (what the correction already serves); with the
    offset, the adapter has nothing left to learn. Progressive validation still scores base +
    adapter against the base (the offset is in the loss only)."""
    exs = make_examples(3000, dim=8, seed=5)
    shifts = {}
    for mode in ("none", "offset"):
        tr = _trainer(OnlineSettings(lr=0.01, embedding_lr=0.2, min_step_examples=32))
        base = tr.bank.base_logits(featurize(exs, CFG)).detach().numpy()
        rng = np.random.default_rng(0)
        clicked = rng.random(len(exs)) < 1 / (1 + np.exp(-(base + 1.5)))
        world = [e.model_copy(update={"click": bool(c)}) for e, c in zip(exs, clicked, strict=True)]
        for i in range(0, len(world), 100):
            chunk = world[i : i + 100]
            tr.learn(chunk, corrections=np.full(len(chunk), 1.5) if mode == "offset" else None)
        tr.flush()
        assert tr.log is not None
        late = slice(2000, None)  # after the adapter had 2,000 examples to learn from
        shifts[mode] = float((_logit(tr.log.online[late]) - _logit(tr.log.base[late])).mean())
    assert shifts["none"] > 0.5
    assert abs(shifts["offset"]) < 0.15


def test_corrections_must_match_the_examples() -> None:
    tr = _trainer()
    exs = make_examples(10, dim=8)
    with pytest.raises(ValueError, match="corrections has 3 values for 10 examples"):
        tr.learn(exs, corrections=np.zeros(3))
    with pytest.raises(ValueError, match="corrections: not finite"):
        tr.learn(exs, corrections=np.full(10, np.nan))
