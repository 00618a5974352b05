"""Prometheus metrics of a serving replica (`adstream_serving_*`; never an id as a label)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ServingMetrics:
    """One registry per replica, exposed at `GET /metrics`. The per-request series keep their
    label children (`labels()` is a lock and a dict lookup per call)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self._qos_children: dict[str, tuple[Any, Any, Any]] = {}
        self._parts: dict[str, Any] = {}
        buckets = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.035, 0.05, 0.1, 0.25, 1.0)
        self.requests = Counter(
            "adstream_serving_requests_total", "Ad requests by HTTP status", ["status"], registry=r
        )
        self.latency = Histogram(
            "adstream_serving_request_latency_seconds",
            "Ad request latency in the replica",
            buckets=buckets,
            registry=r,
        )
        self.stage = Histogram(
            "adstream_serving_stage_latency_seconds", "Time per stage", ["stage"], buckets=buckets, registry=r
        )
        self.served_by = Counter(
            "adstream_serving_served_by_total", "Requests by ladder rung", ["rung"], registry=r
        )
        self.shed = Counter("adstream_serving_shed_total", "Requests refused with 503 (overload)", registry=r)
        self.interests = Counter(
            "adstream_serving_interests_total",
            "Declared interests of requests by outcome (used: a cold-start prior; faded: the user's "
            "own evidence outweighs it; unknown: no such category in the catalog)",
            ["outcome"],
            registry=r,
        )
        self.qos_requests = Counter(
            "adstream_serving_qos_requests_total",
            "Ad requests by QoS class and gate outcome (served, or why shed: queue_full, timeout, evicted)",
            ["qos", "outcome"],
            registry=r,
        )
        self.qos_latency = Histogram(
            "adstream_serving_qos_latency_seconds",
            "Latency in the replica of served ad requests, by QoS class",
            ["qos"],
            buckets=buckets,
            registry=r,
        )
        self.qos_wait = Histogram(
            "adstream_serving_qos_wait_seconds",
            "Time served ad requests waited at the QoS gate, by class",
            ["qos"],
            buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05),
            registry=r,
        )
        self.part = Histogram(
            "adstream_serving_request_part_seconds",
            "Where an ad request's time in the replica goes (parse, gate, redis, recall, rank, "
            "rerank, record, respond), and the background work it causes (flush, impressions)",
            ["part"],
            buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
            registry=r,
        )
        self.deltas = Counter(
            "adstream_serving_deltas_total", "Adapter deltas by outcome", ["outcome"], registry=r
        )
        self.swap_pause = Histogram(
            "adstream_serving_swap_pause_seconds",
            "Time a delta's check + apply + swap held the replica's loop",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
            registry=r,
        )
        self.swap_pause_max = Gauge(
            "adstream_serving_swap_pause_max_seconds", "Longest swap pause since start", registry=r
        )
        self.swap_pause_cpu_max = Gauge(
            "adstream_serving_swap_pause_cpu_max_seconds",
            "Longest swap pause since start in the loop thread's own CPU time (the wall-clock pause "
            "less the time the thread waited for the GIL or a core)",
            registry=r,
        )
        self.swaps = Gauge("adstream_serving_adapter_swaps", "Buffer swaps of the adapter bank", registry=r)
        self.adapters = Gauge("adstream_serving_adapters", "Adapters held by the replica", registry=r)
        self.staleness = Gauge(
            "adstream_serving_adapter_staleness_max_seconds",
            "Age of the least recently updated adapter",
            registry=r,
        )
        self.catalog = Gauge("adstream_serving_catalog_ads", "Ads in the replica's catalog", registry=r)
        self.impressions = Counter(
            "adstream_serving_impressions_total",
            "Impression events by produce outcome",
            ["outcome"],
            registry=r,
        )
        self.canary_share = Gauge(
            "adstream_serving_canary_share", "Share of users on the candidate", registry=r
        )
        self.canary_actions = Counter(
            "adstream_serving_canary_actions_total", "Canary decisions taken", ["action"], registry=r
        )
        self.clicks_joined = Counter(
            "adstream_serving_clicks_joined_total", "Clicks joined to served pCTR", registry=r
        )
        self.clicks_refused = Counter(
            "adstream_serving_clicks_refused_total",
            "Clicks without the click token of an impression served to that user and ad (not joined)",
            registry=r,
        )
        self.task_restarts = Counter(
            "adstream_serving_task_restarts_total",
            "Background tasks restarted after dying",
            ["task"],
            registry=r,
        )
        self.task_errors = Counter(
            "adstream_serving_task_errors_total",
            "Failed steps of background loops (retried)",
            ["task"],
            registry=r,
        )

    def qos_served(self, qos: str, latency_s: float, wait_s: float) -> None:
        """One served request of class `qos`: its latency and its wait at the gate."""
        children = self._qos_children.get(qos)
        if children is None:
            children = self._qos_children[qos] = (
                self.qos_requests.labels(qos, "served"),
                self.qos_latency.labels(qos),
                self.qos_wait.labels(qos),
            )
        served, latency, wait = children
        served.inc()
        latency.observe(latency_s)
        wait.observe(wait_s)

    def spent(self, part: str, seconds: float) -> None:
        """Time one part of a request (or of the background work it causes) took."""
        child = self._parts.get(part)
        if child is None:
            child = self._parts[part] = self.part.labels(part)
        child.observe(seconds)
