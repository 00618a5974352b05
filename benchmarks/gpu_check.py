"""GPU check of the serving rank model: throughput with 1,000 mixed LoRA adapters on CUDA, and
the GPU scores compared with the CPU scores of the same batch (and with the trainers' PEFT bank).

Runs anywhere: without CUDA it runs the CPU part and says the CUDA part was skipped; with CUDA it
writes `benchmarks/results/gpu_check.json`. Needs the project's Python dependencies (torch,
safetensors, peft, pydantic; `pip install -e .`), no services.

    python -m benchmarks.gpu_check [--adapters 1000] [--requests 64]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=64, help="requests of 500 candidates per GPU batch")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/gpu_check.json")
    args = ap.parse_args()

    import copy

    import numpy as np
    import torch

    from deploy.machine import write_result
    from schemas.settings import LoraSettings, Settings
    from serving.adapters import CANDIDATE
    from serving.ranking import RankInput, RankModel
    from trainers.models.features import RankerBatch
    from trainers.models.lora import AdapterBank as PeftBank
    from trainers.models.ranker import Ranker, RankerConfig

    torch.set_num_threads(2)
    settings = Settings(serving={"adapter_capacity": args.adapters})
    torch.manual_seed(0)
    cfg = RankerConfig(state_dim=settings.state_dim)
    base = Ranker(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    weights: dict[str, Any] = {}
    for i in range(args.adapters):
        weights[f"adv:{i}"] = {}
    cpu = RankModel(copy.deepcopy(base), "check", settings, torch.device("cpu"))
    for aid in weights:
        weights[aid] = {
            n: (
                torch.randn(cpu.bank.rank, s.fan_in, generator=gen) * 0.05,
                torch.randn(s.fan_out, cpu.bank.rank, generator=gen) * 0.05,
            )
            for n, s in cpu.bank.shapes.items()
        }
        cpu.bank.put(aid, weights[aid], version="seq-0", seq=0, base_version="check")

    rng = np.random.default_rng(0)
    n = 500
    sizes = list(cfg.table_sizes.values())

    def request() -> tuple[RankInput, list[str]]:
        ids = np.stack([rng.integers(0, s, n) for s in sizes], axis=1)
        aids = [f"adv:{i}" for i in rng.integers(0, args.adapters, n)]
        rows = np.array([cpu.bank.row(a, CANDIDATE) for a in aids])
        dense = rng.normal(size=(n, cfg.dense_dim)).astype(np.float32)
        return RankInput(torch.from_numpy(dense), torch.from_numpy(ids), torch.from_numpy(rows)), aids

    reqs = [request() for _ in range(args.requests)]
    inputs = [r for r, _ in reqs]
    cpu.score(inputs[:1], use_adapters=True)  # first-call costs (allocator, lazy init) outside the clock
    t = time.perf_counter()
    cpu_scores = np.concatenate(cpu.score(inputs, use_adapters=True))
    cpu_s = time.perf_counter() - t
    result: dict[str, object] = {
        "adapters": args.adapters,
        "candidates": n * args.requests,
        "cpu_candidates_per_s_adapters": round(n * args.requests / cpu_s),
        "cuda_available": torch.cuda.is_available(),
    }

    # correctness on CPU: the first request against the trainers' PEFT bank
    peft = PeftBank(
        base,
        LoraSettings(
            rank=settings.lora.rank, alpha=settings.lora.alpha, targets=tuple(settings.lora.targets)
        ),
        "check",
    )
    first, first_ids = reqs[0]
    for aid in set(first_ids):
        peft.set_state(
            aid,
            {
                **{f"{m}.lora_A": a for m, (a, _) in weights[aid].items()},
                **{f"{m}.lora_B": b for m, (_, b) in weights[aid].items()},
            },
        )
    want = torch.sigmoid(peft.logits(RankerBatch(first.dense, first.ids), first_ids)).numpy()
    result["cpu_vs_peft_max_abs_diff"] = float(np.abs(cpu_scores[:n] - want).max())
    print(
        f"CPU: {result['cpu_candidates_per_s_adapters']:,} candidates/s with {args.adapters} mixed adapters; "
        f"max |serving - PEFT| = {result['cpu_vs_peft_max_abs_diff']:.2e}"
    )

    if not torch.cuda.is_available():
        print("CUDA: not available here, GPU part skipped")
        return
    dev = torch.device("cuda")
    gpu = RankModel(copy.deepcopy(base).to(dev), "check", settings, dev)
    for aid, w in weights.items():
        gpu.bank.put(aid, w, version="seq-0", seq=0, base_version="check")
    gpu_scores = np.concatenate(gpu.score(inputs, use_adapters=True))
    result["gpu_vs_cpu_max_abs_diff"] = float(np.abs(gpu_scores - cpu_scores).max())
    for name, use in (("base", False), ("adapters", True)):
        for _ in range(5):
            gpu.score(inputs, use_adapters=use)
        torch.cuda.synchronize()
        reps, t = 0, time.perf_counter()
        while time.perf_counter() - t < args.seconds:
            gpu.score(inputs, use_adapters=use)
            reps += 1
        torch.cuda.synchronize()
        result[f"gpu_candidates_per_s_{name}"] = round(reps * n * args.requests / (time.perf_counter() - t))
    result["device"] = torch.cuda.get_device_name(0)
    print(json.dumps(result, indent=2))
    write_result(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
