"""Rank throughput (candidates/s) of the serving rank model on this machine's CPU (or GPU):
the base ranker vs base + LoRA adapters, and the exact recall matmul for reference.

Every case scores the same candidate features (`--requests` requests × `--candidates`
candidates, what one `@serve.batch` call scores); only the adapter of each candidate differs:
- base: the frozen ranker only (the headline's denominator);
- adapters_uniform: each candidate's adapter drawn uniformly from `--adapters` (1,000
  per-advertiser adapters, the headline's numerator: almost every candidate its own adapter);
- adapters_zipf: drawn from a Zipf(`--zipf`) law over the same adapters (skewed advertiser
  traffic: a few adapters take most candidates), heavy ranks at random bank slots;
- adapters_zipf_per_sample: the same batch with merged weights off (every candidate through
  the per-sample path), to show what merging the heavy adapters buys;
- slot_adapters: three per-slot adapters (the default scheme), requests of mixed slots;
- one_request_*: one request of `--candidates` alone;
- with `--large R`: base and adapters_uniform for R requests (more candidates per adapter);
- one_request_plain_ranker / one_request_user_tower_*: issue 16's sequence user tower (the
  variants `offline_quality.py --user-tower` trained; off by default, so not served) against the
  plain ranker, one request with a full history, raw `Ranker.score` on both (`user_tower`).

- slot_adapters_folded (issue 33): each slot's adapter folded into a copy of the base weights
  (`trainers.models.lora.fold_lora`, what a replica can do at swap time), the batch's requests
  grouped by slot, one forward per group without adapters; base_slot_groups: the base model over
  the same groups (what grouping alone costs). `folded_adapters_cost_ratio` is the served path
  (`slot_adapters`: the rank model's bank folds each slot adapter at write into copies of the
  adapted layers only, `serving.ranking.FoldedSlots`) ÷ base (goal ≤ 1.02);
  `fold_lora_copies_cost_ratio` the whole-model copies ÷ base (the trunk's tables once per slot:
  more cache, which serving does not pay), `mixed_adapters_cost_ratio` per-advertiser adapters on
  the banked path;
  slot_adapters_folded_stacked (targets that only add to the logit, the default): the same
  folded weights in one forward, the base trunk once, the slots' folded heads stacked into one
  GEMM and their wide tables into one gather each (`StackedSlots`; `folded_stacked` ratio);
- precision_* (issue 33): the plain ranker as fp32, int8 dynamic quantization
  (`torch.ao.quantization.quantize_dynamic` on nn.Linear), bf16 and `torch.compile`, on the
  same candidates through one chunked scorer (`--variants`). Each variant's served AUC on the
  offline holdout (`--quality-config`: `offline_quality`'s simulator run, time-ordered split,
  `train_ranker`; the variants are of that trained ranker) decides `kept`: |AUC − fp32's| ≤
  0.001. A variant that cannot be built here (no compiler…) is recorded with its error.

Cases run in interleaved rounds (medians per case), `--runs` times; the JSON keeps every run
and the machine's load average; ratios are medians of same-round ratios with a bootstrap 95 %
interval over the rounds. Before timing, the adapter cases' scores (folded ones included) are
checked against an independent per-candidate reference (base model with that candidate's
adapter merged).

    .venv/bin/python -m benchmarks.rank
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.lib.stats import ratio_summary

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import nn

    from schemas.events import TrainingExample
    from schemas.settings import Settings
    from serving.adapters import AdapterStack
    from serving.ranking import RankInput, RankModel
    from trainers.models.features import RankerBatch
    from trainers.models.ranker import Ranker, RankerConfig

ROOT = Path(__file__).resolve().parent.parent
Scorer = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]  # (dense, ids) → pCTR [n]
# the user-tower variants of `benchmarks/offline_quality.py --user-tower` (encoder, history, hidden)
TOWERS = {"gru_k16_h32": ("gru", 16, 32), "pool_k128_h32": ("pool", 128, 32)}
# the precision variants of the ranker (`precision_variants`); fp32 is their reference
VARIANTS = ("fp32", "int8_dynamic", "bf16", "compiled")
AUC_TOLERANCE = 0.001  # issue 33: a variant is kept where |served AUC − fp32's| ≤ this
FOLDED_GOAL = 1.02  # issue 33: rank time with folded slot adapters ≤ this × base
SLOT_ADAPTERS = ("feed", "search", "splash")
# same-round ratios of case times with their bootstrap interval: (numerator, denominator)
RATIO_PAIRS = {
    # the served path: the rank model's bank folds slot adapters at write (`FoldedSlots`: only the
    # adapted layers are copies, the trunk is shared), one forward per slot group
    "folded_adapters": ("slot_adapters", "base"),
    "served_over_base_same_groups": ("slot_adapters", "base_slot_groups"),
    # whole-model copies by `fold_lora` (the trunk's tables three times over: what a replica
    # does not do; kept to show what sharing the trunk saves)
    "fold_lora_copies": ("slot_adapters_folded", "base"),
    "folded_over_base_same_groups": ("slot_adapters_folded", "base_slot_groups"),
    # per-advertiser adapters, which are not folded: the mixed (banked) path
    "adapters_uniform_mixed": ("adapters_uniform", "base"),
    "folded_stacked": ("slot_adapters_folded_stacked", "base"),
    # the ranker traced by TorchScript (`serving.rank_trace_rows`, on by default) over the eager
    # one, the same folded slot adapters: the batch, one request's candidates, and one
    # request's served ads scored at their positions (the request path's second pass)
    "traced_batch": ("slot_adapters", "slot_adapters_eager"),
    "traced_one_request": ("one_request_slot", "one_request_slot_eager"),
    "traced_positions": ("positions_slot", "positions_slot_eager"),
}
POSITIONS = 10  # a request's served ads (k), scored again at their positions


def timed(fn: Callable[[], object], seconds: float) -> float:
    """Median seconds per call over repeated calls for about `seconds`."""
    for _ in range(5):
        fn()
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 10:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def interleaved(
    cases: dict[str, Callable[[], object]], seconds: float, seed: int = 0
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(wall, thread CPU) seconds per call of each case, in rounds that run every case once:
    a burst of load from other processes on a shared machine then hits every case alike. Each
    round runs the cases in a fresh (seeded) order: in a fixed one the first case of every round
    ran after the last one's large batches had evicted its weights and tables from the cache,
    and read ~12 % slower than later in the round (the base, the denominator of every ratio)."""
    import random

    for fn in cases.values():
        for _ in range(3):
            fn()
    wall: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    order = list(cases.items())
    shuffle = random.Random(seed).shuffle
    end = time.perf_counter() + seconds * len(cases)
    while time.perf_counter() < end or min(len(t) for t in wall.values()) < 10:
        shuffle(order)
        for name, fn in order:
            t, c = time.perf_counter(), time.thread_time()
            fn()
            cpu[name].append(time.thread_time() - c)
            wall[name].append(time.perf_counter() - t)
    return wall, cpu


