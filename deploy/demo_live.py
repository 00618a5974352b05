"""What `adstream demo` watches while the loop runs, and the report it writes at the end.

`Watch` samples the running loop once a second: the closed loop's own counters (requests,
events, client-side latency), the served model's AUC and the oracle's on the latest served
impressions, the trainer's progressive AUC of the online (LoRA) and the frozen base model on
the same labelled stream, and the adapter versions the ad server answers with. `write_report`
turns the samples into report.json, report.md and PNG plots.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from rich.table import Table

from schemas.stats import auc
from workloads.closed_loop import ClosedLoopReport
from workloads.market import Market

WINDOW = 2000  # impressions in a served-AUC window
# the AUC series of every sample that the report summarises before the drift and at the end
QUALITY_SERIES = ("online_auc", "base_auc", "served_auc", "oracle_auc", "population_auc")


@dataclass
class Sample:
    """One second of the loop."""

    t_s: float
    requests: int
    events: int
    impressions: int
    p99_ms: float
    served_auc: float
    oracle_auc: float
    population_auc: float
    online_auc: float
    base_auc: float
    examples: float
    adapters: dict[str, str]
    drifted: bool
    resets: float = math.nan  # the trainer's guard resets so far (all adapters)


@dataclass
class Watch:
    """Samples the loop; `table()` renders the latest sample for the terminal."""

    market: Market
    report: ClosedLoopReport
    serve_url: str
    trainer_metrics_url: str
    admin_headers: dict[str, str] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)
    samples: list[Sample] = field(default_factory=list)
    # per served impression: the score of an oracle that knows all but the user's taste
    population: list[float] = field(default_factory=list)

    async def sample(self, http: httpx.AsyncClient) -> Sample:
        scores, labels = self.market.outcomes()
        imps = self.report.impressions
        n = min(len(imps), len(labels))
        lo = max(0, n - WINDOW)
        served = np.array([imps[i].pctr or 0.0 for i in range(lo, n)], dtype=np.float64)
        self.population.extend(
            self.market.population_pctr(i.ad_id, i.slot, i.position) for i in imps[len(self.population) : n]
        )
        pop = np.array(self.population[lo:n], dtype=np.float64)
        lat = self.report.latencies_ms[-200:]
        trainer = await _scrape(http, self.trainer_metrics_url)
        s = Sample(
            t_s=time.monotonic() - self.t0,
            requests=self.report.requests,
            events=sum(self.report.events.values()),
            impressions=n,
            p99_ms=float(np.percentile(lat, 99)) if lat else math.nan,
            served_auc=auc(served, labels[lo:n]) if n > lo else math.nan,
            oracle_auc=auc(scores[lo:n], labels[lo:n]) if n > lo else math.nan,
            population_auc=auc(pop, labels[lo:n]) if n > lo else math.nan,
            online_auc=_mean_auc(trainer, "online"),
            base_auc=_mean_auc(trainer, "base"),
            examples=trainer.get(("adstream_trainers_examples_total", ()), math.nan),
            adapters=await _adapters(http, self.serve_url, self.admin_headers),
            drifted=self.market.drift_ts is not None,
            resets=trainer.get(("adstream_trainers_adapter_resets_total", ()), math.nan),
        )
        self.samples.append(s)
        return s

    def table(self) -> Table:
        t = Table("loop", "now", title="adstream demo: the loop, live", min_width=60)
        if not self.samples:
            t.add_row("starting", "…")
            return t
        s = self.samples[-1]
        prev = self.samples[-6] if len(self.samples) > 5 else self.samples[0]
        dt = max(s.t_s - prev.t_s, 1e-9)
        t.add_row("time", f"{s.t_s:.0f} s" + ("  [yellow]interest drift happened[/]" if s.drifted else ""))
        t.add_row(
            "requests/s · events/s",
            f"{(s.requests - prev.requests) / dt:.1f} · {(s.events - prev.events) / dt:.1f}",
        )
        t.add_row("P99 latency (last 200 requests)", f"{s.p99_ms:.1f} ms")
        t.add_row("served impressions", f"{s.impressions:,}")
        t.add_row(
            f"served pCTR AUC (last {WINDOW})",
            f"{s.served_auc:.3f}  (oracle {s.oracle_auc:.3f}, without user taste {s.population_auc:.3f})",
        )
        on, off = smoothed(self.samples, "online_auc"), smoothed(self.samples, "base_auc")
        t.add_row(
            f"trainer AUC online vs frozen (mean of last {SMOOTH_S} s)",
            f"{on:.3f} vs {off:.3f}  ({'[green]' if on >= off else '[red]'}{on - off:+.3f}[/])",
        )
        t.add_row("guard resets (all adapters)", f"{s.resets:.0f}" if math.isfinite(s.resets) else "n/a")
        t.add_row("examples learned", f"{s.examples:,.0f}")
        t.add_row(
            "adapter versions", ", ".join(f"{k}={v}" for k, v in sorted(s.adapters.items())) or "none yet"
        )
        return t


async def _scrape(http: httpx.AsyncClient, url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    try:
        text = (await http.get(url, timeout=2)).text
    except httpx.HTTPError:
        return {}
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def _mean_auc(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], model: str) -> float:
    """The trainer's rolling AUC of `model` on the feed adapter (most of the traffic; the small
    slots' windows are too noisy to average in), or the mean over adapters when there is none."""
    by_adapter = {
        dict(labels).get("adapter", ""): v
        for (name, labels), v in metrics.items()
        if name == "adstream_trainers_rolling_auc" and dict(labels).get("model") == model and math.isfinite(v)
    }
    if "feed" in by_adapter:
        return by_adapter["feed"]
    return float(np.mean(list(by_adapter.values()))) if by_adapter else math.nan


