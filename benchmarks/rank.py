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

Cases run in interleaved rounds (medians per case), `--runs` times; the JSON keeps every run
and the machine's load average. Before timing, the adapter cases' scores are checked against
an independent per-candidate reference (base model with that candidate's adapter merged).

    .venv/bin/python -m benchmarks.rank
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

    from schemas.settings import Settings
    from serving.adapters import AdapterStack
    from serving.ranking import RankInput, RankModel
    from trainers.models.ranker import Ranker, RankerConfig

ROOT = Path(__file__).resolve().parent.parent
# the user-tower variants of `benchmarks/offline_quality.py --user-tower` (encoder, history, hidden)
TOWERS = {"gru_k16_h32": ("gru", 16, 32), "pool_k128_h32": ("pool", 128, 32)}


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
    cases: dict[str, Callable[[], object]], seconds: float
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(wall, thread CPU) seconds per call of each case, in rounds that run every case once:
    a burst of load from other processes on a shared machine then hits every case alike."""
    for fn in cases.values():
        for _ in range(3):
            fn()
    wall: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    end = time.perf_counter() + seconds * len(cases)
    while time.perf_counter() < end or min(len(t) for t in wall.values()) < 10:
        for name, fn in cases.items():
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


def parse_args() -> argparse.Namespace:
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
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/rank.json")
    return ap.parse_args()


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
        dense = rng.normal(size=(n, cfg.state_dim + 3)).astype(np.float32)
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
    large_feats = features(rng, cfg, n, args.large) if args.large else []
    large = batch(large_feats, draw("uniform", args.large)) if args.large else []
    return Bench(args, settings, cfg, device, base_model, model, names, rng, feats, batches, large)


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


def build_cases(b: Bench) -> tuple[dict[str, Callable[[], object]], dict[str, int]]:
    """The timed cases and the candidates each scores per call."""
    from trainers.models.features import RankerBatch
    from trainers.models.ranker import Ranker

    model, batches, large = b.model, b.batches, b.large
    cases: dict[str, Callable[[], object]] = {
        "base": lambda: model.score(batches["uniform"], use_adapters=False),
        "adapters_uniform": lambda: model.score(batches["uniform"], use_adapters=True),
        "adapters_zipf": lambda: model.score(batches["zipf"], use_adapters=True),
        "adapters_zipf_per_sample": lambda: per_sample(model, batches["zipf"]),
        "slot_adapters": lambda: model.score(batches["slot"], use_adapters=True),
        "one_adapter_per_sample": lambda: per_sample(model, batches["one"]),
        "one_request_base": lambda: model.score(batches["uniform"][:1], use_adapters=False),
        "one_request_adapters_uniform": lambda: model.score(batches["uniform"][:1], use_adapters=True),
    }
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
    n, args = b.args.candidates, b.args
    size = {name: n if name.startswith("one_request") else n * args.requests for name in cases}
    size.update({name: n * args.large for name in cases if name.startswith("large")})
    return cases, size


def measure(
    cases: dict[str, Callable[[], object]], args: argparse.Namespace, clock: str
) -> list[dict[str, Any]]:
    """`--runs` interleaved runs of every case: medians per case, the load average around each."""
    runs: list[dict[str, Any]] = []
    for _ in range(args.runs):
        load_before = os.getloadavg()[0]
        wall, cpu = interleaved(cases, args.seconds)
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
    return runs


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


def main() -> None:
    args = parse_args()
    b = build(args)
    checks = check_scores(b)
    cases, size = build_cases(b)
    # thread CPU time excludes the time other processes of a shared machine hold the core
    # (what a replica on its own core would see); only valid with one torch thread
    clock = "thread_cpu" if args.threads == 1 and b.device.type == "cpu" else "wall"
    runs = measure(cases, args, clock)
    results = {}
    for name in cases:
        ms = statistics.median(r["ms_per_batch"][name] for r in runs)
        results[name] = {
            "ms_per_batch": round(ms, 3),
            "candidates": size[name],
            "candidates_per_s": round(size[name] / ms * 1000),
        }
    recall = recall_ms(b)
    baseline = baselines(cases, bool(b.large))
    costs = {name: cost(runs, name, base) for name, base in baseline.items()}
    wall_costs = {name: cost(runs, name, base, "wall_ms_per_batch") for name, base in baseline.items()}
    print_report(b, results, runs, costs, wall_costs, clock, recall)
    from deploy.machine import write_result

    write_result(args.out, result_json(b, checks, results, runs, costs, wall_costs, clock, recall))
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
