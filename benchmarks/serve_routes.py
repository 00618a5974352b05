"""`POST /v1/events` and `POST /v1/rank` on one ad server replica (issue 34), beside the framework
floor and `/v1/ads` in the same run → `serve.json`'s `routes`.

- `floor`: the framework floor's capacity (`benchmarks.lib.floor`: a Serve endpoint that parses a
  request and answers; `benchmarks/serve.py`'s floor), requests/s.
- `ads`: the ad server's `/v1/ads` capacity in the same run (the reference for `/v1/rank`).
- `events`: batches of `--batch` valid clicks (each echoing the click token of an ad the server
  served in this run) to `/v1/events`, validated and produced to Kafka with acks=all before the
  answer: capacity in requests/s and events/s, each as a ratio to the floor's requests/s.
- `rank`: `/v1/rank` with `--candidates` catalog ids per request (k = 10), capacity and its
  ratio to `/v1/ads`'s (which ranks `recall.k` = 500 recalled candidates).

Capacity as `benchmarks/serve.py` measures it: the highest paced rate with P99 ≤ 50 ms, no errors
and ≥ 97 % delivered. Run: `python -m benchmarks.serve_routes [--quick]`.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.lib.args import int_at_least
from benchmarks.serve import ROOT, Route, capacity, make_catalog, make_model, scheme_settings, wait_ready
from deploy.machine import write_result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ads", type=int_at_least(10), default=10_000, help="catalog size")
    ap.add_argument("--batch", type=int_at_least(1), default=50, help="events per /v1/events request")
    ap.add_argument("--candidates", type=int_at_least(1), default=500, help="candidates per /v1/rank request")
    ap.add_argument("--served", type=int_at_least(1), default=300, help="/v1/ads calls whose ads get clicked")
    ap.add_argument("--duration", type=int_at_least(1), default=10, help="seconds per wrk run")
    ap.add_argument("--capacity-conns", type=int_at_least(1), default=32)
    ap.add_argument("--capacity-steps", type=int_at_least(1), default=5)
    ap.add_argument("--users", type=int_at_least(1), default=5000)
    ap.add_argument("--port", type=int_at_least(1), default=8311)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/serve.json")
    ap.add_argument("--quick", action="store_true", help="development: 5 s runs, 3 capacity steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.duration, args.capacity_steps = 5, 3
    return args


def click_bodies(url: str, args: argparse.Namespace, path: Path) -> int:
    """Serve `--served` real requests and write `/v1/events` bodies of `--batch` clicks on what
    they served (valid tokens, distinct ids within a batch: the collector accepts and produces
    every one). Returns the clicks."""
    import httpx

    from adstream_client import AdstreamClient, click_for

    clicks = []
    with AdstreamClient(url, timeout_s=30) as client:
        for i in range(args.served):
            user = f"routes-u{i}"
            resp = client.ads(user, slot=random.choice(["feed", "search", "splash"]), k=5)
            clicks += [
                click_for(resp, p, user).model_dump_json(exclude_none=True) for p in range(len(resp.ads))
            ]
    if len(clicks) < args.batch:
        raise SystemExit(
            f"the ad server served {len(clicks)} ads to click on; --batch {args.batch} needs more"
        )
    with path.open("w") as fh:
        for _ in range(200):
            fh.write('{"events":[' + ",".join(random.sample(clicks, args.batch)) + "]}\n")
    r = httpx.post(f"{url}/v1/events", content=path.read_text().splitlines()[0], timeout=30,
                   headers={"Content-Type": "application/json"})  # fmt: skip
    if r.status_code != 200 or r.json().get("accepted") != args.batch:
        raise SystemExit(f"a click batch was not accepted whole: {r.status_code} {r.text[:300]}")
    return len(clicks)


def rank_bodies(catalog: Path, args: argparse.Namespace, path: Path) -> None:
    rows = [json.loads(line) for line in catalog.read_text().splitlines() if line.strip()]
    ids = [r["ad_id"] for r in rows if r.get("kind", "ad") == "ad"]
    with path.open("w") as fh:
        for _ in range(200):
            body = {
                "user_id": f"u{random.randrange(args.users)}",
                "slot": random.choice(["feed", "search", "splash"]),
                "k": 10,
                "candidates": random.sample(ids, min(args.candidates, len(ids))),
            }
            fh.write(json.dumps(body) + "\n")


def measure(args: argparse.Namespace, tmp: Path, catalog: Path) -> dict[str, Any]:
    """The floor, then the ad server's three routes, in one Ray cluster."""
    from ray import serve

    from benchmarks.lib.floor import FLOOR_VERSION, build_floor_app
    from deploy.cli_serving import start
    from deploy.stack import create_topics
    from schemas.settings import Settings

    base = scheme_settings(args, tmp, catalog, "slot")
    # the route's capacity, not the per-key limiter's (200 events/s by default): one client here
    limits = {"rate_per_s": 1e9, "burst": 1_000_000_000}
    settings = Settings(**{**base.model_dump(), "collector": {**base.collector.model_dump(), **limits}})
    create_topics(settings)
    out: dict[str, Any] = {}
    url = start(settings, name="floor", app=build_floor_app(settings, False)).best
    try:
        wait_ready(url, FLOOR_VERSION)
        out["floor"] = capacity(url, args)
    finally:
        serve.delete("floor")
        time.sleep(3)
    url = start(settings, name="routes").best
    try:
        wait_ready(url)
        out["ads"] = capacity(url, args)
        clicks_file, rank_file = tmp / "clicks.jsonl", tmp / "rank.jsonl"
        out["clicks_pool"] = click_bodies(url, args, clicks_file)
        out["events"] = capacity(url, args, route=Route("/v1/events", clicks_file))
        rank_bodies(catalog, args, rank_file)
        out["rank"] = capacity(url, args, route=Route("/v1/rank", rank_file))
    finally:
        serve.delete("routes")
    return out


def summary(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    floor = raw["floor"]["capacity_rps"] or None
    ads = raw["ads"]["capacity_rps"] or None
    ev, rk = raw["events"]["capacity_rps"], raw["rank"]["capacity_rps"]
    return {
        "batch": args.batch,
        "candidates": args.candidates,
        "floor_capacity_rps": floor,
        "ads_capacity_rps": ads,
        "events": {
            "capacity_rps": ev,
            "events_per_s": ev * args.batch,
            "ratio_to_floor_rps": round(ev / floor, 3) if floor else None,
            "events_per_s_over_floor_rps": round(ev * args.batch / floor, 2) if floor else None,
        },
        "rank": {
            "capacity_rps": rk,
            "ratio_to_ads": round(rk / ads, 3) if ads else None,
            "ratio_to_floor": round(rk / floor, 3) if floor else None,
        },
        "runs": raw,
    }


def main(argv: Sequence[str] | None = None) -> None:
    from schemas.settings import Settings

    args = parse_args(argv)
    random.seed(0)
    tmp = Path(tempfile.mkdtemp(prefix="adstream-bench-routes-"))
    try:
        catalog = tmp / "catalog.jsonl"
        make_catalog(catalog, args.ads)
        make_model(tmp / "models", Settings().model_dir)
        result = summary(measure(args, tmp, catalog), args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    write_result(args.out, result, section="routes", argv=[sys.argv[0], *(argv or sys.argv[1:])])
    print(f"wrote {args.out} (routes)")


if __name__ == "__main__":
    main()
