"""Creative variants: the contextual bandit's regret against Bernoulli Thompson sampling, and
off-policy estimates against the simulator's truth and against Open Bandit Pipeline.

- Regret (≥ 5 seeds): a market with variants (`workloads.variants`: per-segment effects, truth
  known); requests for `--ads` ads, each impression's variant chosen by the contextual policy
  (`serving.variants`: linear Thompson sampling on [1, user state vector]) or by Bernoulli
  Thompson sampling per (ad, variant) without context; the same requests and click draws for
  both; cumulative regret against the best variant of each impression. Learning in batches of
  `--batch` impressions (as a replica learns between label fetches).
- Off-policy evaluation on the simulator: uniform-variant logs (propensity 1/V, as the market's
  open loop logs them) of fresh requests; the policy under evaluation is the contextual policy
  as it ended the seed's run (floor 0); truth is its expected click rate on those requests
  (Σ_v π(v|x) p(click|x, v)); IPS, SNIPS and DR from `attribution.ope` (DR's reward model: the
  bandit's posterior means); relative error |estimate − truth| / truth.
- Open Bandit Dataset (small, shipped in obp 0.4.1): the uniform-random log of campaign `all`
  evaluates the Bernoulli-TS logging policy of the same campaign (its per-position item
  frequencies); adstream's estimators and obp's IPW / SNIPW / DR on the same arrays; the largest
  absolute difference of the three. (obp's own `OpenBanditDataset` loader fails under this
  pandas, so the CSVs are read by `workloads.obd`.)
- Selection CPU: `VariantSelector.choose` for one request of `k` ads with variants (process CPU,
  many calls) against the replica's CPU per request that `benchmarks/serve.py` recorded in
  `benchmarks/results/serve.json` (another run, named in the result).

Usage: `.venv/bin/python -m benchmarks.creatives [--seeds 5] [--impressions 90000]`; prints a
table and writes `benchmarks/results/creatives.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from attribution import ope
from deploy.machine import machine, write_result
from serving.variants import (
    VariantPolicy,
    VariantSelector,
    context,
    empty_state,
    probabilities,
    select,
    set_row,
    update,
)
from workloads import Market, MarketConfig
from workloads.obd import obd_files, read_rows

RESULTS = Path(__file__).resolve().parent / "results" / "creatives.json"
SERVE = Path(__file__).resolve().parent / "results" / "serve.json"
ESTIMATORS = ("ips", "snips", "dr")


def scenario(
    seed: int, args: argparse.Namespace
) -> tuple[Market, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The market, and for `n` requests: users, ads, contexts and every variant's true pCTR."""
    cfg = MarketConfig(
        seed=seed, n_users=2000, n_ads=max(args.ads, 4), n_variants=args.variants, bias=args.bias,
        variant_effect_sd=args.effect_sd, drift_at=None, new_ads_at=None,
    )  # fmt: skip
    market = Market(cfg)
    users, ads, x, p = requests(market, seed, args.impressions, args)
    return market, users, ads, x, p


def requests(market: Market, seed: int, n: int, args: argparse.Namespace) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng([seed, n])
    users = np.array([market.next_request().user for _ in range(n)])
    ads = rng.integers(args.ads, size=n)
    x = context(market.user_states(args.dim)[users], args.dim + 1)
    return users, ads, x, market.true_variant_pctrs(users, ads, "feed", 0)


def contextual_run(
    ads: np.ndarray, x: np.ndarray, p: np.ndarray, u: np.ndarray, args: argparse.Namespace, seed: int
) -> tuple[float, Any]:
    """Cumulative regret of the contextual policy, and its state at the end."""
    policy = VariantPolicy(noise=args.noise)
    state = empty_state(args.dim + 1)
    for a in range(args.ads):
        state = set_row(state, a, [f"v{i}" for i in range(args.variants)], policy.prior)
    rng, regret = np.random.default_rng([seed, 1]), 0.0
    for s in range(0, ads.shape[0], args.batch):
        sl = slice(s, s + args.batch)
        chosen, _ = select(state, ads[sl], x[sl], policy, rng)
        shown = p[sl][np.arange(chosen.shape[0]), chosen]
        regret += float((p[sl].max(axis=1) - shown).sum())
        state = update(state, ads[sl], x[sl], chosen, (u[sl] < shown).astype(np.float64))
    return regret, state


