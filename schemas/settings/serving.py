"""Settings of the serving replicas: requests, QoS classes, recall, canary and rerank."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr

from schemas.api import QosClass
from schemas.settings.base import Group

# defaults of the per-class QoS settings (serving.qos)
_QOS_SLOT_CLASS: dict[str, QosClass] = {"search": "guaranteed", "feed": "burstable", "splash": "besteffort"}
_QOS_QUEUE_LIMIT: dict[QosClass, int] = {"guaranteed": 32, "burstable": 16, "besteffort": 8}
_QOS_QUEUE_TIMEOUT_MS: dict[QosClass, float] = {"guaranteed": 25.0, "burstable": 15.0, "besteffort": 10.0}
_QOS_RETRY_AFTER_S: dict[QosClass, int] = {"guaranteed": 1, "burstable": 1, "besteffort": 2}


class ServingSettings(Group):
    """The ad server: HTTP, Ray Serve replicas, batching, adapters, catalog."""

    admin_token: SecretStr = Field(
        SecretStr(""),
        description="Token for the admin HTTP routes (at least 16 printable ASCII characters; empty, "
        "short or `change-me` disables the admin routes)",
    )
    api_keys: SecretStr = Field(
        SecretStr(""),
        description="Comma-separated keys a /v1/ads caller (a publisher's server or SDK) must send in "
        "X-Api-Key, else 401; empty: /v1/ads is open (then put it behind edge auth or rate limits)",
    )
    http_host: str = "127.0.0.1"
    http_port: int = Field(8000, ge=1, le=65535)
    deadline_ms: int = Field(50, ge=1, le=10_000, description="Default request deadline")
    max_body_bytes: int = Field(64 * 1024, ge=1)
    frequency_cap: int = Field(5, ge=1, description="Max impressions of one ad per user per day")
    replicas: int = Field(1, ge=1, description="Ray Serve replicas of the ad server")
    max_ongoing: int = Field(128, ge=1, description="Requests a replica works on at once")
    max_queued: int = Field(64, ge=-1, description="Queued requests before 503 (-1 = unbounded)")
    admission_limit: int = Field(
        32,
        ge=1,
        description="/v1/ads requests per replica still reading their body (before their QoS class is "
        "known) past which a new one gets 503; classified requests queue at the QoS gate",
    )
    batch_max: int = Field(
        8,
        ge=1,
        description="Requests that arrive together run as one batch of at most this many (serving.batching)",
    )
    rank_thread: bool = Field(
        False, description="Rank on one worker thread beside the replica's event loop (torch frees the GIL)"
    )
    gil_switch_interval_ms: float = Field(
        1.0,
        ge=0,
        le=100,
        description="The replica process' GIL switch interval (Python's default is 5 ms; 0 keeps it): Ray "
        "Serve runs the replica's own loop and the ad server's loop on two threads, and a request "
        "waits up to one interval each time the other thread holds the GIL (at 80 % of one "
        "replica's capacity, 1 ms took the shed requests from 1-72 to 0 per 3,400; "
        "docs/limitations.md, hot swap)",
    )
    batch_wait_ms: float = Field(
        0.0,
        ge=0,
        description="How long a batch waits for more requests once one is queued (0: take what is there)",
    )
    adapter_capacity: int = Field(2048, ge=1, description="Adapters a replica can hold")
    rank_chunk: int = Field(2048, ge=1, description="Rank on CPU: candidates per forward pass")
    rank_trace_rows: int = Field(
        1024,
        ge=0,
        description="Rank on CPU: the ranker traced by TorchScript (the same results without "
        "Python's per-layer cost), in forward passes of at most this many candidates; 0: the "
        "eager ranker in passes of serving.rank_chunk",
    )
    interest_weight: float = Field(
        1.0,
        ge=0,
        description="Cold start: each category a new user declares (AdRequest.interests) counts as "
        "this many clicks in it, fading as the user's own evidence reaches it; 0 ignores interests",
    )
    merge_group_limit: int = Field(
        8, ge=0, description="Rank: a batch with at most this many adapters runs all of them merged"
    )
    merge_min: int = Field(
        64, ge=1, description="Rank: samples an adapter needs in a batch to run on merged weights"
    )
    merge_max: int = Field(32, ge=0, description="Rank: most adapters of a batch run on merged weights")
    adapter_max_norm: float = Field(1000.0, gt=0, description="Bound on a whole adapter's ΔW norm")
    consume_deltas: bool = Field(True, description="Replicas follow ad.adapter-deltas and ad.catalog")
    catalog_file: Path | None = Field(None, description="JSON lines of AdCreative loaded at start")
    adapter_max_drift: float = Field(
        100.0,
        gt=0,
        description="Bound on how far (L2 of A, B) live deltas move an adapter from its promoted version",
    )
    delta_replay_s: float = Field(
        3600.0,
        ge=0,
        description="A starting replica reads adapter deltas this far back (older ones: snapshots)",
    )
    catalog_max_ads: int = Field(
        1_000_000, ge=1, description="Ads a replica's catalog holds; when full, inactive ads' rows are reused"
    )
    impressions_pending: int = Field(
        10_000, ge=1, description="Impressions a replica buffers for Kafka before it drops (counted)"
    )
    impression_linger_ms: int = Field(
        50,
        ge=0,
        le=1000,
        description="A replica's impression producer waits this long to fill a batch (fewer, larger "
        "produce requests; at 5 ms each request's impressions went alone): impressions reach Kafka up "
        "to this much later, for ~4 % less replica CPU per request at 50 req/s",
    )
    title_cache_size: int = Field(100_000, ge=1, description="Titles whose MiniLM embedding is cached")
    counter_flush_s: float = Field(
        0.05,
        gt=0,
        le=10,
        description="Frequency-cap and spend counters go to Redis in one pipeline this often",
    )
    housekeeping_s: float = Field(
        1.0, gt=0, le=60, description="How often a replica reads the day's spend (pacing) and updates gauges"
    )
    shown_on_serve: list[str] = Field(
        default_factory=list,
        description="Slots rendered on the server: their served ads count as shown (billed as CPM, "
        "attributed as views) without a render beacon; other slots' ads are impressions only once "
        'the client\'s view beacon arrives (e.g. ["splash"])',
    )


class QosSettings(Group):
    """QoS classes (serving.qos): a priority gate in front of the pipeline."""

    # QoS classes (serving.qos): a priority gate in front of the pipeline, shedding the lowest first
    # 2 kept the Guaranteed P99 within its deadline at 2x capacity (8: 82 ms) at the same capacity
    slots: int = Field(
        2, ge=1, description="QoS gate: /v1/ads requests in the pipeline at once; the rest wait by class"
    )
    default_class: QosClass = Field(
        "burstable",
        description="QoS class of requests that name none, in slots not in qos.slot_class",
    )
    slot_class: dict[str, QosClass] = Field(
        default_factory=_QOS_SLOT_CLASS.copy,
        description="QoS class per slot for requests that name none",
    )
    deadline_ms: dict[QosClass, Annotated[int, Field(ge=1, le=10_000)]] = Field(
        default_factory=dict,
        description="Request deadline per QoS class for requests that name none (others: "
        "serving.deadline_ms)",
    )
    queue_limit: dict[QosClass, Annotated[int, Field(ge=0)]] = Field(
        default_factory=_QOS_QUEUE_LIMIT.copy,
        description="Requests of a QoS class that may wait for the gate before more are shed (503)",
    )
    queue_timeout_ms: dict[QosClass, Annotated[float, Field(ge=0)]] = Field(
        default_factory=_QOS_QUEUE_TIMEOUT_MS.copy,
        description="Longest wait of a QoS class for the gate before the request is shed (503)",
    )
    retry_after_s: dict[QosClass, Annotated[int, Field(ge=0)]] = Field(
        default_factory=_QOS_RETRY_AFTER_S.copy,
        description="Retry-After (seconds) of a shed request, per QoS class",
    )


class RecallSettings(Group):
    """Recall of candidates: exact, inverted file (ivf) or usearch HNSW (ann)."""

    k: int = Field(500, ge=1)
    # measured in benchmarks/recall.py (1,000,000 ads): see README "Scale-out"
    index: Literal["exact", "ivf", "usearch"] = Field(
        "exact",
        description="Recall backend: exact matmul, or for large catalogs an inverted file "
        "(serving.ivf; the measured choice) or usearch HNSW (serving.ann)",
    )
    ivf_lists: int = Field(0, ge=0, description="ivf: k-means cells (0: 2·√ads at training)")
    ivf_scan: float = Field(
        24.0, ge=1, description="ivf: scan the best cells until this × recall.k visible ads were seen"
    )
    ann_min_ads: int = Field(
        20_000, ge=0, description="ivf, usearch: below this many ads recall stays exact (a matmul is faster)"
    )
    ann_dtype: Literal["f32", "f16", "i8"] = Field(
        "i8", description="usearch: vector storage in the graph (candidates are re-scored in float32)"
    )
    ann_connectivity: int = Field(16, ge=4, le=128, description="usearch: HNSW edges per node (M)")
    ann_expansion_add: int = Field(128, ge=8, description="usearch: candidate list while inserting")
    ann_expansion_search: int = Field(
        64, ge=8, description="usearch: minimum candidate list while searching (raised to what is fetched)"
    )
    ann_oversample: float = Field(
        1.3, ge=1, description="usearch: fetch this × recall.k candidates, re-score exactly, keep recall.k"
    )
    text_dim: int = Field(
        128,
        ge=0,
        le=1024,
        description="Query text (AdRequest.query): width of the hashed bag of words kept per catalog "
        "row (its category and title; 4 bytes each per row); 0 keeps none and ignores queries",
    )
    text_weight: float = Field(
        2.0,
        ge=0,
        description="Query text: weight of an ad's match with the query (cosine of their bags of words) "
        "added to its recall score (the query vector's score is a cosine too: 2 lets a query outweigh it)",
    )


class CanarySettings(Group):
    """The canary of a candidate adapter version (serving.canary)."""

    share: float = Field(0.05, ge=0, le=1)
    promote_when: Literal["not_worse", "better"] = Field(
        "not_worse",
        description="What moves a candidate to the next stage once both arms have `min_samples`: "
        "`not_worse`, its online AUC is not below stable's beyond `z` standard errors (a canary "
        "that catches harm; the trainer's paired guard judges the adapters' quality); `better`, "
        "it beats stable's by `auc_gain` beyond `z` standard errors (between two groups of users "
        "that is rare: at the default 5 % share the live adapters may never reach the rest)",
    )
    auc_gain: float = Field(
        0.005,
        ge=0,
        description="Online AUC gain over stable a candidate needs to be promoted (`promote_when` better)",
    )
    latency_slack: float = Field(0.03, ge=0)
    max_error_rate: float = Field(0.005, ge=0, le=1)
    error_window_s: float = Field(300.0, gt=0)
    min_samples: int = Field(500, ge=1, description="Impressions per arm before canary decides")
    eval_s: float = Field(10.0, gt=0, description="How often a replica re-evaluates its canary")
    cooldown_s: float = Field(
        300.0, ge=0, description="After a rollback, seconds before a candidate is canaried again"
    )
    z: float = Field(
        1.96, gt=0, description="An AUC difference decides only beyond z standard errors of the difference"
    )
    window_impressions: int = Field(
        20_000, ge=1, description="Served impressions per arm in the canary's AUC window"
    )
    latency_window: int = Field(2000, ge=1, description="Requests per arm in the canary's latency window")
    error_rate_window_s: float = Field(
        60.0,
        gt=0,
        description="Seconds of requests behind an arm's error rate (a recent rate, not a lifetime one)",
    )


class RerankSettings(Group):
    """The rerank stage: diversity, long tail, reserve price and pacing."""

    max_per_advertiser: int = Field(2, ge=1, description="Diversity: ads per advertiser in a response")
    category_decay: float = Field(0.8, gt=0, le=1, description="Score factor per repeat of a category")
    long_tail_boost: float = Field(0.1, ge=0, description="Extra score share for rarely shown ads")
    reserve_price: float = Field(0.01, ge=0, description="GSP price floor of a CPC ad (per click)")
    reserve_cpm: float = Field(
        0.5, ge=0, description="GSP price floor of a CPM ad (per thousand shown impressions)"
    )
    pacing_slack: float = Field(0.1, ge=0, description="Spend may run this far ahead of plan unthrottled")
