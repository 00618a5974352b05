"""The one settings class of adstream, one frozen sub-model per concern: env prefix `ADSTREAM_`
(`ADSTREAM_ONLINE__LR` is `settings.online.lr`), a `.env` file, or CLI flags."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from functools import cache, lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.api import QosClass
from schemas.retry import Backoff

# defaults of the per-class QoS settings (serving.qos)
_QOS_SLOT_CLASS: dict[str, QosClass] = {"search": "guaranteed", "feed": "burstable", "splash": "besteffort"}
_QOS_QUEUE_LIMIT: dict[QosClass, int] = {"guaranteed": 32, "burstable": 16, "besteffort": 8}
_QOS_QUEUE_TIMEOUT_MS: dict[QosClass, float] = {"guaranteed": 25.0, "burstable": 15.0, "besteffort": 10.0}
_QOS_RETRY_AFTER_S: dict[QosClass, int] = {"guaranteed": 1, "burstable": 1, "besteffort": 2}


class Group(BaseModel):
    """A frozen group of settings; built directly (`OnlineSettings(lr=0.01)`, as rooms and tests
    do), a bad value is a ConfigError naming the group, the field and the value."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            from schemas.errors import ConfigError

            where = _group_path(type(self))
            bad = "; ".join(
                f"{'.'.join([where, *(str(p) for p in e['loc'])])}: {e['msg']} (got {e.get('input')!r})"
                for e in exc.errors()
            )
            raise ConfigError(bad) from None


@cache
def _group_path(group: type[BaseModel]) -> str:
    """The dotted name of a settings group (`CanarySettings` -> `canary`, `state.weights`)."""

    def walk(model: type[BaseModel], prefix: str) -> str | None:
        for name, info in model.model_fields.items():
            sub = info.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                if sub is group:
                    return prefix + name
                found = walk(sub, f"{prefix}{name}.")
                if found:
                    return found
        return None

    return walk(Settings, "") or group.__name__