def bernoulli_ts_run(
    ads: np.ndarray, p: np.ndarray, u: np.ndarray, args: argparse.Namespace, seed: int
) -> float:
    """Cumulative regret of Bernoulli Thompson sampling per (ad, variant), Beta(1, 1) priors."""
    wins, losses = np.ones((args.ads, args.variants)), np.ones((args.ads, args.variants))
    rng, regret = np.random.default_rng([seed, 2]), 0.0
    for s in range(0, ads.shape[0], args.batch):
        sl = slice(s, s + args.batch)
        chosen = rng.beta(wins[ads[sl]], losses[ads[sl]]).argmax(axis=1)
        shown = p[sl][np.arange(chosen.shape[0]), chosen]
        regret += float((p[sl].max(axis=1) - shown).sum())
        clicked = u[sl] < shown
        np.add.at(wins, (ads[sl], chosen), clicked)
        np.add.at(losses, (ads[sl], chosen), ~clicked)
    return regret


def ope_errors(market: Market, state: Any, seed: int, args: argparse.Namespace) -> dict[str, float]:
    """Relative error of each estimator on uniform logs, for the final contextual policy."""
    _, ads, x, p = requests(market, seed + 10_000, args.log_size, args)
    rng = np.random.default_rng([seed, 3])
    logged = rng.integers(args.variants, size=ads.shape[0])
    rows = np.arange(ads.shape[0])
    reward = (rng.random(ads.shape[0]) < p[rows, logged]).astype(np.float64)
    pscore = np.full(ads.shape[0], 1.0 / args.variants)
    target = probabilities(state, ads, x, VariantPolicy(noise=args.noise, floor=0.0))
    truth = float((target * p).sum(axis=1).mean())
    q = np.clip(np.einsum("nvd,nd->nv", state.mean[ads], x), 0.0, 1.0)
    est = {
        "ips": ope.ips(reward, pscore, target[rows, logged]),
        "snips": ope.snips(reward, pscore, target[rows, logged]),
        "dr": ope.dr(reward, pscore, target[rows, logged], q[rows, logged], (target * q).sum(axis=1)),
    }
    out = {name: abs(e.value - truth) / truth for name, e in est.items()}
    out["truth"] = truth
    return out


def obd_comparison() -> dict[str, Any]:
    """adstream's IPS / SNIPS / DR against obp's on the Open Bandit Dataset (random → BTS)."""
    from obp.ope import DoublyRobust, InverseProbabilityWeighting, SelfNormalizedInverseProbabilityWeighting

    log = read_rows(obd_files("random", "all")[0])
    bts = read_rows(obd_files("bts", "all")[0])
    n_items = 1 + max(r.item_id for r in log + bts)
    action = np.array([r.item_id for r in log])
    position = np.array([r.position - 1 for r in log])
    reward = np.array([float(r.click) for r in log])
    pscore = np.array([r.propensity for r in log])
    counts = np.ones((n_items, 3))  # the BTS policy's item frequency per position (+1 smoothing)
    np.add.at(counts, ([r.item_id for r in bts], [r.position - 1 for r in bts]), 1.0)
    pi = counts / counts.sum(axis=0, keepdims=True)  # (items, positions)
    clicks, shows = np.full((n_items, 3), 0.5), np.full((n_items, 3), 100.0)
    np.add.at(clicks, (action, position), reward)
    np.add.at(shows, (action, position), 1.0)
    q = clicks / shows  # a reward model: smoothed CTR per item × position
    n = action.shape[0]
    action_dist = np.repeat(pi[None], n, axis=0)  # (n, items, positions)
    q_all = np.repeat(q[None], n, axis=0)
    target = pi[action, position]
    ours = {
        "ips": ope.ips(reward, pscore, target).value,
        "snips": ope.snips(reward, pscore, target).value,
        "dr": ope.dr(reward, pscore, target, q[action, position], (pi * q).sum(axis=0)[position]).value,
    }
    kw = {
        "reward": reward,
        "action": action,
        "position": position,
        "pscore": pscore,
        "action_dist": action_dist,
    }
    theirs = {
        "ips": InverseProbabilityWeighting().estimate_policy_value(**kw),
        "snips": SelfNormalizedInverseProbabilityWeighting().estimate_policy_value(**kw),
        "dr": DoublyRobust().estimate_policy_value(**kw, estimated_rewards_by_reg_model=q_all),
    }
    diffs = {k: abs(ours[k] - float(theirs[k])) for k in ours}
    return {
        "rounds": n,
        "adstream": ours,
        "obp": {k: float(v) for k, v in theirs.items()},
        "abs_diff": diffs,
        "max_abs_diff": max(diffs.values()),
        "bts_on_policy_ctr": float(np.mean([r.click for r in bts])),
    }


