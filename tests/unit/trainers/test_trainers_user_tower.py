"""The sequence user tower: shapes, once-per-request, the no-leak sequence builder, flag-off identity."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch

from schemas.errors import ConfigError, ModelError
from schemas.events import AdCreative, Click, Dwell, Impression, Message
from schemas.settings import Settings
from streams.in_memory import training_examples
from tests.support.benchmarks import load_benchmark
from trainers.models.features import featurize, stable_bucket
from trainers.models.ranker import Ranker, RankerConfig, load_checkpoint, save_checkpoint, weights_version
from trainers.models.user_tower import UserSequences, build_sequences, dwell_bucket
from trainers.offline import TrainSpec
from trainers.sequence_training import mean_gate, predict_with_sequences, train_tower_ranker
from workloads import Market, MarketConfig

# without the query columns (issue 34): the dense input of 7 columns these pins were made with
SMALL = dict(
    state_dim=4,
    ad_buckets=64,
    advertiser_buckets=16,
    campaign_buckets=16,
    category_buckets=8,
    query_features=False,
)
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _ids(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.randint(0, k, (n,), generator=gen) for k in (64, 16, 16, 8, 3, 16, 24)], 1)


def _seqs(rows: torch.Tensor, lengths: list[int], k: int, gen: torch.Generator) -> UserSequences:
    r = len(lengths)
    return UserSequences(
        ad=torch.randint(0, 64, (r, k), generator=gen),
        category=torch.randint(0, 8, (r, k), generator=gen),
        click=(torch.rand(r, k, generator=gen) < 0.3).float(),
        dwell=torch.randint(0, 5, (r, k), generator=gen),
        age=torch.rand(r, k, generator=gen) * 5,
        length=torch.tensor(lengths),
        row=rows,
    )


def test_flag_off_is_the_previous_model_bit_for_bit() -> None:
    # pinned with the ranker as it was before the tower existed (git HEAD 2d46a9f): the same
    # initial weights (the content hash covers every name and value) and the same logits
    torch.manual_seed(0)
    model = Ranker(RankerConfig(**SMALL, deep_hidden=16))  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(1)
    dense, ids = torch.randn(5, 7, generator=gen), _ids(5, gen)
    assert weights_version(model) == "ranker-91c37913ee2d54c1"
    assert not any(name.startswith("tower") for name in model.state_dict())
    with torch.no_grad():
        out = model(dense, ids)
    expected = [
        -0.623916506767273,
        -0.06128624081611633,
        -0.5827165842056274,
        -0.7672926187515259,
        -0.22970718145370483,
    ]
    assert torch.allclose(out, torch.tensor(expected), rtol=0, atol=1e-6)
    torch.manual_seed(0)  # with hashed rows for more slots (issue 34), the defaults score as before
    with_slots = Ranker(RankerConfig(**SMALL, deep_hidden=16, slot_buckets=8))  # type: ignore[arg-type]
    with torch.no_grad():
        assert torch.equal(with_slots(dense, ids), out)
    with pytest.raises(ModelError, match="without a user tower"):
        model(dense, ids, UserSequences.empty(5, 3))


@pytest.mark.parametrize("encoder", ["gru", "pool"])
def test_tower_shapes_and_one_tower_pass_per_request(encoder: str) -> None:
    cfg = RankerConfig(**SMALL, user_tower=encoder, tower_seq_len=6, tower_hidden=5)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = Ranker(cfg).eval()
    gen = torch.Generator().manual_seed(2)
    # 7 candidates of 3 requests; rows of one request carry its decayed state and context
    rows = torch.tensor([0, 0, 0, 1, 2, 2, 1])
    dense, ids = torch.randn(7, 7, generator=gen), _ids(7, gen)
    first = torch.tensor([0, 3, 4])
    dense[:, :4] = dense[first[rows], :4]
    ids[:, 4], ids[:, 6] = ids[first[rows], 4], ids[first[rows], 6]
    seq = _seqs(rows, [6, 0, 3], 6, gen)
    with torch.no_grad():
        fused, gate = model.user_vector(dense, ids, seq)
        logits = model(dense, ids, seq)
    assert fused.shape == (3, cfg.state_dim) and gate.shape == (3, 3)
    assert torch.allclose(gate.sum(1), torch.ones(3)) and bool((gate > 0).all())
    assert logits.shape == (7,) and bool(torch.isfinite(logits).all())
    # a candidate's logit does not depend on which other rows share the batch
    alone = seq.select(torch.tensor([4]))
    with torch.no_grad():
        one = model(dense[4:5], ids[4:5], alone)
    assert alone.requests == 1 and torch.allclose(one, logits[4:5], atol=1e-6)
    # padding beyond a request's length is ignored: changing it changes nothing
    padded = UserSequences(seq.ad.clone(), seq.category, seq.click, seq.dwell, seq.age, seq.length, seq.row)
    padded.ad[2, 3:] = 7
    padded.ad[1, :] = 9
    with torch.no_grad():
        assert torch.equal(model(dense, ids, padded), logits)
    with pytest.raises(ModelError, match="needs `seq`"):
        model(dense, ids)


def test_config_validates_the_tower_fields() -> None:
    with pytest.raises(ConfigError, match=r"user_tower.*\('none', 'gru', 'pool'\).*'lstm'"):
        RankerConfig(user_tower="lstm")
    with pytest.raises(ConfigError, match=r"tower_seq_len.*0"):
        RankerConfig(user_tower="gru", tower_seq_len=0)
    assert RankerConfig(user_tower="gru").input_dim == RankerConfig().input_dim + RankerConfig().state_dim


def _imp(eid: str, user: str, ad: str, t: float, request: str) -> Impression:
    return Impression(
        event_id=eid, ts=T0 + timedelta(seconds=t), user_id=user, request_id=request, ad_id=ad,
        campaign_id="c", advertiser_id="v", slot="feed", position=0, price=1.0,
    )  # fmt: skip


def _at(t: float) -> datetime:
    return T0 + timedelta(seconds=t)


def test_builder_never_sees_the_request_itself_or_later_events() -> None:
    cat = [
        AdCreative(
            event_id=f"cat-{a}", ts=T0, ad_id=a, campaign_id="c", advertiser_id="v", category=c,
            title=f"{c} deal", bid=1.0, daily_budget=10.0, active=True,
        )
        for a, c in (("a1", "shoes"), ("a2", "travel"), ("a3", "books"))
    ]  # fmt: skip
    events: list[Message] = [
        *cat,
        _imp("i1", "u", "a1", 0, "r1"),
        _imp("i2", "u", "a2", 10, "r2"),
        Click(event_id="k1", ts=_at(12), user_id="u", impression_id="i1", ad_id="a1", campaign_id="c"),
        _imp("i3", "u", "a3", 15, "r3"),  # the request scored below, two candidates
        _imp("i4", "u", "a1", 15, "r3"),
        Click(event_id="k3", ts=_at(16), user_id="u", impression_id="i3", ad_id="a3", campaign_id="c"),
        Dwell(event_id="d1", ts=_at(20), user_id="u", impression_id="i1", ad_id="a1", dwell_ms=40_000),
        _imp("i5", "u", "a2", 30, "r4"),
        _imp("j1", "w", "a2", 5, "q1"),  # another user's events never enter u's sequences
    ]
    events.sort(key=lambda m: m.ts)
    cfg = RankerConfig(**SMALL, user_tower="gru", tower_seq_len=3)  # type: ignore[arg-type]

    class Row:
        def __init__(self, user: str, t: float) -> None:
            self.user_id, self.impression_ts = user, _at(t)

    seq = build_sequences(events, [Row("u", 15), Row("u", 15), Row("u", 30), Row("u", 0)], cfg)
    assert seq.row.tolist() == [0, 0, 1, 2] and seq.requests == 3
    # request at 15 s: i1 (clicked at 12 s, dwell not yet known) and i2; not i3/i4 themselves
    assert seq.length[0] == 2
    bucket = [stable_bucket(c, 8, "category") for c in ("shoes", "travel", "books")]
    assert seq.category[0, :2].tolist() == bucket[:2]
    assert seq.click[0, :2].tolist() == [1.0, 0.0]
    assert seq.dwell[0, :2].tolist() == [0, 0]
    assert seq.age[0, :2].tolist() == pytest.approx([math.log1p(15), math.log1p(5)])
    # request at 30 s: the last 3 of i1…i4 (K = 3): i2, i3 (its click at 16 s known now), i4
    assert seq.length[1] == 3
    assert seq.ad[1].tolist() == [stable_bucket(a, 64, "ad") for a in ("a2", "a3", "a1")]
    assert seq.click[1].tolist() == [0.0, 1.0, 0.0]
    # the user's first impression has no history
    assert seq.length[2] == 0 and seq.click[2].sum() == 0
    # with K = 4 the request at 30 s also sees i1 with its dwell, now arrived
    seq4 = build_sequences(events, [Row("u", 30)], RankerConfig(**SMALL, user_tower="gru", tower_seq_len=4))  # type: ignore[arg-type]
    assert seq4.dwell[0, 0] == dwell_bucket(40_000) == 4 and seq4.click[0, 0] == 1.0


def test_builder_matches_a_brute_force_reference_on_the_simulator() -> None:
    # every row of a small simulated run: its sequence equals a direct scan of the stream for
    # the user's impressions strictly before the request, with clicks known strictly before it
    market = Market(MarketConfig(seed=3, n_users=6, drift_at=None, new_ads_at=None))
    events = list(market.open_loop(1500))
    examples = list(training_examples(events, Settings()))[:600]
    k = 8
    cfg = RankerConfig(**SMALL, user_tower="gru", tower_seq_len=k)  # type: ignore[arg-type]
    seq = build_sequences(events, examples, cfg)
    imps = [m for m in events if isinstance(m, Impression)]
    clicks = {m.impression_id: m.ts for m in events if isinstance(m, Click)}
    for i, ex in enumerate(examples):
        t = ex.impression_ts
        before = [m for m in imps if m.user_id == ex.user_id and m.ts < t][-k:]
        r = int(seq.row[i])
        assert int(seq.length[r]) == len(before)
        assert ex.impression_id not in {m.event_id for m in before}
        want = [stable_bucket(m.ad_id, 64, "ad") for m in before]
        assert seq.ad[r, : len(before)].tolist() == want
        known = [1.0 if m.event_id in clicks and clicks[m.event_id] < t else 0.0 for m in before]
        assert seq.click[r, : len(before)].tolist() == known
        # the row's own click is never an input
        if ex.click:
            assert all(m.event_id != ex.impression_id for m in before)


@pytest.mark.parametrize("encoder", ["gru", "pool"])
def test_training_learns_and_checkpoints_round_trip(tmp_path: Path, encoder: str) -> None:
    market = Market(MarketConfig(seed=4, n_users=30, drift_at=None, new_ads_at=None))
    events = list(market.open_loop(3000))
    examples = sorted(training_examples(events, Settings()), key=lambda e: (e.impression_ts, e.impression_id))
    cfg = RankerConfig(state_dim=Settings().state_dim, user_tower=encoder, tower_seq_len=8, tower_hidden=8)
    batch, seq = featurize(examples, cfg), build_sequences(events, examples, cfg)
    model = train_tower_ranker(batch, seq, cfg, TrainSpec(epochs=1, seed=0))
    p = predict_with_sequences(model, batch, seq)
    assert p.shape == (len(batch),) and bool(((p > 0) & (p < 1)).all())
    gate = mean_gate(model, batch, seq)
    assert len(gate) == 3 and sum(gate) == pytest.approx(1.0, abs=1e-5)
    out = tmp_path
    version = save_checkpoint(model, out)
    loaded, v2 = load_checkpoint(out)
    assert v2 == version and loaded.config == cfg
    assert torch.allclose(predict_with_sequences(loaded, batch, seq), p)
    with pytest.raises(ConfigError, match="user_tower"):
        train_tower_ranker(batch, seq, RankerConfig(state_dim=cfg.state_dim), TrainSpec(epochs=1))


def _run(seed: int, decayed: float, tower: float) -> dict[str, object]:
    v = {"train_s": 1.0, "rank_ms": 1.0, "gap_oracle_ranker": 0.0}
    return {
        "config": "default",
        "seed": seed,
        "auc_ceiling": 0.8,
        "auc_oracle": 0.85,
        "variants": {
            "decayed": {**v, "auc": decayed, "gap_ceiling_ranker": 0.8 - decayed},
            "gru_k32_h32": {
                **v, "auc": tower, "gap_ceiling_ranker": 0.8 - tower, "minus_decayed": tower - decayed,
            },
        },
    }  # fmt: skip


def test_benchmark_decision_needs_a_mean_gain_of_0_005() -> None:
    oq = load_benchmark("offline_quality")
    win = oq.summarize_tower([_run(0, 0.78, 0.79), _run(1, 0.78, 0.784)])["default"]
    assert win["best"] == "gru_k32_h32" and win["wins_by_0_005"]
    assert win["best_minus_decayed"] == pytest.approx(0.007)
    assert win["ceiling_gap"]["decayed"] == pytest.approx(0.02)
    small = oq.summarize_tower([_run(0, 0.78, 0.785), _run(1, 0.78, 0.783)])["default"]
    assert small["best"] == "gru_k32_h32" and not small["wins_by_0_005"]
    lose = oq.summarize_tower([_run(0, 0.78, 0.77)])["default"]
    assert lose["best"] == "decayed" and not lose["wins_by_0_005"]