@dataclasses.dataclass
class Bench:
    """What the measurement runs on: the rank model with its filled adapter bank, the plain base
    model the reference scores with, and the request batches of each adapter distribution."""

    args: argparse.Namespace
    settings: Settings
    cfg: RankerConfig
    device: torch.device
    base_model: Ranker
    model: RankModel
    names: list[str]
    rng: np.random.Generator
    feats: list[tuple[torch.Tensor, torch.Tensor]]
    batches: dict[str, list[RankInput]]
    large: list[RankInput]
    # bank row of each slot adapter → a rank model of the base with that adapter folded in
    folded: dict[int, RankModel]
    stacked: StackedSlots | None  # the same folded slots in one forward (additive targets only)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--candidates", type=int, default=500)
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--zipf", type=float, default=1.1, help="exponent of the skewed adapter distribution")
    ap.add_argument("--large", type=int, default=32, help="requests of the extra large-batch rows (0: none)")
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds per case per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a serving replica uses 1)")
    ap.add_argument("--chunk", type=int, default=None, help="RankModel chunk (default: its own)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--targets",
        type=lambda v: tuple(t for t in v.split(",") if t),
        default=None,
        help="LoRA targets, comma-separated (default: settings.lora.targets)",
    )
    ap.add_argument(
        "--variants",
        type=lambda v: tuple(t for t in v.split(",") if t),
        default=VARIANTS,
        help=f"precision variants of the ranker, comma-separated (default: {','.join(VARIANTS)})",
    )
    ap.add_argument(
        "--quality-config",
        default="default",
        help="offline_quality simulator config whose time-ordered holdout scores the variants' AUC "
        "(default, rich, u<N>x<M>; none: skip, variants of the untrained bench ranker)",
    )
    ap.add_argument("--quality-seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/rank.json")
    args = ap.parse_args(argv)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or "fp32" not in args.variants:
        ap.error(
            f"--variants: {','.join(args.variants)!r} must include fp32 and name only {', '.join(VARIANTS)}"
        )
    if args.quality_config != "none":
        from benchmarks.offline_quality import sim_config

        try:
            sim_config(
                args.quality_config, args.quality_seed, argparse.Namespace(rich_users=1, rich_per_user=1)
            )
        except ValueError as exc:
            ap.error(f"--quality-config: {exc}")
    return args


def fill_bank(bank: AdapterStack, names: list[str]) -> None:
    """One random adapter per name (seeded), all of them resident."""
    import torch

    gen = torch.Generator().manual_seed(1)
    for name in names:
        w = {
            n: (
                torch.randn(bank.rank, s.fan_in, generator=gen) * 0.05,
                torch.randn(s.fan_out, bank.rank, generator=gen) * 0.05,
            )
            for n, s in bank.shapes.items()
        }
        bank.put(name, w, version="seq-0", seq=0, base_version="bench")