async def _adapters(http: httpx.AsyncClient, url: str, headers: dict[str, str]) -> dict[str, str]:
    try:
        body = (await http.get(f"{url}/v1/adapters", headers=headers, timeout=2)).json()
    except (httpx.HTTPError, ValueError):
        return {}
    rows = body.get("adapters", body) if isinstance(body, dict) else body
    return {str(r.get("adapter_id")): str(r.get("version")) for r in rows if isinstance(r, dict)}


SMOOTH_S = 15  # seconds of samples the live table averages (one window's swings are noise)


def smoothed(samples: list[Sample], attr: str, last: int = SMOOTH_S) -> float:
    """Mean of a sampled figure over the last `last` samples (non-finite ones left out)."""
    xs = [x for x in (getattr(s, attr) for s in samples[-last:]) if math.isfinite(x)]
    return float(np.mean(xs)) if xs else math.nan


def phase_means(samples: list[Sample], attr: str) -> dict[str, float]:
    """Mean of a sampled figure over the last quarter before the drift and after it."""
    before = [getattr(s, attr) for s in samples if not s.drifted]
    after = [getattr(s, attr) for s in samples if s.drifted]

    def tail_mean(xs: list[float]) -> float:
        xs = [x for x in xs[-max(1, len(xs) // 4) :] if math.isfinite(x)]
        return float(np.mean(xs)) if xs else math.nan

    return {"before_drift": tail_mean(before), "end": tail_mean(after)}


def _ci(entry: dict[str, Any] | None, fmt: str) -> str:
    if not entry or "mean" not in entry:
        return f"n/a ({(entry or {}).get('error', 'not measured')})"
    lo, hi = fmt.format(entry["ci_low"]), fmt.format(entry["ci_high"])
    return f"{fmt.format(entry['mean'])} (95 % interval {lo} … {hi})"


def live_rows(live: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The A/B and learning figures of a run (`deploy.live_figures.loop_figures`), one row each."""
    if not live:
        return [("live figures", "not measured")]
    cost = live.get("exploration_ctr_cost", {})
    rate = live.get("resets_per_adapter_hour")
    resets = f"{live.get('resets', 0)} ({rate:.1f} per adapter-hour)" if rate is not None else "n/a"
    auc_after = _ci(live.get("auc_online_minus_frozen_after"), "{:+.4f}")
    return [
        ("CTR lift, learning over control, before the drift", _ci(live.get("ctr_lift_before"), "{:+.1%}")),
        ("CTR lift, learning over control, after the drift", _ci(live.get("ctr_lift_after"), "{:+.1%}")),
        ("CTR lift, learning over correction-only, after", _ci(live.get("adapter_lift_after"), "{:+.1%}")),
        ("adapters on the same requests: expected clicks over the slate without them, after",
         _ci(live.get("adapter_lift_after_shadow"), "{:+.1%}")),
        ("online − frozen AUC after the drift (paired)", auc_after),
        ("guard resets", resets),
        ("exploration: CTR of explored vs greedy slots",
         _ci(cost.get("relative_cost"), "{:.1%}") + " lower" if "relative_cost" in cost
         else cost.get("error", "n/a")),
    ]  # fmt: skip


def plot_curves(curves: list[dict[str, float]], out: Path) -> list[str]:
    """Online vs frozen AUC over sliding windows of scored impressions, with their 95 % bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [c["end"] for c in curves]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, label in (("online", "online LoRA"), ("frozen", "frozen base")):
        ax.plot(x, [c[name] for c in curves], label=f"{label} (same impressions)")
        ax.fill_between(x, [c[f"{name}_lo"] for c in curves], [c[f"{name}_hi"] for c in curves], alpha=0.2)
    drift = next((c["end"] for c in curves if c["after_drift"]), None)
    if drift is not None:
        ax.axvline(drift, color="grey", linestyle="--", label="interest drift (first window after)")
    ax.set_xlabel("served impressions")
    ax.set_ylabel("AUC against the simulated clicks")
    ax.legend(loc="lower left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "auc_smoothed.png", dpi=110)
    plt.close(fig)
    return ["auc_smoothed.png"]


def plot(samples: list[Sample], out: Path) -> list[str]:
    """PNG plots of the run: AUC over time and latency; returns the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t_s for s in samples]
    drift_t = next((s.t_s for s in samples if s.drifted), None)
    names = []
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for attr, label in (
        ("online_auc", "online LoRA (trainer, progressive, feed)"),
        ("base_auc", "frozen base (trainer, progressive, feed)"),
        ("served_auc", f"served pCTR (last {WINDOW} impressions)"),
        ("oracle_auc", "oracle (true model, same impressions)"),
    ):
        ax.plot(t, [getattr(s, attr) for s in samples], label=label)
    if drift_t is not None:
        ax.axvline(drift_t, color="grey", linestyle="--", label="interest drift")
    ax.set_xlabel("seconds into the closed loop")
    ax.set_ylabel("AUC")
    ax.legend(loc="lower left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "auc_over_time.png", dpi=110)
    names.append("auc_over_time.png")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.plot(t, [s.p99_ms for s in samples], label="P99 of the last 200 requests (client side)")
    ax.set_xlabel("seconds into the closed loop")
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "latency.png", dpi=110)
    names.append("latency.png")
    plt.close(fig)
    return names


def write_report(out: Path, report: dict[str, Any], samples: list[Sample]) -> None:
    """report.json (figures and every sample), report.md (the story) and the plots."""
    report["plots"] = plot(samples, out) if samples else []
    curves = (report.get("live") or {}).get("curves")
    if curves:
        report["plots"] = plot_curves(curves, out) + report["plots"]
    report["samples"] = [asdict(s) for s in samples]
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "report.md").write_text(markdown(report))


def _f(x: object) -> str:
    return f"{x:.3f}" if isinstance(x, float) and math.isfinite(x) else "n/a"


def markdown(r: dict[str, Any]) -> str:
    """The human-readable report."""
    q = r["quality"]
    lines = [
        f"# adstream demo — {r['started']}",
        "",
        f"Machine: {r['machine']}. Market seed {r['spec']['seed']}: {r['spec']['users']} users, "
        f"{r['spec']['ads']} ads; {r['spec']['history']:,} impressions of history, then "
        f"{r['loop']['requests']:,} closed-loop requests at {r['spec']['rate']:g}/s with a "
        f"`{r['spec']['drift_mode']}` interest drift half-way.",
        "",
        "## What learning earned (A/B arms, bootstrap over users; paired AUC on the same impressions)",
        "",
        "| figure | this run |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in live_rows(r.get("live"))],
        "",
        "## Learning: online vs frozen (trainer's rolling windows)",
        "",
        "| AUC | before the drift | at the end |",
        "|---|---|---|",
    ]
    for key, label in (
        ("online_auc", "online LoRA (trainer's progressive validation)"),
        ("base_auc", "frozen base (same examples)"),
        ("served_auc", "served pCTR on served impressions"),
        ("oracle_auc", "oracle on the same impressions"),
        ("population_auc", "oracle without the user's taste (same impressions)"),
    ):
        lines.append(f"| {label} | {_f(q[key]['before_drift'])} | {_f(q[key]['end'])} |")
    lines += [
        "",
        f"Offline holdout AUC of the base ranker: {_f(r['offline']['holdout_auc'])} "
        f"(time-ordered holdout of the history; oracle on the history {_f(r['offline']['oracle_auc'])}).",
        "",
        "### Why the served AUC differs from the offline one",
        "",
        *[f"- {line}" for line in r["explanation"]],
        "",
        "## Serving",
        "",
        f"- {r['loop']['requests']:,} requests, {r['loop']['served']:,} ads served, errors: "
        f"{r['loop']['errors'] or 'none'}; client-side latency P50 {_f(r['loop']['p50_ms'])} ms, "
        f"P99 {_f(r['loop']['p99_ms'])} ms.",
        f"- adapter versions at the end: {r['adapters_end'] or 'none'}",
        f"- ClickHouse rows: {r['clickhouse']}",
        "",
    ]
    if r.get("freshness"):
        fr = r["freshness"]
        lines += [
            "## Freshness (click → served by an adapter that learned it)",
            "",
            f"P50 {_f(fr.get('p50_s'))} s, P99 {_f(fr.get('p99_s'))} s over {fr.get('trials')} trials.",
            "",
        ]
    if r.get("attribution"):
        lines += [
            "## Attribution (model comparison on the loop's events)",
            "",
            "```",
            r["attribution"],
            "```",
            "",
        ]
    lines += ["## Plots", "", *[f"![{p}]({p})" for p in r.get("plots", [])], ""]
    return "\n".join(lines)
