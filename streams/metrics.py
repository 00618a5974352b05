"""Prometheus metrics of the streams worker (`adstream_streams_*`; never an id as a label)."""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

EVENTS_IN = Counter("adstream_streams_events_in_total", "Records consumed", ["topic"])
EVENTS_OUT = Counter("adstream_streams_events_out_total", "Records produced", ["topic"])
INVALID = Counter("adstream_streams_invalid_events_total", "Records dead-lettered", ["topic", "reason"])
SKIPPED = Counter(
    "adstream_streams_replayed_skipped_total", "Records at or below the applied offset (replay)"
)
JOIN = Counter("adstream_streams_join_events_total", "Label-join and state outcomes", ["outcome"])
LAG = Gauge("adstream_streams_lag_events", "High watermark minus next offset", ["topic"])
BATCH = Histogram(
    "adstream_streams_batch_size_events",
    "Records per committed batch",
    buckets=(1, 10, 50, 100, 500, 1000, 2500, 5000, 10000, 25000),
)
SINK_LATENCY = Histogram(
    "adstream_streams_sink_latency_seconds",
    "ClickHouse insert time per batch",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
COMMIT_LATENCY = Histogram(
    "adstream_streams_commit_latency_seconds",
    "Redis MULTI/EXEC time per batch",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)
RETRIES = Counter("adstream_streams_retries_total", "Failed writes retried", ["step"])
STATE_USERS = Gauge("adstream_streams_state_users", "User states cached by this worker")
PENDING = Gauge("adstream_streams_pending_impressions", "Impressions waiting for labels")
BUFFERED = Gauge("adstream_streams_merge_buffered_events", "Records waiting in the merge")
MERGE_FORCED = Counter(
    "adstream_streams_merge_forced_total",
    "Times the merge stopped waiting for an input partition that gave no answer (merge_max_idle_s)",
)
CORRUPT = Counter("adstream_streams_corrupt_user_records_total", "User records in Redis that did not decode")


def serve(port: int, host: str = "127.0.0.1") -> None:
    """Expose /metrics on `host:port` (0 = off; loopback unless `metrics.host` says otherwise);
    a busy port is logged, not fatal."""
    if port <= 0:
        return
    try:
        start_http_server(port, addr=host)
        log.info("metrics on %s:%d/metrics", host, port)
    except OSError as exc:
        log.warning("metrics port %d unavailable (%s); metrics not exposed", port, exc)