class KafkaSettings(Group):
    """The Kafka brokers: address, security (TLS, SASL) and topic partitions."""

    bootstrap: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers, host:port[,…]")
    connect_timeout_s: float = Field(
        10.0, gt=0, le=300, description="How long a command waits for the Kafka brokers to answer at start"
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="Kafka security.protocol: TLS with SSL / SASL_SSL, SASL auth with SASL_*"
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = Field(
        "PLAIN", description="Kafka SASL mechanism (with SASL_PLAINTEXT / SASL_SSL)"
    )
    sasl_username: str = Field("", description="Kafka SASL user")
    sasl_password: SecretStr = Field(SecretStr(""), description="Kafka SASL password")
    ssl_cafile: Path | None = Field(None, description="CA bundle for Kafka (None: system CAs)")
    ssl_certfile: Path | None = Field(None, description="Client certificate for Kafka mutual TLS")
    ssl_keyfile: Path | None = Field(None, description="Private key of kafka.ssl_certfile")
    ssl_key_password: SecretStr = Field(SecretStr(""), description="Password of kafka.ssl_keyfile")
    ssl_check_hostname: bool = Field(True, description="Verify the brokers' certificate hostnames")
    topic_partitions: int | None = Field(
        None, ge=1, description="Override the contract's partition counts for every topic"
    )


class RedisSettings(Group):
    """Redis of the served state: URL, ACL user and TLS."""

    url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL for served state")
    username: str = Field("", description="Redis ACL user (overrides the one in redis.url)")
    password: SecretStr = Field(SecretStr(""), description="Redis password (overrides redis.url's)")
    tls: bool = Field(False, description="Redis over TLS (also on with a rediss:// URL)")
    tls_cafile: Path | None = Field(None, description="CA bundle for Redis TLS (None: system CAs)")
    tls_certfile: Path | None = Field(None, description="Client certificate for Redis mutual TLS")
    tls_keyfile: Path | None = Field(None, description="Private key of redis.tls_certfile")
    tls_check_hostname: bool = Field(True, description="Verify the Redis certificate hostname")


class ClickHouseSettings(Group):
    """ClickHouse of the examples and attribution: URL, user and TLS."""

    url: str = Field(
        "clickhouse://default@127.0.0.1:9000/adstream", description="ClickHouse native-protocol URL"
    )
    http_port: int = Field(8123, description="HTTP port of a locally started ClickHouse")
    user: str = Field("", description="ClickHouse user (overrides the one in clickhouse.url)")
    password: SecretStr = Field(SecretStr(""), description="ClickHouse password (over the URL)")
    secure: bool = Field(False, description="ClickHouse native protocol over TLS (port 9440)")
    ca_certs: Path | None = Field(None, description="CA bundle for ClickHouse TLS")
    certfile: Path | None = Field(None, description="Client certificate for ClickHouse mutual TLS")
    keyfile: Path | None = Field(None, description="Private key of clickhouse.certfile")
    verify: bool = Field(True, description="Verify the ClickHouse server certificate")


class EngagementSettings(Group):
    """How much each kind of evidence moves a user's state vector and intent scores."""

    # An impression is the policy's choice, not the user's: under a random logging policy it is
    # pure noise on the intent scores, under a targeted one it feeds the ranker's own past
    # choices back as "intent". At 0.05 (20 impressions = 1 click) that noise cost the ranker
    # 0.010 and 0.015 holdout AUC at the simulator's defaults (seeds 0, 1; nothing measurable
    # with 10,000 impressions per user, where clicks dominate): benchmarks/offline_quality.py
    # with and without --impression-weight 0.05. 0 measured the same as 0.001, but at 0.001 an
    # impression still registers in the state (a user who was only shown ads keeps a non-zero
    # vector, which serving's recall treats as warm, as before).
    impression: float = Field(0.001, ge=0, description="Weight of an impression (exposure, not taste)")
    click: float = Field(1.0, ge=0, description="Weight of a click")
    dwell: float = Field(1.0, ge=0, description="Weight of a full dwell")
    dwell_full_ms: int = Field(30_000, gt=0, description="A dwell this long counts fully")
    skip: float = Field(0.3, ge=0, description="Weight of a short dwell (a skip: negative evidence)")
    conversion: float = Field(2.0, ge=0, description="Weight of a conversion")


class StateSettings(Group):
    """The per-user intent state of the streams worker (streams.state)."""

    half_life_s: float = Field(3600.0, gt=0, description="Half-life τ of intent scores")
    session_gap_s: float = Field(30.0, gt=0, description="A gap over this starts a new session")
    alpha_session: float = Field(0.85, gt=0, le=1, description="Decay applied on a session gap")
    alpha_contradict: float = Field(0.62, gt=0, le=1, description="Decay on a contradicting signal")
    contradict_dwell_ms: int = Field(2000, ge=0, description="A click then dwell below this contradicts")
    evidence_half_life: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="User state: old evidence halves per this much new positive evidence (clicks; 0: off)",
    )
    evidence_surprise: bool = Field(
        False,
        description="User state: scale that forgetting by the evidence's surprise (1 − its category's share "
        "of the state's intent mass)",
    )
    ttl_s: int = Field(7 * 24 * 3600, gt=0, description="TTL of a user's Redis record")
    max_intents: int = Field(16, ge=1, description="Intent scores kept per user (the strongest)")
    weights: EngagementSettings = Field(
        default_factory=EngagementSettings, description="Weights of the kinds of evidence"
    )


class StreamsSettings(Group):
    """The streams worker: event-time checks, label join, co-partition merge."""

    max_event_skew_s: float = Field(
        1800.0,
        gt=0,
        description="Events dated further after their Kafka record time (capped by the wall clock) "
        "are dead-lettered; at most the attribution window",
    )
    verify_impressions: bool = Field(
        True,
        description="Dead-letter impressions without a valid replica signature (Impression.sig); off only "
        "where other trusted producers write ad.impressions without the key",
    )
    verify_clicks: bool = Field(
        True,
        description="Dead-letter clicks and dwells without the click token of an impression served to "
        "that user and ad (ServedAd.click_token); replicas leave such clicks out of the canary's join",
    )
    watermark_window: int = Field(
        32,
        ge=1,
        description="Stream time is the median event time of this many recent records (label join, "
        "trainer): fewer than half of them, however far ahead, cannot move it",
    )
    attribution_window_s: float = Field(1800.0, gt=0, description="Impression→click/dwell join window")
    merge_max_idle_s: float = Field(
        30.0, gt=0, description="An input partition silent this long no longer holds back the others"
    )
    merge_max_buffered: int = Field(
        100_000, ge=1, description="…nor once the merge holds this many records of its co-partition"
    )
    fetch_records: int = Field(
        5000, ge=1, description="Records the worker reads per fetch, both engines (Faust's default: 500)"
    )
    fetch_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="Bytes per partition and fetch (Faust's and aiokafka's default: 1 MiB)",
    )
    cache_users: int = Field(
        200_000, ge=1, description="User states the worker keeps in memory (its partitions share them)"
    )
    backlog: int = Field(
        4, ge=1, description="While a write is in flight a batch grows to at most this many × sink.batch_size"
    )
    produce_linger_ms: int = Field(
        5, ge=0, le=1000, description="The worker's producer waits this long to fill a batch (examples, DLQ)"
    )
    produce_batch_bytes: int = Field(
        512 * 1024,
        ge=16 * 1024,
        description="The worker's producer batch per partition (a commit produces thousands of examples)",
    )
    retry_first_s: float = Field(
        0.5,
        gt=0,
        description="First wait before a streams step (Redis, ClickHouse, Kafka) that failed with a "
        "transient error is retried; the waits double up to streams.retry_max_s and never give up "
        "(the worker pauses)",
    )
    retry_max_s: float = Field(
        30.0, gt=0, description="Longest wait between retries of a streams step (>= streams.retry_first_s)"
    )

    @model_validator(mode="after")
    def _retry_waits(self) -> StreamsSettings:
        if self.retry_first_s > self.retry_max_s:
            raise ValueError(
                f"streams.retry_first_s ({self.retry_first_s}) must be <= "
                f"streams.retry_max_s ({self.retry_max_s})"
            )
        return self

    @property
    def retry_backoff(self) -> Backoff:
        """The backoff of the worker's steps (`schemas.retry`): no give-up."""
        return Backoff(self.retry_first_s, self.retry_max_s, None)