def selection_cpu(args: argparse.Namespace) -> dict[str, Any]:
    """CPU of one request's variant choice (k ads) against the replica's recorded CPU per request."""
    sel = VariantSelector(dim=args.dim, policy=VariantPolicy(noise=args.noise), seed=0)
    ids = [f"ad{i}" for i in range(args.k)]
    for ad in ids:
        sel.register(ad, [f"v{i}" for i in range(args.variants)])
    user = np.random.default_rng(0).normal(size=args.dim)
    calls = 2000
    t = time.process_time()
    for _ in range(calls):
        sel.choose(ids, user)
    per_request_ms = (time.process_time() - t) / calls * 1000
    out: dict[str, Any] = {
        "k": args.k,
        "variants": args.variants,
        "selection_cpu_ms_per_request": per_request_ms,
    }
    if SERVE.exists():
        serve = json.loads(SERVE.read_text())
        request_ms = serve.get("cpu_profile", {}).get("cpu_ms_per_request")
        if request_ms:
            out.update(
                request_cpu_ms=request_ms,
                request_cpu_source="benchmarks/results/serve.json cpu_profile "
                f"({serve['machine'].get('cpu')})",
                selection_cpu_share=per_request_ms / request_ms,
            )
    return out


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """Mean and its 95 % Student-t interval over seeds."""
    from scipy.stats import t

    a = np.asarray(values, dtype=np.float64)
    half = (
        float(t.ppf(0.975, a.shape[0] - 1) * a.std(ddof=1) / np.sqrt(a.shape[0]))
        if a.shape[0] > 1
        else np.inf
    )
    return float(a.mean()), float(a.mean() - half), float(a.mean() + half)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--impressions", type=int, default=90_000, help="per seed, for each policy")
    ap.add_argument("--ads", type=int, default=3)
    ap.add_argument("--variants", type=int, default=6)
    ap.add_argument("--effect-sd", type=float, default=1.2, help="per-segment variant effect sd (logit)")
    ap.add_argument("--bias", type=float, default=-3.0, help="click logit bias (CTR about 10 %%)")
    ap.add_argument("--dim", type=int, default=32, help="user state dimension")
    ap.add_argument("--noise", type=float, default=0.1, help="posterior scale of the contextual policy")
    ap.add_argument("--batch", type=int, default=200)
    ap.add_argument("--log-size", type=int, default=50_000, help="uniform-variant log per seed (OPE)")
    ap.add_argument("--k", type=int, default=4, help="ads with variants per request (selection CPU)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    return ap.parse_args()


def main() -> None:
    args, start, t0 = parse(), machine(), time.perf_counter()
    ratios: list[float] = []
    runs: list[dict[str, Any]] = []
    errors: dict[str, list[float]] = {name: [] for name in ESTIMATORS}
    for seed in range(args.seeds):
        market, _, ads, x, p = scenario(seed, args)
        draws = np.asarray(np.random.default_rng([seed, 4]).random(ads.shape[0]))
        lin, state = contextual_run(ads, x, p, draws, args, seed)
        bts = bernoulli_ts_run(ads, p, draws, args, seed)
        err = ope_errors(market, state, seed, args)
        ratios.append(lin / bts)
        runs.append({"seed": seed, "regret_contextual": lin, "regret_bernoulli_ts": bts, "ope": err})
        for name in ESTIMATORS:
            errors[name].append(err[name])
    ratio = mean_ci(ratios)
    result: dict[str, Any] = {
        "benchmark": "creatives",
        "machine": start,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "regret_ratio_to_bernoulli_ts": {"mean": ratio[0], "ci_low": ratio[1], "ci_high": ratio[2]},
        "ope_relative_error": {
            n: {"mean": float(np.mean(e)), "max": float(np.max(e))} for n, e in errors.items()
        },
        "obd": obd_comparison(),
        "runs": runs,
        "goal": "regret ratio <= 0.5 (ci_high); OPE error <= 10 %; OBD equal to obp (float tolerance)",
    }
    result["obd_max_abs_diff_to_obp"] = result["obd"]["max_abs_diff"]
    cpu = selection_cpu(args)
    result["selection"] = cpu
    result["selection_cpu_share"] = cpu.get("selection_cpu_share")
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    write_result(args.out, result)
    table = Table("figure", "value")
    table.add_row(
        "regret ratio to Bernoulli TS (mean [95 % CI])", f"{ratio[0]:.3f} [{ratio[1]:.3f}, {ratio[2]:.3f}]"
    )
    for name, e in result["ope_relative_error"].items():
        table.add_row(f"OPE relative error {name} (mean / max)", f"{e['mean']:.2%} / {e['max']:.2%}")
    table.add_row("OBD max |adstream − obp|", f"{result['obd_max_abs_diff_to_obp']:.2e}")
    table.add_row(
        "selection CPU per request (ms) / share",
        f"{cpu['selection_cpu_ms_per_request']:.3f} / {result['selection_cpu_share']}",
    )
    Console().print(table)


if __name__ == "__main__":
    main()