def features(
    rng: np.random.Generator, cfg: RankerConfig, n: int, requests: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(dense, ids) of `requests` requests of `n` candidates, slots cycling over the three."""
    import numpy as np
    import torch

    sizes = list(cfg.table_sizes.values())
    out = []
    for j in range(requests):
        ids = np.stack([rng.integers(0, s, n) for s in sizes], axis=1)
        ids[:, 4] = j % 3
        dense = rng.normal(size=(n, cfg.dense_dim)).astype(np.float32)
        out.append((torch.from_numpy(dense), torch.from_numpy(ids)))
    return out


def build(args: argparse.Namespace) -> Bench:
    """The rank model, its adapters and the batches of every adapter distribution (seeded)."""
    import numpy as np
    import torch

    from schemas.settings import Settings
    from serving.adapters import CANDIDATE
    from serving.ranking import RankInput, RankModel
    from trainers.models.ranker import Ranker, RankerConfig, resolve_device

    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    settings = Settings(serving={"adapter_capacity": args.adapters + 3})
    if args.targets:
        settings = settings.model_copy(
            update={"lora": settings.lora.model_copy(update={"targets": args.targets})}
        )
    torch.manual_seed(0)
    cfg = RankerConfig(state_dim=settings.state_dim)
    base_model = Ranker(cfg).eval()
    model = RankModel(copy.deepcopy(base_model).to(device), "bench", settings, device)
    if args.chunk:
        model.chunk = args.chunk
    bank = model.bank
    names = [f"adv:{i}" for i in range(args.adapters)] + ["feed", "search", "splash"]
    fill_bank(bank, names)

    rng = np.random.default_rng(0)
    n = args.candidates
    adapter_rows = np.array([bank.row(f"adv:{i}", CANDIDATE) for i in range(args.adapters)])
    zipf_p = 1.0 / np.arange(1, args.adapters + 1) ** args.zipf
    zipf_p /= zipf_p.sum()
    zipf_rows = adapter_rows[rng.permutation(args.adapters)]  # heavy ranks at random slots
    slots = [bank.row(s, CANDIDATE) for s in ("feed", "search", "splash")]

    def draw(kind: str, requests: int) -> list[np.ndarray]:
        if kind == "uniform":
            return [adapter_rows[rng.integers(0, args.adapters, n)] for _ in range(requests)]
        if kind == "zipf":
            return [zipf_rows[rng.choice(args.adapters, size=n, p=zipf_p)] for _ in range(requests)]
        if kind == "one":
            return [np.full(n, adapter_rows[0]) for _ in range(requests)]
        return [np.full(n, slots[j % 3]) for j in range(requests)]

    def batch(feats: list[tuple[torch.Tensor, torch.Tensor]], rows: list[np.ndarray]) -> list[RankInput]:
        return [RankInput(d, i, torch.from_numpy(r)) for (d, i), r in zip(feats, rows, strict=True)]

    feats = features(rng, cfg, n, args.requests)
    batches = {kind: batch(feats, draw(kind, args.requests)) for kind in ("uniform", "zipf", "slot", "one")}
    # a slot adapter's requests carry the row all their candidates share, as the ad server gives
    # it (`AdPipeline.shared_adapter_row`)
    batches["slot"] = [dataclasses.replace(inp, row=int(inp.rows[0])) for inp in batches["slot"]]
    large_feats = features(rng, cfg, n, args.large) if args.large else []
    large = batch(large_feats, draw("uniform", args.large)) if args.large else []
    plain = fold_slots(base_model, model)
    folded = {
        row: slot_model(copy.deepcopy(f).to(device), model, settings, device) for row, f in plain.items()
    }
    stacked = StackedSlots(base_model, plain, model.chunk) if additive(model) else None
    return Bench(
        args, settings, cfg, device, base_model, model, names, rng, feats, batches, large, folded, stacked
    )


def additive(model: RankModel) -> bool:
    """Whether every adapted module only adds to the logit (`StackedSlots` applies)."""
    from trainers.models.ranker import additive_in_logit

    return all(additive_in_logit(m) for m in model.bank.shapes)


def fold_slots(base_model: Ranker, model: RankModel) -> dict[int, Ranker]:
    """Per slot adapter (keyed by its bank row), the plain base with that adapter folded into
    its weights (`trainers.models.lora.fold_lora`, issue 33 item 2)."""
    from serving.adapters import CANDIDATE
    from trainers.models.lora import fold_lora

    bank = model.bank
    out = {}
    for slot in SLOT_ADAPTERS:
        tensors = {}
        for layer, (a, b) in bank.weights(slot, CANDIDATE).items():  # A [r, in], B [out, r]
            tensors[f"{layer}.lora_A"], tensors[f"{layer}.lora_B"] = a.cpu(), b.cpu()
        out[bank.row(slot, CANDIDATE)] = fold_lora(base_model, tensors, bank.scale)
    return out


def slot_model(folded: Ranker, model: RankModel, settings: Settings, device: torch.device) -> RankModel:
    """A folded ranker as a rank model scored without adapters: what a replica that folds at
    swap time serves a slot's requests with. Same class, chunk and code path as the base case;
    its own bank stays empty (capacity 1)."""
    from serving.ranking import RankModel

    small = settings.model_copy(
        update={"serving": settings.serving.model_copy(update={"adapter_capacity": 1})}
    )
    out = RankModel(folded, "bench-folded", small, device)
    out.chunk = model.chunk
    return out


def score_groups(models: dict[int, RankModel], inputs: list[RankInput]) -> list[np.ndarray]:
    """Scores of slot requests, each request's rows through the model of its (one) adapter row:
    the requests of a batch grouped by slot, one `score` (forward) per group, no adapters."""
    groups: dict[int, list[int]] = {}
    for k, inp in enumerate(inputs):
        groups.setdefault(int(inp.rows[0]), []).append(k)
    out: list[np.ndarray | None] = [None] * len(inputs)
    for row, idx in groups.items():
        scores = models[row].score([inputs[k] for k in idx], use_adapters=False)
        for k, p in zip(idx, scores, strict=True):
            out[k] = p
    return [p for p in out if p is not None]


class StackedSlots:
    """The folded slot adapters served in one forward when every target only adds to the logit
    (`ranker.additive_in_logit`: the head and the wide tables, the default targets): the base
    trunk once for the whole batch, then the slots' folded heads stacked into one GEMM
    ([n, 155] × [155, slots], each candidate's column gathered) and the folded wide tables
    stacked row-wise (one gather each). What a replica could build at swap time from
    `fold_lora`'s copies instead of one forward per slot group."""

    def __init__(self, base: Ranker, folded: dict[int, Ranker], chunk: int) -> None:
        import torch
        from torch import nn

        from trainers.models.features import ID_COLUMNS

        self.base, self.chunk = base, chunk
        models = list(folded.values())
        self.slot_of_row = torch.zeros(max(folded) + 1, dtype=torch.int64)
        self.slot_of_row[list(folded)] = torch.arange(len(folded))
        self.head_w = torch.cat([m.head.weight for m in models]).T.contiguous().detach()  # [in, slots]
        self.head_b = torch.cat([m.head.bias for m in models]).detach()  # [slots]
        # (id column, table rows, the slots' tables stacked; rows 0: a table no slot adapts, the base's)
        self.wide: list[tuple[int, int, torch.Tensor]] = []
        for col, name in enumerate(ID_COLUMNS):
            if name in base.wide:
                weights = [t.weight for m in models if isinstance(t := m.wide[name], nn.Embedding)]
                if all(torch.equal(w, weights[0]) for w in weights):
                    self.wide.append((col, 0, weights[0].detach().view(-1)))
                else:
                    self.wide.append((col, weights[0].shape[0], torch.cat(weights).detach().view(-1)))

    def score(self, inputs: list[RankInput]) -> list[np.ndarray]:
        """pCTR per candidate of each input (one adapter row per candidate, a slot's)."""
        import numpy as np
        import torch

        dense = torch.cat([i.dense for i in inputs])
        ids = torch.cat([i.ids for i in inputs])
        slot = self.slot_of_row[torch.cat([i.rows for i in inputs])]
        parts = []
        with torch.inference_mode():
            for start in range(0, max(1, ids.shape[0]), self.chunk):
                sl = slice(start, start + self.chunk)
                h, s, i = self.base.head_input(dense[sl], ids[sl]), slot[sl], ids[sl]
                logit = torch.addmm(self.head_b, h, self.head_w).gather(1, s.unsqueeze(1)).squeeze(1)
                for col, rows, table in self.wide:
                    at = i[:, col] if rows == 0 else s * rows + i[:, col]
                    logit = logit + table.index_select(0, at)
                parts.append(torch.sigmoid(logit))
        p = torch.cat(parts).numpy()
        return list(np.split(p, np.cumsum([len(i.ids) for i in inputs])[:-1]))


def describe(model: RankModel, inputs: list[RankInput]) -> dict[str, Any]:
    """The adapter-id distribution of a batch and how the rank model splits it."""
    import torch

    rows = torch.cat([i.rows for i in inputs])
    counts = torch.bincount(rows)
    counts = counts[counts > 0]
    ordered = rows[model.ctx.order(rows)]
    merged_adapters = on_merged = 0
    for part in ordered.split(model.chunk):  # planned per forward chunk, as `RankModel` does
        merged = model.ctx.merge_rows(part)
        merged_adapters += merged.numel()
        on_merged += int(torch.isin(part, merged).sum())
    return {
        "candidates": int(rows.numel()),
        "distinct_adapters": int(counts.numel()),
        "max_candidates_per_adapter": int(counts.max()),
        "median_candidates_per_adapter": float(counts.float().median()),
        "top10_adapters_share": round(
            float(counts.sort(descending=True).values[:10].sum()) / rows.numel(), 3
        ),
        "merged_adapters_over_chunks": merged_adapters,
        "merged_candidates_share": round(on_merged / rows.numel(), 3),
    }


def reference(b: Bench, inputs: list[RankInput]) -> np.ndarray:
    """pCTR per candidate from the plain base model with that candidate's adapter merged."""
    import torch

    from serving.adapters import CANDIDATE

    bank, base_model = b.model.bank, b.base_model
    with torch.no_grad():
        dense = torch.cat([i.dense for i in inputs])
        ids = torch.cat([i.ids for i in inputs])
        rows = torch.cat([i.rows for i in inputs])
        by_row = {bank.row(a, CANDIDATE): a for a in b.names}
        params = dict(base_model.named_parameters())
        out = torch.empty(rows.numel())
        for row in rows.unique().tolist():
            idx = (rows == row).nonzero().squeeze(1)
            p: dict[str, torch.Tensor] = dict(params)
            for layer, (a, w) in bank.weights(by_row[row], CANDIDATE).items():
                delta = w @ a  # [out, in]; an id table is stored [num_embeddings, dim]
                if isinstance(base_model.get_submodule(layer), torch.nn.Embedding):
                    delta = delta.T
                p[f"{layer}.weight"] = params[f"{layer}.weight"] + bank.scale * delta
            out[idx] = torch.sigmoid(torch.func.functional_call(base_model, p, (dense[idx], ids[idx])))
        return out.numpy()


def per_sample(model: RankModel, inputs: list[RankInput]) -> list[np.ndarray]:
    """Scores with merged weights off: every candidate through the per-sample path."""
    ctx = model.ctx
    saved = ctx.group_limit, ctx.merge_max
    ctx.group_limit = ctx.merge_max = 0
    try:
        return model.score(inputs, use_adapters=True)
    finally:
        ctx.group_limit, ctx.merge_max = saved


def check_scores(b: Bench) -> dict[str, float]:
    """Max |score - reference| of each batch, merged and per-sample; exits past 1e-5."""
    import numpy as np

    checks = {}
    for kind, inputs in b.batches.items():
        want = reference(b, inputs)
        checks[kind] = float(np.abs(np.concatenate(b.model.score(inputs, use_adapters=True)) - want).max())
        checks[f"{kind}_per_sample"] = float(np.abs(np.concatenate(per_sample(b.model, inputs)) - want).max())
        if kind == "slot":
            checks["slot_folded"] = float(np.abs(np.concatenate(score_groups(b.folded, inputs)) - want).max())
            if b.stacked is not None:
                stacked = np.concatenate(b.stacked.score(inputs))
                checks["slot_folded_stacked"] = float(np.abs(stacked - want).max())
    if max(checks.values()) > 1e-5:
        raise SystemExit(f"adapter scores differ from the per-candidate reference: {checks}")
    return checks


def tower_case(b: Bench, encoder: str, k: int, hidden: int) -> Callable[[], object]:
    """One request of `candidates` through a ranker with issue 16's user tower, full history."""
    from trainers.models.features import RankerBatch
    from trainers.models.ranker import Ranker
    from trainers.models.user_tower import UserSequences

    one_dense, one_ids = b.feats[0]
    tower = Ranker(
        dataclasses.replace(b.cfg, user_tower=encoder, tower_seq_len=k, tower_hidden=hidden)
    ).eval()
    seq = UserSequences.one_full_request(b.args.candidates, k)
    return lambda: tower.score(RankerBatch(one_dense, one_ids), seq)


def build_cases(
    b: Bench, variants: dict[str, Scorer]
) -> tuple[dict[str, Callable[[], object]], dict[str, int]]:
    """The timed cases and the candidates each scores per call."""
    import torch

    from serving.ranking import RankInput
    from trainers.models.features import RankerBatch
    from trainers.models.ranker import Ranker

    model, batches, large = b.model, b.batches, b.large
    cases: dict[str, Callable[[], object]] = {
        "base": lambda: model.score(batches["uniform"], use_adapters=False),
        "adapters_uniform": lambda: model.score(batches["uniform"], use_adapters=True),
        "adapters_zipf": lambda: model.score(batches["zipf"], use_adapters=True),
        "adapters_zipf_per_sample": lambda: per_sample(model, batches["zipf"]),
        "slot_adapters": lambda: model.score(batches["slot"], use_adapters=True),
        # issue 33: each slot's adapter folded into a copy of the base (one forward per slot group),
        # and the base model over the same groups (what the grouping itself costs)
        "slot_adapters_folded": lambda: score_groups(b.folded, batches["slot"]),
        "base_slot_groups": lambda: score_groups(dict.fromkeys(b.folded, model), batches["slot"]),
        "one_adapter_per_sample": lambda: per_sample(model, batches["one"]),
        "one_request_base": lambda: model.score(batches["uniform"][:1], use_adapters=False),
        "one_request_adapters_uniform": lambda: model.score(batches["uniform"][:1], use_adapters=True),
    }
    if b.stacked is not None:
        cases["slot_adapters_folded_stacked"] = functools.partial(b.stacked.score, batches["slot"])
    one = batches["slot"][:1]
    served = [RankInput(one[0].dense[:POSITIONS], one[0].ids[:POSITIONS], one[0].rows[:POSITIONS])]
    timed_inputs = (("slot_adapters", batches["slot"]), ("one_request_slot", one), ("positions_slot", served))
    for name, inputs in timed_inputs:
        cases.setdefault(name, functools.partial(model.score, inputs, True))
        cases[f"{name}_eager"] = functools.partial(eager, model, inputs)
    # issue 16's user tower (off by default: it did not win offline) against the plain ranker, one
    # request of `n` candidates with a full history, raw `Ranker.score` on both sides
    one_dense, one_ids = b.feats[0]
    plain = Ranker(b.cfg).eval()
    cases["one_request_plain_ranker"] = lambda: plain.score(RankerBatch(one_dense, one_ids))
    for key, (encoder, k, hidden) in TOWERS.items():
        cases[f"one_request_user_tower_{key}"] = tower_case(b, encoder, k, hidden)
    if large:
        cases["large_base"] = lambda: model.score(large, use_adapters=False)
        cases["large_adapters_uniform"] = lambda: model.score(large, use_adapters=True)
    # the plain ranker in each precision over the same candidates (one chunked scorer for all)
    dense = torch.cat([d for d, _ in b.feats])
    ids = torch.cat([i for _, i in b.feats])
    for name, scorer in variants.items():
        cases[f"precision_{name}"] = functools.partial(scorer, dense, ids)
    n, args = b.args.candidates, b.args
    size = {name: n if name.startswith("one_request") else n * args.requests for name in cases}
    size.update({name: n * args.large for name in cases if name.startswith("large")})
    size.update({name: POSITIONS for name in cases if name.startswith("positions")})
    return cases, size


def eager(model: RankModel, inputs: list[RankInput]) -> object:
    """`model.score` of the inputs through the eager ranker (its traced one off for the call)."""
    traced = model.trace_rows
    model.trace_rows = 0
    try:
        return model.score(inputs, use_adapters=True)
    finally:
        model.trace_rows = traced


def chunked(model: nn.Module, chunk: int, dtype: torch.dtype | None = None) -> Scorer:
    """pCTR of (dense, ids) through `model` in forward passes of `chunk` rows (as `RankModel` on
    CPU), dense features cast to `dtype` when given, probabilities back in float32."""
    import torch

    def score(dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x = dense if dtype is None else dense.to(dtype)
            parts = [
                torch.sigmoid(model(x[s : s + chunk], ids[s : s + chunk]).float())
                for s in range(0, max(1, ids.shape[0]), chunk)
            ]
            return torch.cat(parts) if len(parts) > 1 else parts[0]

    return score


def precision_variants(
    ranker: Ranker, names: tuple[str, ...], chunk: int, warm: tuple[torch.Tensor, torch.Tensor]
) -> tuple[dict[str, Scorer], dict[str, str]]:
    """The ranker as `fp32` (itself), `int8_dynamic` (`torch.ao.quantization.quantize_dynamic`:
    every nn.Linear with int8 weights, activations quantized per batch), `bf16` (weights and
    dense inputs in bfloat16) and `compiled` (`torch.compile`, inductor, one compile thread):
    (scorer per variant, error text per variant that could not be built or run on `warm`)."""
    import warnings

    import torch
    from torch import nn

    scorers: dict[str, Scorer] = {}
    errors: dict[str, str] = {}
    for name in names:
        model = copy.deepcopy(ranker).eval()
        try:
            if name == "int8_dynamic":
                with warnings.catch_warnings():  # deprecated for torchao in 2.10+, still the API asked for
                    warnings.simplefilter("ignore")
                    model = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
                scorer = chunked(model, chunk)
            elif name == "bf16":
                scorer = chunked(model.to(torch.bfloat16), chunk, torch.bfloat16)
            elif name == "compiled":
                import torch._inductor.config as inductor_config

                inductor_config.compile_threads = 1  # a shared 2-core machine: no compile worker pool
                scorer = chunked(torch.compile(model), chunk)  # type: ignore[arg-type]
            else:
                scorer = chunked(model, chunk)
            dense, ids = warm
            for n in (chunk, ids.shape[0] % chunk or chunk, 7):  # the batch's shapes, and another
                scorer(dense[:n], ids[:n])
        except Exception as exc:  # a variant this machine cannot build (no compiler…) is recorded
            errors[name] = f"{type(exc).__name__}: {exc}"[:2000]
            continue
        scorers[name] = scorer
    return scorers, errors


def measure(
    cases: dict[str, Callable[[], object]], args: argparse.Namespace, clock: str
) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """`--runs` interleaved runs of every case: medians per case, the load average around each;
    and every round's seconds per case on `clock`, over all runs (same index: same round)."""
    runs: list[dict[str, Any]] = []
    rounds: dict[str, list[float]] = {k: [] for k in cases}
    for run in range(args.runs):
        load_before = os.getloadavg()[0]
        wall, cpu = interleaved(cases, args.seconds, seed=run)
        for k, v in (cpu if clock == "thread_cpu" else wall).items():
            rounds[k].extend(v)
        runs.append(
            {
                "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                "ms_per_batch": {
                    k: round(statistics.median((cpu if clock == "thread_cpu" else wall)[k]) * 1000, 3)
                    for k in cases
                },
                "wall_ms_per_batch": {k: round(statistics.median(v) * 1000, 3) for k, v in wall.items()},
                "reps": min(len(v) for v in wall.values()),
            }
        )
    return runs, rounds


def recall_ms(b: Bench) -> float:
    """Median ms of an exact recall search over 10k random ad vectors (the reference row)."""
    import numpy as np

    from serving.index import ExactIndex

    dim = b.settings.state_dim
    vecs = b.rng.normal(size=(10_000, dim)).astype(np.float32)
    q = b.rng.normal(size=dim).astype(np.float32)
    index = ExactIndex(vecs, 10_000)
    allowed = np.ones(10_000, dtype=bool)
    return round(timed(lambda: index.search(q, b.settings.recall.k, allowed), b.args.seconds / 2) * 1000, 3)


def baselines(cases: dict[str, Callable[[], object]], large: bool) -> dict[str, str]:
    """Each adapter case against the base case of the same batch."""
    baseline = {name: "base" for name in cases if name != "base" and "base" not in name}
    baseline["one_request_adapters_uniform"] = "one_request_base"
    baseline.pop("one_request_plain_ranker", None)
    for key in TOWERS:
        baseline[f"one_request_user_tower_{key}"] = "one_request_plain_ranker"
    if large:
        baseline["large_adapters_uniform"] = "large_base"
    for name in [n for n in cases if n.startswith("precision_")]:
        baseline.pop(name, None)
        if name != "precision_fp32":
            baseline[name] = "precision_fp32"
    return baseline


def cost(runs: list[dict[str, Any]], case: str, base: str = "base", key: str = "ms_per_batch") -> float:
    """Fraction of base throughput lost, per run, median over runs (same-run pairs)."""
    return float(statistics.median(1 - r[key][base] / r[key][case] for r in runs))


def print_report(
    b: Bench,
    results: dict[str, dict[str, Any]],
    runs: list[dict[str, Any]],
    costs: dict[str, float],
    wall_costs: dict[str, float],
    clock: str,
    recall: float,
) -> None:
    """The table of cases and the headline line."""
    from rich.console import Console
    from rich.table import Table

    args = b.args
    table = Table("case", "candidates / batch", "ms / batch", "candidates / s", "cost vs base")
    for name, r in results.items():
        c = costs.get(name)
        table.add_row(
            name,
            str(r["candidates"]),
            str(r["ms_per_batch"]),
            f"{r['candidates_per_s']:,}",
            "" if c is None else f"{c:.1%}",
        )
    Console().print(table)
    loads = [x for r in runs for x in r["load_avg_1min"]]
    per_run = [round(1 - r["ms_per_batch"]["base"] / r["ms_per_batch"]["adapters_uniform"], 3) for r in runs]
    print(
        f"{args.adapters:,} uniform adapters cost {costs['adapters_uniform']:.1%} of base throughput "
        f"(goal ≤ 20%; per run {per_run}; wall clock {wall_costs['adapters_uniform']:.1%}), "
        f"Zipf({args.zipf}) {costs['adapters_zipf']:.1%}, slot adapters {costs['slot_adapters']:.1%}; "
        f"clock {clock}; load average {min(loads)}–{max(loads)} on {os.cpu_count()} CPUs; "
        f"exact recall over 10k ads: {recall} ms"
    )


def user_tower_summary(
    results: dict[str, dict[str, Any]], runs: list[dict[str, Any]], n: int
) -> dict[str, Any]:
    """One request of `candidates`, full history; not served (not the default)."""
    return {
        "candidates": n,
        "plain_ranker_ms": results["one_request_plain_ranker"]["ms_per_batch"],
        **{f"{key}_ms": results[f"one_request_user_tower_{key}"]["ms_per_batch"] for key in TOWERS},
        **{
            f"{key}_over_plain": round(
                float(
                    statistics.median(
                        r["ms_per_batch"][f"one_request_user_tower_{key}"]
                        / r["ms_per_batch"]["one_request_plain_ranker"]
                        for r in runs
                    )
                ),
                2,
            )
            for key in TOWERS
        },
    }


@dataclasses.dataclass
class Holdout:
    """The offline holdout the precision variants are scored on: `benchmarks.offline_quality`'s
    simulator run (its config and seed) through the real pipeline, split by impression time
    (last 20 %), and the ranker `train_ranker` fitted on the rest (seeded)."""

    config: str
    seed: int
    ranker: Ranker
    train: list[TrainingExample]
    hold: list[TrainingExample]
    train_b: RankerBatch
    hold_b: RankerBatch
    seconds: float


def train_holdout(config: str, seed: int, settings: Settings) -> Holdout:
    """Simulate, split and train as `offline_quality.sim_run` does (same functions, same split)."""
    from benchmarks.offline_quality import examples_of, sim_config
    from trainers.models.features import featurize
    from trainers.models.ranker import RankerConfig
    from trainers.offline import TrainSpec, time_split, train_ranker
    from workloads import Market

    t0 = time.perf_counter()
    mcfg, n = sim_config(config, seed, argparse.Namespace(rich_users=20, rich_per_user=10_000))
    examples = examples_of(list(Market(mcfg).open_loop(n)), settings, None)
    train, hold = time_split(examples, 0.2)
    rcfg = RankerConfig(state_dim=settings.state_dim)
    train_b, hold_b = featurize(train, rcfg), featurize(hold, rcfg)
    ranker = train_ranker(train_b, rcfg, TrainSpec(seed=seed)).eval()
    return Holdout(config, seed, ranker, train, hold, train_b, hold_b, time.perf_counter() - t0)


def variant_quality(h: Holdout, scorers: dict[str, Scorer], settings: Settings) -> dict[str, dict[str, Any]]:
    """Holdout AUC of each variant, of the ranker alone and as served (with the streams
    worker's per-user correction learned over the whole history: `offline_quality`'s
    `auc_served_warm`), the served difference to fp32 with its 95 % paired-bootstrap interval,
    and `kept`: |served AUC − fp32's| ≤ `AUC_TOLERANCE`."""
    import numpy as np

    from streams.in_memory import corrected_scores
    from trainers.baseline import auc_diff_ci
    from trainers.quality import auc

    assert h.hold_b.label is not None
    y = h.hold_b.label.numpy()
    served: dict[str, np.ndarray] = {}
    out: dict[str, dict[str, Any]] = {}
    for name, scorer in scorers.items():
        p_hold = scorer(h.hold_b.dense, h.hold_b.ids).numpy()
        p_served = p_hold
        if settings.state.feedback_lr > 0:
            p_all = np.concatenate([scorer(h.train_b.dense, h.train_b.ids).numpy(), p_hold])
            p_served = corrected_scores([*h.train, *h.hold], p_all, settings.state)[len(h.train) :]
        served[name] = p_served
        out[name] = {"auc_ranker": round(auc(p_hold, y), 5), "auc_served": round(auc(p_served, y), 5)}
    for name, q in out.items():
        diff = auc(served[name], y) - auc(served["fp32"], y)
        q["auc_served_minus_fp32"] = round(diff, 5)
        lo, hi = auc_diff_ci(served[name], served["fp32"], y, seed=h.seed)
        q["auc_served_minus_fp32_ci95"] = [round(lo, 5), round(hi, 5)]
        q["max_abs_score_diff_vs_fp32"] = round(float(np.abs(served[name] - served["fp32"]).max()), 6)
        q["kept"] = bool(abs(diff) <= AUC_TOLERANCE)
    return out


def precision_json(
    args: argparse.Namespace,
    results: dict[str, dict[str, Any]],
    ratios: dict[str, dict[str, Any]],
    quality: dict[str, dict[str, Any]] | None,
    errors: dict[str, str],
    held: Holdout | None,
) -> dict[str, Any]:
    """rank.json's `precision`: per variant its speed (ratio to fp32, same run) and holdout AUC."""
    import torch

    variants: dict[str, dict[str, Any]] = {}
    for name in args.variants:
        if name in errors:
            variants[name] = {"error": errors[name], "kept": False}
            continue
        r = results[f"precision_{name}"]
        variants[name] = {
            "ms_per_batch": r["ms_per_batch"],
            "candidates_per_s": r["candidates_per_s"],
            "candidates_per_s_ratio_to_fp32": ratios.get(f"precision_{name}", {"median": 1.0}),
            # without a holdout (--quality-config none) nothing says whether to keep it
            **(quality[name] if quality else {"kept": None}),
        }
    holdout = None
    if held is not None:
        assert held.hold_b.label is not None
        holdout = {
            "config": held.config,
            "seed": held.seed,
            "train_rows": len(held.train),
            "holdout_rows": len(held.hold),
            "holdout_clicks": int(held.hold_b.label.sum()),
            "seconds_to_build": round(held.seconds, 1),
        }
    return {
        "torch": torch.__version__,
        "quantized_engine": torch.backends.quantized.engine,
        "device": "cpu",
        "timed_on": "the holdout's trained ranker" if held else "the untrained bench ranker",
        "auc_tolerance": AUC_TOLERANCE,
        "holdout": holdout,
        "variants": variants,
    }


def same_round_ratios(rounds: dict[str, list[float]], variants: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """`RATIO_PAIRS` (time ÷ time) and each precision variant's candidates/s ÷ fp32's."""
    out = {
        key: ratio_summary(rounds[num], rounds[den])
        for key, (num, den) in RATIO_PAIRS.items()
        if num in rounds and den in rounds
    }
    for name in variants:
        if name != "fp32" and f"precision_{name}" in rounds:
            out[f"precision_{name}"] = ratio_summary(rounds["precision_fp32"], rounds[f"precision_{name}"])
    return out


def print_issue33(extra: dict[str, Any]) -> None:
    """Issue 33's figures: folded vs mixed slot adapters, and the precision variants."""
    from rich.console import Console
    from rich.table import Table

    r = extra["adapter_cost_ratios"]
    print(
        f"slot adapters folded as served: {r['folded_adapters']['median']}× base "
        f"{r['folded_adapters']['ci95']} (goal ≤ {FOLDED_GOAL}; over the base in the same slot groups "
        f"{r['served_over_base_same_groups']['median']}×); whole-model fold_lora copies "
        f"{r['fold_lora_copies']['median']}× (same groups {r['folded_over_base_same_groups']['median']}×); "
        f"trunk once, heads stacked {r['folded_stacked']['median']}×; 1,000 uniform adapters (mixed "
        f"path) {r['adapters_uniform_mixed']['median']}×"
    )
    print(
        "traced ranker ÷ eager (time, slot adapters folded): "
        + "; ".join(
            f"{what} {r[key]['median']}× {r[key]['ci95']}"
            for key, what in (
                ("traced_batch", "the batch"),
                ("traced_one_request", "one request"),
                ("traced_positions", f"{POSITIONS} served ads at their positions"),
            )
            if key in r
        )
    )
    table = Table(
        "variant", "candidates / s", "× fp32 (95 % CI)", "AUC served", "Δ vs fp32 (95 % CI)", "kept"
    )
    for name, v in extra["precision"]["variants"].items():
        if "error" in v:
            table.add_row(name, "", "", "", v["error"][:60], "no")
            continue
        speed = v["candidates_per_s_ratio_to_fp32"]
        table.add_row(
            name,
            f"{v['candidates_per_s']:,}",
            f"{speed['median']} {speed.get('ci95', '')}",
            str(v.get("auc_served", "")),
            f"{v.get('auc_served_minus_fp32', '')} {v.get('auc_served_minus_fp32_ci95', '')}",
            str(v["kept"]),
        )
    Console().print(table)


def case_results(
    runs: list[dict[str, Any]], cases: dict[str, Callable[[], object]], size: dict[str, int]
) -> dict[str, dict[str, Any]]:
    """Per case: median ms per batch over runs, candidates per batch and per second."""
    results = {}
    for name in cases:
        ms = statistics.median(r["ms_per_batch"][name] for r in runs)
        results[name] = {
            "ms_per_batch": round(ms, 3),
            "candidates": size[name],
            "candidates_per_s": round(size[name] / ms * 1000),
        }
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    b = build(args)
    checks = check_scores(b)
    held = (
        None
        if args.quality_config == "none"
        else train_holdout(args.quality_config, args.quality_seed, b.settings)
    )
    import torch

    warm = (torch.cat([d for d, _ in b.feats]), torch.cat([i for _, i in b.feats]))
    ranker = held.ranker if held else b.base_model
    variants, errors = precision_variants(ranker, args.variants, b.model.chunk, warm)
    cases, size = build_cases(b, variants)
    # thread CPU time excludes the time other processes of a shared machine hold the core
    # (what a replica on its own core would see); only valid with one torch thread
    clock = "thread_cpu" if args.threads == 1 and b.device.type == "cpu" else "wall"
    runs, rounds = measure(cases, args, clock)
    results = case_results(runs, cases, size)
    ratios = same_round_ratios(rounds, args.variants)
    quality = variant_quality(held, variants, b.settings) if held else None
    folded = ratios["folded_adapters"]
    extra = {
        "folded_adapters_cost_ratio": folded["median"],
        "folded_adapters_cost_ratio_ci95": folded["ci95"],
        "folded_adapters_goal": FOLDED_GOAL,
        "mixed_adapters_cost_ratio": ratios["adapters_uniform_mixed"]["median"],
        "fold_lora_copies_cost_ratio": ratios["fold_lora_copies"]["median"],
        "adapter_cost_ratios": {k: v for k, v in ratios.items() if not k.startswith("precision_")},
        "precision": precision_json(args, results, ratios, quality, errors, held),
    }
    recall = recall_ms(b)
    baseline = baselines(cases, bool(b.large))
    costs = {name: cost(runs, name, base) for name, base in baseline.items()}
    wall_costs = {name: cost(runs, name, base, "wall_ms_per_batch") for name, base in baseline.items()}
    print_report(b, results, runs, costs, wall_costs, clock, recall)
    print_issue33(extra)
    from deploy.machine import write_result

    write_result(
        args.out, {**result_json(b, checks, results, runs, costs, wall_costs, clock, recall), **extra}
    )
    print(f"wrote {args.out}")


def result_json(
    b: Bench,
    checks: dict[str, float],
    results: dict[str, dict[str, Any]],
    runs: list[dict[str, Any]],
    costs: dict[str, float],
    wall_costs: dict[str, float],
    clock: str,
    recall: float,
) -> dict[str, Any]:
    """rank.json: the headline, the plan, every case and every run."""
    from deploy.machine import machine

    args, model, settings, n, large = b.args, b.model, b.settings, b.args.candidates, b.large
    return {
        "benchmark": "rank",
        "machine": machine(),
        "device": str(b.device),
        "torch_threads": args.threads,
        "cpus": os.cpu_count(),
        "batch": f"{args.requests} requests x {n} candidates",
        "clock": clock,
        "adapters": args.adapters,
        "adapter_distribution": "uniform over the adapters (headline); Zipf case: p(k) ∝ k^-s",
        "zipf_exponent": args.zipf,
        "lora_rank": settings.lora.rank,
        "lora_targets": list(settings.lora.targets),
        "lora_layers": list(model.bank.shapes),
        "plan": {
            "chunk": model.chunk,
            "group_limit": model.ctx.group_limit,
            "merge_min": model.ctx.merge_min,
            "merge_max": model.ctx.merge_max,
        },
        "candidates_per_s_base": results["base"]["candidates_per_s"],
        "candidates_per_s_adapters": results["adapters_uniform"]["candidates_per_s"],
        "candidates_per_s_adapters_zipf": results["adapters_zipf"]["candidates_per_s"],
        "candidates_per_s_slot_adapters": results["slot_adapters"]["candidates_per_s"],
        "adapter_cost_fraction": round(costs["adapters_uniform"], 3),
        "cost_fractions": {k: round(v, 3) for k, v in costs.items()},
        "cost_fractions_wall_clock": {k: round(v, 3) for k, v in wall_costs.items()},
        "distributions": {
            "uniform": describe(model, b.batches["uniform"]),
            "zipf": describe(model, b.batches["zipf"]),
            "slot": describe(model, b.batches["slot"]),
            **({f"large_uniform_{args.large}x{n}": describe(model, large)} if large else {}),
        },
        "max_abs_diff_vs_reference": checks,
        "recall_exact_10k_ms": recall,
        "user_tower": user_tower_summary(results, runs, n),
        "cases": results,
        "runs": runs,
    }


if __name__ == "__main__":
    main()