class SinkSettings(Group):
    """The ClickHouse sink of the streams worker."""

    batch_size: int = Field(5000, ge=1, description="ClickHouse sink flushes at this many rows")
    flush_s: float = Field(
        0.25,
        gt=0,
        description="…or after this many seconds: a batch's examples reach the trainer only once it "
        "is committed, so this bounds the worker's share of click→served freshness",
    )
    max_partitions: int = Field(
        100, ge=1, description="Months (ClickHouse partitions) one INSERT block may span (server: 100)"
    )


class MetricsSettings(Group):
    """The Prometheus servers of the worker and the trainer."""

    port: int = Field(9464, ge=0, description="Prometheus port of workers (0 = off)")
    host: str = Field(
        "127.0.0.1", description="Interface the worker's and trainer's metrics servers bind (0.0.0.0: all)"
    )


class LoraSettings(Group):
    """LoRA adapters: rank, alpha and the ranker modules they adapt."""

    rank: int = Field(8, ge=1, le=256)
    alpha: float = Field(16.0, gt=0)
    # The head (Linear 155 → 1 on the cross ‖ deep outputs) and the per-category, per-slot and
    # per-position bias tables: a trend shared by many users is one column of wide.category, a
    # position-bias or slot change one of wide.position / wide.slot. Against (cross, deep,
    # wide.category) the same drift runs learned as well (trend a little less, slot/position
    # shift more; benchmarks/results/online_drift_targets.json), and served with 1,000 mixed
    # adapters they cost 16 % of base throughput instead of 52 %: narrow layers are served from
    # their ΔW (serving.adapters). cross/deep targets remain available (benchmarks/rank.py --targets)
    targets: tuple[str, ...] = Field(
        ("head", "wide.category", "wide.slot", "wide.position"),
        min_length=1,
        description="Ranker modules to adapt: Linear layers and small id tables (name or prefix)",
    )

    @property
    def scaling(self) -> float:
        """The factor PEFT multiplies B @ A by (alpha / rank)."""
        return self.alpha / self.rank


