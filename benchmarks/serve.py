"""End-to-end latency of `POST /v1/ads` under a fixed request rate, driven by wrk.

Setup: a 10,000-ad catalog from `adstream simulate`, the ranker checkpoint under
`settings.model_dir` (or a seeded untrained one of the same shape: same compute), warm users
in Redis (streams' record format) for half of the user pool, the app deployed by
`adstream serve`'s own code path (`deploy.cli_serving.start`) on a local Ray cluster.
Load: wrk with `benchmarks/serve_load.lua` (random users and slots, k = 10, each connection
paced so that all of them together send RATE requests/s).

    .venv/bin/python benchmarks/serve.py --rates 50,100 --duration 20
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")


def make_catalog(path: Path, ads: int) -> None:
    cmd = [
        str(ROOT / ".venv/bin/adstream"),
        "simulate",
        "--ads",
        str(ads),
        "--impressions",
        "10",
        "--advertisers",
        "300",
        "--categories",
        "40",
        "--new-ads",
        "0",
        "--out",
        str(path),
    ]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)


def make_model(model_dir: Path, settings_model_dir: Path) -> str:
    from serving.ranking import find_checkpoint

    found = find_checkpoint(settings_model_dir)
    if found is not None:
        shutil.copytree(found, model_dir / "ranker")
        return f"trained checkpoint from {found}"
    import torch

    from trainers.ranker import Ranker, RankerConfig, save_checkpoint

    torch.manual_seed(0)
    save_checkpoint(Ranker(RankerConfig()), model_dir / "ranker")
    return "seeded untrained ranker (default RankerConfig)"


def warm_users(settings: object, users: int, catalog: Path) -> None:
    """Half of the user pool gets a state record: a vector near one category and its intent."""
    import numpy as np
    import redis

    from schemas.vectors import content_vector
    from streams.record import encode_state, user_key
    from streams.state import UserState

    cats = sorted({json.loads(line)["category"] for line in catalog.open() if '"kind":"ad"' in line})
    r = redis.Redis.from_url(settings.redis_url)  # type: ignore[attr-defined]
    pipe = r.pipeline(transaction=False)
    now = time.time()
    for i in range(1, users + 1, 2):
        cat = cats[i % len(cats)]
        vec = np.asarray(content_vector(cat, cat, settings.state_dim), dtype=np.float32)  # type: ignore[attr-defined]
        st = UserState(
            user_id=f"u{i}",
            dim=vec.shape[0],
            vector=vec,
            intents={cat: 2.0},
            last_ts=now,
            session_start_ts=now,
        )
        pipe.set(user_key(settings.redis_prefix, f"u{i}"), encode_state(st), ex=3600)  # type: ignore[attr-defined]
    pipe.execute()


def write_adapters(settings: object, model_dir: Path, catalog: Path) -> int:
    """Store a full snapshot for every adapter of the scheme in Redis, as the online trainer does."""
    import redis
    import torch

    from schemas import codec
    from schemas.ids import adapter_id_for
    from trainers.delta import AdapterState, empty_state, full_parts, make_delta
    from trainers.lora import target_shapes
    from trainers.ranker import load_checkpoint
    from trainers.snapshots import snapshot_key

    model, version = load_checkpoint(model_dir / "ranker")
    s = settings
    shapes = target_shapes(model, s.lora_targets)  # type: ignore[attr-defined]
    advertisers = sorted(
        {json.loads(line)["advertiser_id"] for line in catalog.open() if '"kind":"ad"' in line}
    )
    ids = sorted(
        {
            adapter_id_for(slot, adv, s.adapter_scheme)  # type: ignore[attr-defined]
            for slot in ("feed", "search", "splash")
            for adv in advertisers
        }
    )
    r = redis.Redis.from_url(s.redis_url)  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(0)
    for aid in ids:
        st = empty_state(aid, version, shapes, s.lora_rank)  # type: ignore[attr-defined]
        tensors = {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in st.tensors.items()}
        st = AdapterState(aid, version, st.rank, 0, tensors)
        snap = make_delta(st, full_parts(tensors, st.rank), 0, snapshot=True)
        r.set(snapshot_key(s.redis_prefix, aid), codec.encode(snap))  # type: ignore[attr-defined]
    return len(ids)


def summarize(runs: list[dict[str, float]]) -> dict[str, float]:
    """One row from repeated runs at a rate: the run with the median p99 (the machine is shared, so
    single runs swing), plus every run's p99 and the errors over all runs."""
    ordered = sorted(runs, key=lambda r: r["p99_ms"])
    row = dict(ordered[len(ordered) // 2])
    requests = sum(r["requests"] for r in runs)
    errors = sum(r["errors"] for r in runs)
    row.update(
        {
            "runs": len(runs),
            "p99_ms_runs": [r["p99_ms"] for r in runs],
            "requests_all_runs": requests,
            "errors_all_runs": errors,
            "error_rate": round(errors / max(requests, 1), 5),
        }
    )
    return row


def run_wrk(url: str, rate: int, duration: int, conns: int, users: int) -> dict[str, float]:
    if shutil.which("wrk") is None:
        raise SystemExit("benchmarks need the HTTP load tool wrk: apt-get install wrk")
    env = {**os.environ, "RATE": str(rate), "CONNS": str(conns), "USERS": str(users), "K": "10"}
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{conns}",
            f"-d{duration}s",
            "--timeout",
            "2s",
            "-s",
            str(ROOT / "benchmarks/serve_load.lua"),
            url,
        ],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout
    res = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    errors = res["err_connect"] + res["err_read"] + res["err_write"] + res["err_status"] + res["err_timeout"]
    return {
        "target_rps": rate,
        "rps": round(res["requests"] / (res["duration_us"] / 1e6), 1),
        "requests": res["requests"],
        "p50_ms": round(res["p50_us"] / 1000, 2),
        "p90_ms": round(res["p90_us"] / 1000, 2),
        "p99_ms": round(res["p99_us"] / 1000, 2),
        "max_ms": round(res["max_us"] / 1000, 2),
        "errors": errors,
        "error_rate": round(errors / max(res["requests"], 1), 5),
    }


# -- load-balanced ingress (issue 13): each case in its own process, so Serve's env-read
# constants (RAY_SERVE_ENABLE_HA_PROXY) start fresh with a fresh local Ray cluster
LB_CASES = {
    # name: (replicas, extra environment, which URL)
    "direct_1": (1, {}, "replica"),
    "haproxy_2": (2, {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_NBTHREAD": "1"}, "proxy"),
    "serve_proxy_2": (2, {"RAY_SERVE_ENABLE_HA_PROXY": "0"}, "proxy"),
}


def lb_case(
    case: str, model_dir: Path, catalog: Path, port: int, args: argparse.Namespace
) -> dict[str, object]:
    """Deploy `case` (Ray started again up to 3 times: on a busy CPU its raylet may miss Ray's
    fixed 30 s registration window), then capacity (paced far above it) and P99 at 100 req/s."""
    import httpx
    import ray
    from ray import serve

    from deploy.cli_serving import start
    from schemas.settings import Settings

    replicas, env, which = LB_CASES[case]
    os.environ.update(env)
    settings = Settings(
        model_dir=model_dir,
        serve_catalog_file=catalog,
        http_port=port,
        serve_replicas=replicas,
        serve_consume_deltas=False,
        topic_prefix=f"benchlb{port}.",
        redis_prefix=f"adstream-bench-lb:{port}:",
    )
    for attempt in range(3):
        try:
            endpoints = start(settings, name="benchlb")
            break
        except Exception as exc:  # Ray's own start-up timeout on a loaded machine
            print(f"{case}: start failed ({exc}); attempt {attempt + 1} of 3", flush=True)
            ray.shutdown()
            if attempt == 2:
                raise
    try:
        url = endpoints.replicas[0] if which == "replica" else endpoints.proxy
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # every replica up behind the balancer
            try:
                if httpx.get(f"{url}/healthz", timeout=2).json().get("status") == "ok":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1)
        run_wrk(url, 50, 5, args.conns, args.users)  # warm-up
        capacity = run_wrk(url, 5000, args.duration, args.lb_capacity_conns, args.users)
        at_100 = summarize(
            [run_wrk(url, 100, args.duration, args.conns, args.users) for _ in range(args.repeats)]
        )
        return {
            "case": case,
            "replicas": replicas,
            "url": url,
            "env": env,
            "capacity": capacity,
            "at_100": at_100,
        }
    finally:
        serve.shutdown()
        ray.shutdown()
        import redis

        r = redis.Redis.from_url(settings.redis_url)
        keys = list(r.scan_iter(match=f"{settings.redis_prefix}*", count=1000))
        if keys:
            r.delete(*keys)


def load_balanced(args: argparse.Namespace, model_dir: Path, catalog: Path) -> dict[str, object]:
    """Every LB case, then the goal's ratios against one replica's direct port (same run)."""
    cases: dict[str, dict[str, object]] = {}
    for i, case in enumerate(args.lb_cases.split(",")):
        out = Path(tempfile.mkstemp(suffix=".json")[1])
        cmd = [
            sys.executable,
            __file__,
            "--lb-case",
            case,
            "--lb-out",
            str(out),
            "--port",
            str(args.port + 100 * i),
        ]
        cmd += [
            "--lb-model-dir",
            str(model_dir),
            "--lb-catalog",
            str(catalog),
            "--duration",
            str(args.duration),
        ]
        cmd += ["--repeats", str(args.repeats), "--conns", str(args.conns), "--users", str(args.users)]
        cmd += ["--lb-capacity-conns", str(args.lb_capacity_conns)]
        proc = subprocess.run(cmd, cwd=ROOT, timeout=900)
        if proc.returncode == 0:
            cases[case] = json.loads(out.read_text())
        else:
            cases[case] = {"case": case, "error": f"exit {proc.returncode}"}
        out.unlink(missing_ok=True)
    direct = cases.get("direct_1", {})
    best = None
    for name in ("haproxy_2", "serve_proxy_2"):
        c = cases.get(name, {})
        if "capacity" in c and "capacity" in direct:
            c["capacity_ratio_to_direct"] = round(c["capacity"]["rps"] / direct["capacity"]["rps"], 3)  # type: ignore[index]
            c["p99_ratio_to_direct_at_100"] = round(c["at_100"]["p99_ms"] / direct["at_100"]["p99_ms"], 3)  # type: ignore[index]
            if best is None or c["capacity_ratio_to_direct"] > cases[best]["capacity_ratio_to_direct"]:  # type: ignore[operator]
                best = name
    head = cases.get(best or "", {})
    return {
        "replicas": head.get("replicas"),
        "ingress": best,
        "capacity_ratio_to_direct": head.get("capacity_ratio_to_direct"),
        "p99_ratio_to_direct_at_100": head.get("p99_ratio_to_direct_at_100"),
        "goal": {"capacity_ratio_to_direct": 0.9, "p99_ratio_to_direct_at_100": 1.2},
        "load_average_start_end": [args.lb_load_start, round(os.getloadavg()[0], 2)],
        "cases": cases,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--load-balanced",
        action="store_true",
        help="only the load-balanced ingress cases (direct 1 replica, HAProxy 2, Serve proxy 2) → "
        "serve.json's `load_balanced`",
    )
    ap.add_argument("--lb-cases", default="direct_1,haproxy_2,serve_proxy_2")
    ap.add_argument("--lb-capacity-conns", type=int, default=32)
    ap.add_argument("--lb-case", help=argparse.SUPPRESS)
    ap.add_argument("--lb-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--lb-model-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--lb-catalog", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--ads", type=int, default=10_000)
    ap.add_argument("--rates", default="50,100")
    ap.add_argument("--duration", type=int, default=15)
    ap.add_argument(
        "--proxy-check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the top rate once through the Serve proxy (first scheme)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="runs per rate; the median-p99 run is reported")
    ap.add_argument("--conns", type=int, default=10)
    ap.add_argument("--users", type=int, default=5000)
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--schemes", default="slot,advertiser", help="adapter schemes to run (first one → rates)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/serve.json")
    args = ap.parse_args()
    if args.lb_case:  # a child of --load-balanced
        args.lb_out.write_text(
            json.dumps(lb_case(args.lb_case, args.lb_model_dir, args.lb_catalog, args.port, args))
        )
        return
    if args.load_balanced:
        from schemas.settings import Settings

        args.lb_load_start = round(os.getloadavg()[0], 2)
        tmp = Path(tempfile.mkdtemp(prefix="adstream-bench-lb-"))
        try:
            catalog = tmp / "catalog.jsonl"
            make_catalog(catalog, args.ads)
            make_model(tmp / "models", Settings().model_dir)
            result = load_balanced(args, tmp / "models", catalog)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(json.dumps({k: v for k, v in result.items() if k != "cases"}, indent=2))
        data = json.loads(args.out.read_text()) if args.out.exists() else {"benchmark": "serve"}
        data["load_balanced"] = result
        args.out.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {args.out} (load_balanced)")
        return

    import httpx
    import ray
    import redis
    from ray import serve
    from rich.console import Console
    from rich.table import Table

    from deploy.cli_serving import start
    from schemas.settings import Settings

    load_start = os.getloadavg()[0]  # the machine is shared: say how busy it was
    tmp = Path(tempfile.mkdtemp(prefix="adstream-bench-"))
    catalog = tmp / "catalog.jsonl"
    make_catalog(catalog, args.ads)
    model_note = make_model(tmp / "models", Settings().model_dir)
    by_scheme: dict[str, dict[str, object]] = {}
    try:
        for scheme in args.schemes.split(","):
            run = uuid.uuid4().hex[:8]
            settings = Settings(
                model_dir=tmp / "models",
                serve_catalog_file=catalog,
                http_port=args.port,
                topic_prefix=f"bench{run}.",
                redis_prefix=f"adstream-bench:{run}:",
                serve_consume_deltas=False,
                adapter_scheme=scheme,
                serve_adapter_capacity=4096,
            )
            warm_users(settings, args.users, catalog)
            n_adapters = write_adapters(settings, tmp / "models", catalog)
            t0 = time.monotonic()
            endpoints = start(settings, name="bench")
            url = endpoints.best
            client = httpx.Client(base_url=url, timeout=10)
            health = client.get("/healthz").json()
            print(f"{scheme}: deployed in {time.monotonic() - t0:.1f}s: {health}")
            rows = []
            try:
                run_wrk(url, 50, 5, args.conns, args.users)  # warm-up (connections, caches)
                for rate in [int(r) for r in args.rates.split(",")]:
                    runs = [
                        run_wrk(url, rate, args.duration, args.conns, args.users) for _ in range(args.repeats)
                    ]
                    rows.append(summarize(runs))
                proxy_row = None
                if args.proxy_check and not by_scheme and url != endpoints.proxy:
                    # the same load through Serve's proxy actor, for comparison (one run at the top rate)
                    top = max(int(r) for r in args.rates.split(","))
                    proxy_row = run_wrk(endpoints.proxy, top, args.duration, args.conns, args.users)
                metrics = client.get("/metrics").text
            finally:
                serve.shutdown()
                ray.shutdown()
                r = redis.Redis.from_url(settings.redis_url)
                keys = list(r.scan_iter(match=f"{settings.redis_prefix}*", count=1000))
                if keys:
                    r.delete(*keys)
            served_by = {
                line.split('"')[1]: float(line.split()[-1])
                for line in metrics.splitlines()
                if line.startswith("adstream_serving_served_by_total{")
            }
            by_scheme[scheme] = {
                "adapters": n_adapters,
                "served_by": served_by,
                "rates": rows,
                "url": "replica (direct ingress)" if url != endpoints.proxy else "Serve proxy",
                "catalog_ads": health["ads"],
                "device": health["device"],
                "via_proxy": proxy_row,
            }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    table = Table(
        "adapter scheme",
        "adapters",
        "target rps",
        "rps",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "max ms",
        "error rate",
    )
    for scheme, res in by_scheme.items():
        for row in res["rates"]:  # type: ignore[attr-defined]
            table.add_row(
                scheme,
                str(res["adapters"]),
                *(
                    str(row[k])
                    for k in ("target_rps", "rps", "p50_ms", "p90_ms", "p99_ms", "max_ms", "error_rate")
                ),
            )
    Console().print(table)
    first = next(iter(by_scheme.values()))
    result = {
        "benchmark": "serve",
        "catalog_ads": first["catalog_ads"],
        "k": 10,
        "url": first["url"],
        "load_tool": "wrk 4.1 + benchmarks/serve_load.lua (one thread, paced connections)",
        "connections": args.conns,
        "duration_s": args.duration,
        "model": model_note,
        "device": first["device"],
        "cpus": os.cpu_count(),
        "throughput_optimized": os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1",
        "load_average_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "adapter_scheme": next(iter(by_scheme)),
        "rates": first["rates"],
        "via_proxy": first["via_proxy"],
        "by_scheme": by_scheme,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
