"""Micro-benchmark: what signed events (M10) cost the streams worker and the serving replica.

Per record, on simulator events (10,000 by default, best of 5 runs of `timeit`):

- `decode`: the worker's batch decoder (`schemas.decode.BatchDecoder`) alone, per record, for scale;
- `verify`: `schemas.signing.check_event` on the decoded event (impression: HMAC-SHA256 over
  `impression_bytes`; click / dwell: the 16-byte click token), what `Pipeline._judge` adds;
- `sign`: what a replica adds per served ad (`sign_impression` + `click_token`).

Usage: `.venv/bin/python -m benchmarks.signing [--records 10000]`. Prints a table and writes
`benchmarks/results/signing.json`. Timing figures: run it alone (under the CPU lock here).
"""

from __future__ import annotations

import argparse
import functools
import platform
import timeit
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from schemas.codec import encode
from schemas.decode import BatchDecoder
from schemas.events import Click, Dwell, Impression, Message
from schemas.signing import check_event, click_token, seal, sign_impression
from workloads import Market, MarketConfig

RESULTS = Path(__file__).resolve().parent / "results" / "signing.json"
KEY = b"b" * 32


def events(n: int, seed: int) -> dict[type[Message], list[Message]]:
    """About `n` signed impressions, and the clicks and dwells of a larger stream, by model."""
    market = Market(MarketConfig(seed=seed, n_users=5000, n_ads=500, bias=0.5), signing_key=KEY)
    out: dict[type[Message], list[Message]] = {Impression: [], Click: [], Dwell: []}
    for e in market.open_loop(n):
        if type(e) in out:
            out[type(e)].append(e)
    return out


def per_record_us(fn: Any, items: list[Any], repeat: int = 5) -> float:
    """Best of `repeat` runs of `fn` over every item, µs per item."""
    best = min(timeit.repeat(lambda: [fn(x) for x in items], number=1, repeat=repeat))
    return best / max(1, len(items)) * 1e6


def measure(n: int, seed: int) -> list[dict[str, Any]]:
    rows = []
    for model, items in events(n, seed).items():
        raws = [encode(e) for e in items]
        fast = BatchDecoder(model)
        decoded = fast.fast(raws)
        assert all(d is not None and check_event(d, KEY) is None for d in decoded)
        # one batch, as the worker decodes a fetch
        best = min(timeit.repeat(functools.partial(fast.fast, raws), number=1, repeat=5))
        row: dict[str, Any] = {
            "event": model.__name__,
            "records": len(items),
            "decode_us": best / max(1, len(raws)) * 1e6,
            # bound without a Python frame of its own (a lambda added ~1-2 %)
            "verify_us": per_record_us(functools.partial(check_event, key=KEY), decoded),
        }
        row["verify_share_of_decode"] = row["verify_us"] / row["decode_us"]
        if model is Impression:
            plain = [seal(e, KEY).model_copy(update={"sig": None}) for e in items]
            row["sign_us"] = per_record_us(
                lambda e: (sign_impression(e, KEY), click_token(KEY, e.event_id, e.user_id, e.ad_id)), plain
            )
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=10_000, help="impressions to simulate")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from deploy.machine import machine, write_result

    start = machine()
    rows = measure(args.records, args.seed)
    table = Table("event", "records", "decode µs", "verify µs", "verify / decode", "sign µs (replica)")
    for r in rows:
        sign = f"{r['sign_us']:.2f}" if "sign_us" in r else "—"
        table.add_row(
            r["event"], f"{r['records']:,}", f"{r['decode_us']:.2f}", f"{r['verify_us']:.2f}",
            f"{r['verify_share_of_decode']:.0%}", sign,
        )  # fmt: skip
    Console().print(table)
    out = {
        "benchmark": "signing",
        "machine": start,
        "python": platform.python_version(),
        # the headline `adstream bench table` shows: µs per record, verify in the worker, sign in a replica
        "figures": {
            **{f"{r['event'].lower()}_verify_us": round(r["verify_us"], 2) for r in rows},
            **{f"{r['event'].lower()}_sign_us": round(r["sign_us"], 2) for r in rows if "sign_us" in r},
        },
        "rows": rows,
    }
    write_result(RESULTS, out)


if __name__ == "__main__":
    main()