class OnlineSettings(Group):
    """The online LoRA trainer (trainers.online, trainers.service)."""

    micro_batch: int = Field(256, ge=1)
    micro_batch_s: float = Field(0.5, gt=0)
    delta_percentile: float = Field(95.0, gt=0, lt=100)
    delta_max_norm: float = Field(10.0, gt=0, description="Deltas with a larger norm are rejected")
    snapshot_every_s: float = Field(30.0, gt=0)
    lr: float = Field(0.003, gt=0, description="Adam learning rate of the online LoRA trainer")
    embedding_lr: float = Field(
        0.2, gt=0, description="SGD learning rate of LoRA on id tables (lora.targets like wide.category)"
    )
    delta_window_steps: int = Field(50, ge=1, description="Steps in the ΔW direction-magnitude window")
    progressive_window: int = Field(2000, ge=10, description="Examples in rolling AUC/logloss windows")
    reset_margin: float = Field(0.01, ge=0, description="Adapter AUC below base by more than this is bad")
    reset_patience: int = Field(20, ge=1, description="Bad micro-batches in a row before an adapter reset")
    group: str = Field("adstream-trainer", description="Consumer group of the online trainer")
    dedupe_ids: int = Field(
        200_000, ge=0, description="Recent example event_ids the trainer remembers to skip re-deliveries"
    )
    hold_labels: bool = Field(
        True,
        description="online.label_mode hold: learn examples in impression order after their window closes",
    )
    max_wait_s: float = Field(
        0.5, gt=0, description="An adapter's examples wait at most this long for a full step (freshness)"
    )
    # measured in benchmarks/online_drift.py (same seeds): see README / the benchmark's docstring
    label_mode: Literal["hold", "fn_weighted", "fn_calibrated"] = Field(
        "fn_weighted",
        description="Delayed feedback: hold (emit each impression once its window closes), or learn "
        "at once: a fake negative per impression, a positive duplicate at its click, with the "
        "fake-negative weighted (fn_weighted) or calibrated (fn_calibrated) loss (Ktena et al. 2019)",
    )
    snapshot_ttl_s: int = Field(
        30 * 24 * 3600, gt=0, description="TTL of an adapter's Redis snapshot (refreshed on every write)"
    )
    max_adapters: int = Field(
        4096, ge=1, description="Adapters the online trainer holds; the least recently trained is evicted"
    )
    min_step_examples: int = Field(
        64, ge=1, description="An adapter's examples wait for this many (or online.max_wait_s) before a step"
    )
    min_guard_examples: int = Field(
        500, ge=1, description="Examples in an adapter's window before its AUC guard may reset it"
    )
    min_guard_positives: int = Field(
        10, ge=1, description="Clicks in an adapter's window before its AUC guard may reset it"
    )

    @property
    def fn_loss(self) -> Literal["weighted", "calibrated"]:
        """The fake-negative loss of `label_mode` (hold learns finished labels: weighted)."""
        return "calibrated" if self.label_mode == "fn_calibrated" else "weighted"

    redis_retry_first_s: float = Field(
        0.05,
        gt=0,
        description="First wait before the trainer retries a Redis operation that failed with a transient "
        "error; the waits double up to online.redis_retry_max_s",
    )
    redis_retry_max_s: float = Field(
        2.0, gt=0, description="Longest wait between the trainer's Redis retries (>= redis_retry_first_s)"
    )
    redis_give_up_s: float = Field(
        300.0,
        ge=0,
        description="The trainer gives a Redis operation up (StoreError) once it has failed this long",
    )

    @model_validator(mode="after")
    def _redis_retry_waits(self) -> OnlineSettings:
        if self.redis_retry_first_s > self.redis_retry_max_s:
            raise ValueError(
                f"online.redis_retry_first_s ({self.redis_retry_first_s}) must be <= "
                f"online.redis_retry_max_s ({self.redis_retry_max_s})"
            )
        return self

    @property
    def redis_backoff(self) -> Backoff:
        """The backoff of the trainer's Redis operations (`schemas.retry`)."""
        return Backoff(self.redis_retry_first_s, self.redis_retry_max_s, self.redis_give_up_s)


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
    batch_max: int = Field(8, ge=1, description="@serve.batch: requests ranked together")
    rank_thread: bool = Field(
        False, description="Rank on one worker thread beside the replica's event loop (torch frees the GIL)"
    )
    batch_wait_ms: float = Field(0.0, ge=0, description="@serve.batch wait (0: take what is queued)")
    adapter_capacity: int = Field(2048, ge=1, description="Adapters a replica can hold")
    rank_chunk: int = Field(2048, ge=1, description="Rank on CPU: candidates per forward pass")
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


