"""Prometheus metrics of the online trainer (`adstream_trainers_*`).

Per-adapter rolling quality is exported with an `adapter` label only for the slot scheme, and
only for adapters named after a configured slot (`slots.names`, a bounded set: an `adapter_id`
on `ad.training-examples` is whatever its producer wrote, so ids never become labels) while the
trainer holds them; advertiser adapters would put ids into labels, so for every scheme the worst
and mean rolling AUC over adapters are exported without labels.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from schemas.events import SLOTS
from schemas.stats import paired_auc_difference
from trainers.online import AdapterRun

EXAMPLES = Counter("adstream_trainers_examples_total", "Training examples learned")
INVALID = Counter("adstream_trainers_invalid_examples_total", "Records that failed validation", ["reason"])
SKIPPED = Counter("adstream_trainers_skipped_examples_total", "Records already learned before a restart")
DUPLICATES = Counter(
    "adstream_trainers_duplicate_examples_total", "Re-delivered examples (an event_id already taken) skipped"
)
DELTAS = Counter("adstream_trainers_deltas_total", "AdapterDelta messages published", ["kind"])
DELTA_BYTES = Histogram(
    "adstream_trainers_delta_bytes",
    "Payload size of published deltas",
    buckets=(256, 1024, 4096, 16384, 65536, 262144),
)
DROPPED = Counter("adstream_trainers_dropped_updates_total", "Updates dropped by a guard", ["reason"])
RESETS = Counter("adstream_trainers_adapter_resets_total", "Adapters reset for falling below the base")
EVICTIONS = Counter(
    "adstream_trainers_adapter_evictions_total",
    "Least recently used adapters evicted past trainer_max_adapters (their snapshot stored in Redis)",
)
STEP = Histogram(
    "adstream_trainers_step_seconds",
    "Time of one micro-batch (score, learn, sparsify)",
    buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
)
SNAPSHOT = Histogram("adstream_trainers_snapshot_seconds", "Time to snapshot all adapters to Redis")
REDIS_ERRORS = Counter(
    "adstream_trainers_redis_errors_total",
    "Redis errors by operation (reserve, write, read, offsets) and outcome (retried, gave_up)",
    ["op", "outcome"],
)
REFUSED = Counter(
    "adstream_trainers_refused_snapshots_total",
    "Adapter states serving would refuse: not published (publish), not resumed (restore, rollback)",
    ["stage", "reason"],
)
ROLLBACKS = Counter(
    "adstream_trainers_adapter_rollbacks_total",
    "Adapters put back after a refused state, to their last Redis snapshot or to zero (the base)",
    ["to"],
)
EPOCHS = Counter(
    "adstream_trainers_new_epochs_total",
    "Adapters that went on in a new epoch because Redis had lost their seq record",
)
ADAPTERS = Gauge("adstream_trainers_adapters", "Adapters owned by this trainer")
HELD = Gauge("adstream_trainers_held_examples", "Examples waiting for their attribution window to close")
AUC = Gauge("adstream_trainers_rolling_auc", "Rolling progressive AUC per slot adapter", ["adapter", "model"])
LOGLOSS = Gauge(
    "adstream_trainers_rolling_logloss", "Rolling progressive log loss per slot adapter", ["adapter", "model"]
)
AUC_MIN = Gauge("adstream_trainers_rolling_auc_min", "Lowest rolling online AUC over adapters")
AUC_MEAN = Gauge("adstream_trainers_rolling_auc_mean", "Mean rolling online AUC over adapters")
AUC_GAIN = Gauge("adstream_trainers_rolling_auc_gain_mean", "Mean rolling AUC of online minus base")
PAIRED = Gauge(
    "adstream_trainers_rolling_auc_gain",
    "Online minus frozen-base AUC on the same examples per slot adapter (paired, DeLong): the "
    "difference and its standard error (`stat`: diff, se)",
    ["adapter", "stat"],
)


def serve(port: int, host: str = "127.0.0.1") -> None:
    """Expose /metrics on `host:port` (0 = off); loopback unless told otherwise (`metrics.host`)."""
    if port:
        start_http_server(port, addr=host)


_labelled: set[str] = set()  # the adapter label values `export` set last


def export(runs: Mapping[str, AdapterRun], per_adapter_labels: bool, slots: Collection[str] = SLOTS) -> None:
    """Refresh the rolling-quality gauges from the trainer's runs (`slots`: the configured ones,
    the only adapter ids that become labels)."""
    ADAPTERS.set(len(runs))
    labelled = {aid for aid in runs if aid in slots} if per_adapter_labels else set()
    for aid in _labelled - labelled:  # evicted or moved away: its last figures are not current
        for model in ("online", "base"):
            AUC.remove(aid, model)
            LOGLOSS.remove(aid, model)
        for stat in ("diff", "se"):
            PAIRED.remove(aid, stat)
    _labelled.clear()
    _labelled.update(labelled)
    aucs, gains = [], []
    for aid, run in runs.items():
        on, base = run.online.auc(), run.base.auc()
        if aid in labelled:
            AUC.labels(aid, "online").set(on)
            AUC.labels(aid, "base").set(base)
            LOGLOSS.labels(aid, "online").set(run.online.logloss())
            LOGLOSS.labels(aid, "base").set(run.base.logloss())
            (p_on, y), (p_base, _) = run.online.pairs(), run.base.pairs()
            diff, se = paired_auc_difference(p_on, p_base, y)
            PAIRED.labels(aid, "diff").set(diff)
            PAIRED.labels(aid, "se").set(se)
        if not math.isnan(on):
            aucs.append(on)
            if not math.isnan(base):
                gains.append(on - base)
    AUC_MIN.set(min(aucs) if aucs else math.nan)
    AUC_MEAN.set(sum(aucs) / len(aucs) if aucs else math.nan)
    AUC_GAIN.set(sum(gains) / len(gains) if gains else math.nan)


def count_trainer(before: Mapping[str, int], after: Mapping[str, int]) -> None:
    """Turn the trainer's counter deltas (dropped_*, resets) into Prometheus increments."""
    for key, value in after.items():
        inc = value - before.get(key, 0)
        if inc <= 0:
            continue
        if key.startswith("dropped_"):
            DROPPED.labels(key.removeprefix("dropped_")).inc(inc)
        elif key == "resets":
            RESETS.inc(inc)