class CanarySettings(Group):
    """The canary of a candidate adapter version (serving.canary)."""

    share: float = Field(0.05, ge=0, le=1)
    auc_gain: float = Field(
        0.005, ge=0, description="Online AUC gain over stable a candidate needs to be promoted"
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
    reserve_price: float = Field(0.01, ge=0, description="GSP price floor (per click)")
    pacing_slack: float = Field(0.1, ge=0, description="Spend may run this far ahead of plan unthrottled")


class AttributionSettings(Group):
    """Multi-touch attribution: lookbacks, models and lift holdout."""

    click_lookback_s: int = Field(
        7 * 86400, gt=0, description="A click counts toward a conversion this many seconds after it"
    )
    view_lookback_s: int = Field(
        86400, gt=0, description="An impression (view) counts toward a conversion this long after it"
    )
    lookback_by_advertiser: dict[str, tuple[int, int]] = Field(
        default_factory=dict,
        description='Per-advertiser (click_s, view_s) lookbacks, JSON: {"adv001": [604800, 3600]}',
    )
    journey_gap_s: int = Field(
        7 * 86400, gt=0, description="A journey without conversion is closed (a null path) after this gap"
    )
    bootstrap: int = Field(100, ge=0, description="Bootstrap replicates for CIs (0: none)")
    seed: int = Field(0, ge=0, description="Seed of bootstraps, data splits and sampling")
    markov_order: int = Field(
        0, ge=0, le=3, description="Markov order 1-3 (0: chosen by held-out likelihood)"
    )
    markov_removal: Literal["redistribute", "null"] = Field(
        "redistribute",
        description="Markov removal effect: 'redistribute' (a removed channel is never entered; its "
        "state's other transitions renormalised) or 'null' (its journeys end in NULL, the textbook rule)",
    )
    shapley_exact_max: int = Field(
        12, ge=1, le=20, description="Shapley is exact for journeys with at most this many channels"
    )
    shapley_permutations: int = Field(
        200, ge=2, description="Sampled permutations per journey above shapley_exact_max"
    )
    time_decay_half_life_s: float = Field(
        7 * 86400.0, gt=0, description="Time-decay model: a touch's weight halves per this age"
    )
    view_weight: float = Field(0.5, ge=0, description="Time-decay model: weight of a view")
    click_weight: float = Field(1.0, ge=0, description="Time-decay model: weight of a click")
    holdout_share: float = Field(
        0.0, ge=0, lt=1, description="Share of users per campaign held out (shown no ad) for lift"
    )
    holdout_salt: str = Field("adstream-holdout", description="Salt of the stable holdout assignment")


class Settings(BaseSettings):
    """Where the services are and how the loop behaves: one sub-model per concern (`settings.online.lr`,
    env `ADSTREAM_ONLINE__LR`), top-level only what every room shares."""

    model_config = SettingsConfigDict(
        env_prefix="ADSTREAM_", env_file=".env", env_nested_delimiter="__", extra="ignore", frozen=True
    )

    # -- cross-cutting: shared by every room
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Torch device for models")
    delta_signing_key: SecretStr = Field(
        SecretStr(""),
        description="HMAC key (at least 32 bytes) trainers sign adapter deltas with and replicas check; "
        "empty: the key file <state_dir>/delta-signing.key, created by the first process that needs it",
    )
    event_signing_key: SecretStr = Field(
        SecretStr(""),
        description="HMAC key (at least 32 bytes) replicas sign impressions and click tokens with and the "
        "streams worker checks; empty: the key file <state_dir>/event-signing.key, created by the first "
        "process that needs it",
    )
    topic_prefix: str = Field("", description="Prefix for every topic name (isolates tests/tenants)")
    redis_prefix: str = Field("adstream:", description="Prefix for every Redis key")
    state_dir: Path = Field(Path(".adstream"), description="Pid files, logs and data of `adstream up`")
    stack_timeout_s: float = Field(60.0, gt=0, description="How long `up` waits for a service")
    state_dim: int = Field(32, ge=1, le=1024, description="Dimension of user state / ad vectors")
    adapter_scheme: Literal["slot", "advertiser", "slot+advertiser"] = "slot"
    model_dir: Path = Field(Path(".adstream/models"), description="Checkpoints and ad index")

    # -- one sub-model per concern
    kafka: KafkaSettings = Field(
        default_factory=KafkaSettings,
        description="The Kafka brokers: address, security (TLS, SASL) and topic partitions.",
    )
    redis: RedisSettings = Field(
        default_factory=RedisSettings, description="Redis of the served state: URL, ACL user and TLS."
    )
    clickhouse: ClickHouseSettings = Field(
        default_factory=ClickHouseSettings,
        description="ClickHouse of the examples and attribution: URL, user and TLS.",
    )
    state: StateSettings = Field(
        default_factory=StateSettings,
        description="The per-user intent state of the streams worker (streams.state).",
    )
    streams: StreamsSettings = Field(
        default_factory=StreamsSettings,
        description="The streams worker: event-time checks, label join, co-partition merge.",
    )
    sink: SinkSettings = Field(
        default_factory=SinkSettings, description="The ClickHouse sink of the streams worker."
    )
    metrics: MetricsSettings = Field(
        default_factory=MetricsSettings, description="The Prometheus servers of the worker and the trainer."
    )
    lora: LoraSettings = Field(
        default_factory=LoraSettings,
        description="LoRA adapters: rank, alpha and the ranker modules they adapt.",
    )
    online: OnlineSettings = Field(
        default_factory=OnlineSettings,
        description="The online LoRA trainer (trainers.online, trainers.service).",
    )
    serving: ServingSettings = Field(
        default_factory=ServingSettings,
        description="The ad server: HTTP, Ray Serve replicas, batching, adapters, catalog.",
    )
    qos: QosSettings = Field(
        default_factory=QosSettings,
        description="QoS classes (serving.qos): a priority gate in front of the pipeline.",
    )
    recall: RecallSettings = Field(
        default_factory=RecallSettings,
        description="Recall of candidates: exact, inverted file (ivf) or usearch HNSW (ann).",
    )
    canary: CanarySettings = Field(
        default_factory=CanarySettings,
        description="The canary of a candidate adapter version (serving.canary).",
    )
    rerank: RerankSettings = Field(
        default_factory=RerankSettings,
        description="The rerank stage: diversity, long tail, reserve price and pacing.",
    )
    attribution: AttributionSettings = Field(
        default_factory=AttributionSettings,
        description="Multi-touch attribution: lookbacks, models and lift holdout.",
    )

    def __init__(self, **values: Any) -> None:
        # a keyword that names no setting (a pre-nesting flat name, a typo) would be dropped
        # silently by extra="ignore", which exists for the environment's other ADSTREAM_ names
        _refuse_unknown_keywords(values)
        super().__init__(**values)

    def model_post_init(self, context: Any, /) -> None:
        _refuse_flat_env(os.environ)


def clickhouse_connect_args(settings: Settings, database: str | None = None) -> dict[str, object]:
    """clickhouse-driver `Client(**args)` for `settings.clickhouse_url` (bound to `database`, or to
    `default` when None): every room that talks to ClickHouse connects the same way
    (`schemas.clients.clickhouse_args`, which adds the user, password and TLS settings)."""
    from schemas.clients import clickhouse_args

    return clickhouse_args(settings, database)


def clickhouse_database(settings: Settings | str) -> str:
    """The database named in `clickhouse_url` (settings or the URL itself; default `adstream`);
    ConfigError if it is not a plain identifier (it is spliced into DDL)."""
    from urllib.parse import urlparse

    from schemas.errors import ConfigError

    url = settings if isinstance(settings, str) else settings.clickhouse.url
    name = urlparse(url).path.strip("/") or "adstream"
    # ASCII only: `str.isalnum` alone takes any script's letters and digits ("ads٣", "café")
    if not (name.isascii() and name.replace("_", "").isalnum()):
        raise ConfigError(f"clickhouse.url: database name {name!r} must be ASCII letters, digits or _")
    return name


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()


def env_example() -> str:
    """The text of `.env.example`: every setting with its default and description."""
    lines = [
        "# adstream settings (env prefix ADSTREAM_, __ between a group and its setting). "
        "Generated by `python -m schemas.jsonschema`.",
        "",
    ]
    group = ""
    for name, field in leaf_fields().items():
        if "." in name and name.split(".")[0] != group:
            group = name.split(".")[0]
            lines += ["", f"# -- {group}"]
        default = field.default
        if field.default_factory is not None:  # the per-class QoS maps: JSON, as the env takes them
            default = json.dumps(field.default_factory(), separators=(",", ":"))  # type: ignore[call-arg]
        if isinstance(default, SecretStr):
            default = default.get_secret_value()
        if isinstance(default, tuple):
            default = ",".join(default) if default else ""
            default = f'["{default.replace(",", chr(34) + "," + chr(34))}"]' if default else "[]"
        value = "" if default is None else str(default)
        if field.description:
            lines.append(f"# {field.description}")
        lines.append(f"{env_name(name)}={value}")
    return "\n".join(lines) + "\n"


# flat name of each setting before the settings were nested (issue 17) -> its dotted name now
RENAMED: dict[str, str] = {
    "kafka_bootstrap": "kafka.bootstrap",
    "kafka_connect_timeout_s": "kafka.connect_timeout_s",
    "redis_url": "redis.url",
    "clickhouse_url": "clickhouse.url",
    "clickhouse_http_port": "clickhouse.http_port",
    "admin_token": "serving.admin_token",
    "serve_api_keys": "serving.api_keys",
    "kafka_security_protocol": "kafka.security_protocol",
    "kafka_sasl_mechanism": "kafka.sasl_mechanism",
    "kafka_sasl_username": "kafka.sasl_username",
    "kafka_sasl_password": "kafka.sasl_password",
    "kafka_ssl_cafile": "kafka.ssl_cafile",
    "kafka_ssl_certfile": "kafka.ssl_certfile",
    "kafka_ssl_keyfile": "kafka.ssl_keyfile",
    "kafka_ssl_key_password": "kafka.ssl_key_password",
    "kafka_ssl_check_hostname": "kafka.ssl_check_hostname",
    "redis_username": "redis.username",
    "redis_password": "redis.password",
    "redis_tls": "redis.tls",
    "redis_tls_cafile": "redis.tls_cafile",
    "redis_tls_certfile": "redis.tls_certfile",
    "redis_tls_keyfile": "redis.tls_keyfile",
    "redis_tls_check_hostname": "redis.tls_check_hostname",
    "clickhouse_user": "clickhouse.user",
    "clickhouse_password": "clickhouse.password",
    "clickhouse_secure": "clickhouse.secure",
    "clickhouse_ca_certs": "clickhouse.ca_certs",
    "clickhouse_certfile": "clickhouse.certfile",
    "clickhouse_keyfile": "clickhouse.keyfile",
    "clickhouse_verify": "clickhouse.verify",
    "topic_partitions": "kafka.topic_partitions",
    "intent_half_life_s": "state.half_life_s",
    "session_gap_s": "state.session_gap_s",
    "alpha_session": "state.alpha_session",
    "alpha_contradict": "state.alpha_contradict",
    "contradict_dwell_ms": "state.contradict_dwell_ms",
    "state_evidence_half_life": "state.evidence_half_life",
    "state_evidence_surprise": "state.evidence_surprise",
    "max_event_skew_s": "streams.max_event_skew_s",
    "streams_verify_impressions": "streams.verify_impressions",
    "streams_verify_clicks": "streams.verify_clicks",
    "watermark_window": "streams.watermark_window",
    "attribution_window_s": "streams.attribution_window_s",
    "user_state_ttl_s": "state.ttl_s",
    "sink_batch_size": "sink.batch_size",
    "sink_flush_s": "sink.flush_s",
    "sink_max_partitions": "sink.max_partitions",
    "metrics_port": "metrics.port",
    "metrics_host": "metrics.host",
    "merge_max_idle_s": "streams.merge_max_idle_s",
    "merge_max_buffered": "streams.merge_max_buffered",
    "lora_rank": "lora.rank",
    "lora_alpha": "lora.alpha",
    "lora_targets": "lora.targets",
    "micro_batch": "online.micro_batch",
    "micro_batch_s": "online.micro_batch_s",
    "delta_percentile": "online.delta_percentile",
    "delta_max_norm": "online.delta_max_norm",
    "snapshot_every_s": "online.snapshot_every_s",
    "online_lr": "online.lr",
    "online_embedding_lr": "online.embedding_lr",
    "delta_window_steps": "online.delta_window_steps",
    "progressive_window": "online.progressive_window",
    "reset_margin": "online.reset_margin",
    "reset_patience": "online.reset_patience",
    "trainer_group": "online.group",
    "trainer_dedupe_ids": "online.dedupe_ids",
    "trainer_hold_labels": "online.hold_labels",
    "trainer_max_wait_s": "online.max_wait_s",
    "label_mode": "online.label_mode",
    "http_host": "serving.http_host",
    "http_port": "serving.http_port",
    "deadline_ms": "serving.deadline_ms",
    "max_body_bytes": "serving.max_body_bytes",
    "recall_k": "recall.k",
    "canary_share": "canary.share",
    "canary_auc_gain": "canary.auc_gain",
    "canary_latency_slack": "canary.latency_slack",
    "canary_max_error_rate": "canary.max_error_rate",
    "canary_error_window_s": "canary.error_window_s",
    "frequency_cap": "serving.frequency_cap",
    "canary_min_samples": "canary.min_samples",
    "canary_eval_s": "canary.eval_s",
    "canary_cooldown_s": "canary.cooldown_s",
    "rerank_max_per_advertiser": "rerank.max_per_advertiser",
    "rerank_category_decay": "rerank.category_decay",
    "rerank_long_tail_boost": "rerank.long_tail_boost",
    "rerank_reserve_price": "rerank.reserve_price",
    "pacing_slack": "rerank.pacing_slack",
    "serve_replicas": "serving.replicas",
    "serve_max_ongoing": "serving.max_ongoing",
    "serve_max_queued": "serving.max_queued",
    "serve_admission_limit": "serving.admission_limit",
    "serve_qos_slots": "qos.slots",
    "serve_qos_default_class": "qos.default_class",
    "serve_qos_slot_class": "qos.slot_class",
    "serve_qos_deadline_ms": "qos.deadline_ms",
    "serve_qos_queue_limit": "qos.queue_limit",
    "serve_qos_queue_timeout_ms": "qos.queue_timeout_ms",
    "serve_qos_retry_after_s": "qos.retry_after_s",
    "serve_batch_max": "serving.batch_max",
    "serve_rank_thread": "serving.rank_thread",
    "serve_batch_wait_ms": "serving.batch_wait_ms",
    "recall_index": "recall.index",
    "recall_ivf_lists": "recall.ivf_lists",
    "recall_ivf_scan": "recall.ivf_scan",
    "recall_ann_min_ads": "recall.ann_min_ads",
    "recall_ann_dtype": "recall.ann_dtype",
    "recall_ann_connectivity": "recall.ann_connectivity",
    "recall_ann_expansion_add": "recall.ann_expansion_add",
    "recall_ann_expansion_search": "recall.ann_expansion_search",
    "recall_ann_oversample": "recall.ann_oversample",
    "serve_adapter_capacity": "serving.adapter_capacity",
    "serve_rank_chunk": "serving.rank_chunk",
    "serve_interest_weight": "serving.interest_weight",
    "serve_merge_group_limit": "serving.merge_group_limit",
    "serve_merge_min": "serving.merge_min",
    "serve_merge_max": "serving.merge_max",
    "serve_adapter_max_norm": "serving.adapter_max_norm",
    "serve_consume_deltas": "serving.consume_deltas",
    "serve_catalog_file": "serving.catalog_file",
    "serve_adapter_max_drift": "serving.adapter_max_drift",
    "serve_delta_replay_s": "serving.delta_replay_s",
    "serve_catalog_max_ads": "serving.catalog_max_ads",
    "serve_impressions_pending": "serving.impressions_pending",
    "snapshot_ttl_s": "online.snapshot_ttl_s",
    "trainer_max_adapters": "online.max_adapters",
    "title_cache_size": "serving.title_cache_size",
    "attribution_click_lookback_s": "attribution.click_lookback_s",
    "attribution_view_lookback_s": "attribution.view_lookback_s",
    "attribution_lookback_by_advertiser": "attribution.lookback_by_advertiser",
    "attribution_journey_gap_s": "attribution.journey_gap_s",
    "attribution_bootstrap": "attribution.bootstrap",
    "attribution_seed": "attribution.seed",
    "attribution_markov_order": "attribution.markov_order",
    "attribution_markov_removal": "attribution.markov_removal",
    "attribution_shapley_exact_max": "attribution.shapley_exact_max",
    "attribution_shapley_permutations": "attribution.shapley_permutations",
    "attribution_time_decay_half_life_s": "attribution.time_decay_half_life_s",
    "attribution_view_weight": "attribution.view_weight",
    "attribution_click_weight": "attribution.click_weight",
    "holdout_share": "attribution.holdout_share",
    "holdout_salt": "attribution.holdout_salt",
}


def _refuse_unknown_keywords(values: Mapping[str, Any]) -> None:
    """ConfigError for `Settings(...)` keywords that are no setting; a pre-nesting flat name is
    told its nested name (`kafka_bootstrap` is `kafka.bootstrap`: `Settings(kafka={"bootstrap": …})`)."""
    unknown = sorted(k for k in values if not k.startswith("_") and k not in Settings.model_fields)
    if unknown:
        from schemas.errors import ConfigError

        named = [f"{k} is {RENAMED[k]}" if k in RENAMED else f"{k} is not a setting" for k in unknown]
        raise ConfigError("Settings(...): " + "; ".join(named) + " (settings are nested per concern)")


def _refuse_flat_env(environ: Mapping[str, str]) -> None:
    """ConfigError naming the new name of every pre-nesting `ADSTREAM_<FLAT>` variable set, which would
    otherwise be ignored silently (extra="ignore")."""
    old = sorted(k for k in environ if k.startswith("ADSTREAM_") and k[9:].lower() in RENAMED)
    if old:
        from schemas.errors import ConfigError

        raise ConfigError(
            "settings are nested now: " + ", ".join(f"{k} is {env_name(RENAMED[k[9:].lower()])}" for k in old)
        )


def leaf_fields(model: type[BaseModel] | None = None, prefix: str = "") -> dict[str, FieldInfo]:
    """Every setting by dotted name (`online.lr`, `device`) with its field."""
    out: dict[str, FieldInfo] = {}
    for name, info in (model or Settings).model_fields.items():
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            out.update(leaf_fields(sub, f"{prefix}{name}."))
        else:
            out[prefix + name] = info
    return out


def env_name(dotted: str) -> str:
    """The environment variable of a setting: `online.lr` -> `ADSTREAM_ONLINE__LR`."""
    return "ADSTREAM_" + dotted.replace(".", "__").upper()


def nested(values: Mapping[str, Any]) -> dict[str, Any]:
    """`Settings` keyword arguments from dotted names: `{"serving.http_port": 1}` ->
    `{"serving": {"http_port": 1}}` (an env name `ADSTREAM_SERVING__HTTP_PORT` works too)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        key = key.removeprefix("ADSTREAM_").lower().replace("__", ".") if key.isupper() else key
        if key in RENAMED:
            from schemas.errors import ConfigError

            raise ConfigError(f"setting {key!r} is {RENAMED[key]!r} now (settings are nested)")
        *groups, leaf = key.split(".")
        d = out
        for g in groups:
            d = d.setdefault(g, {})
        d[leaf] = value
    return out
