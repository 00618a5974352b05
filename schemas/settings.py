"""The one settings class of adstream: env prefix `ADSTREAM_`, a `.env` file, or CLI flags."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.api import QosClass

# defaults of the per-class QoS settings (serving.qos)
_QOS_SLOT_CLASS: dict[str, QosClass] = {"search": "guaranteed", "feed": "burstable", "splash": "besteffort"}
_QOS_QUEUE_LIMIT: dict[QosClass, int] = {"guaranteed": 32, "burstable": 16, "besteffort": 8}
_QOS_QUEUE_TIMEOUT_MS: dict[QosClass, float] = {"guaranteed": 25.0, "burstable": 15.0, "besteffort": 10.0}
_QOS_RETRY_AFTER_S: dict[QosClass, int] = {"guaranteed": 1, "burstable": 1, "besteffort": 2}


class Settings(BaseSettings):
    """Where the services are and how the loop behaves; every knob of every room lives here."""

    model_config = SettingsConfigDict(env_prefix="ADSTREAM_", env_file=".env", extra="ignore", frozen=True)

    # -- services ------------------------------------------------------------------------
    kafka_bootstrap: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers, host:port[,…]")
    kafka_connect_timeout_s: float = Field(
        10.0, gt=0, le=300, description="How long a command waits for the Kafka brokers to answer at start"
    )
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL for served state")
    clickhouse_url: str = Field(
        "clickhouse://default@127.0.0.1:9000/adstream", description="ClickHouse native-protocol URL"
    )
    clickhouse_http_port: int = Field(8123, description="HTTP port of a locally started ClickHouse")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Torch device for models")
    admin_token: SecretStr = Field(
        SecretStr(""),
        description="Token for the admin HTTP routes (at least 16 printable ASCII characters; empty, "
        "short or `change-me` disables the admin routes)",
    )
    serve_api_keys: SecretStr = Field(
        SecretStr(""),
        description="Comma-separated keys a /v1/ads caller (a publisher's server or SDK) must send in "
        "X-Api-Key, else 401; empty: /v1/ads is open (then put it behind edge auth or rate limits)",
    )
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

    # -- connecting to secured clusters (schemas.clients turns these into client arguments) --
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="Kafka security.protocol: TLS with SSL / SASL_SSL, SASL auth with SASL_*"
    )
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = Field(
        "PLAIN", description="Kafka SASL mechanism (with SASL_PLAINTEXT / SASL_SSL)"
    )
    kafka_sasl_username: str = Field("", description="Kafka SASL user")
    kafka_sasl_password: SecretStr = Field(SecretStr(""), description="Kafka SASL password")
    kafka_ssl_cafile: Path | None = Field(None, description="CA bundle for Kafka (None: system CAs)")
    kafka_ssl_certfile: Path | None = Field(None, description="Client certificate for Kafka mutual TLS")
    kafka_ssl_keyfile: Path | None = Field(None, description="Private key of kafka_ssl_certfile")
    kafka_ssl_key_password: SecretStr = Field(SecretStr(""), description="Password of kafka_ssl_keyfile")
    kafka_ssl_check_hostname: bool = Field(True, description="Verify the brokers' certificate hostnames")
    redis_username: str = Field("", description="Redis ACL user (overrides the one in redis_url)")
    redis_password: SecretStr = Field(SecretStr(""), description="Redis password (overrides redis_url's)")
    redis_tls: bool = Field(False, description="Redis over TLS (also on with a rediss:// URL)")
    redis_tls_cafile: Path | None = Field(None, description="CA bundle for Redis TLS (None: system CAs)")
    redis_tls_certfile: Path | None = Field(None, description="Client certificate for Redis mutual TLS")
    redis_tls_keyfile: Path | None = Field(None, description="Private key of redis_tls_certfile")
    redis_tls_check_hostname: bool = Field(True, description="Verify the Redis certificate hostname")
    clickhouse_user: str = Field("", description="ClickHouse user (overrides the one in clickhouse_url)")
    clickhouse_password: SecretStr = Field(SecretStr(""), description="ClickHouse password (over the URL)")
    clickhouse_secure: bool = Field(False, description="ClickHouse native protocol over TLS (port 9440)")
    clickhouse_ca_certs: Path | None = Field(None, description="CA bundle for ClickHouse TLS")
    clickhouse_certfile: Path | None = Field(None, description="Client certificate for ClickHouse mutual TLS")
    clickhouse_keyfile: Path | None = Field(None, description="Private key of clickhouse_certfile")
    clickhouse_verify: bool = Field(True, description="Verify the ClickHouse server certificate")

    # -- naming and local stack ----------------------------------------------------------
    topic_prefix: str = Field("", description="Prefix for every topic name (isolates tests/tenants)")
    redis_prefix: str = Field("adstream:", description="Prefix for every Redis key")
    state_dir: Path = Field(Path(".adstream"), description="Pid files, logs and data of `adstream up`")
    topic_partitions: int | None = Field(
        None, ge=1, description="Override the contract's partition counts for every topic"
    )
    stack_timeout_s: float = Field(60.0, gt=0, description="How long `up` waits for a service")

    # -- streams -------------------------------------------------------------------------
    intent_half_life_s: float = Field(3600.0, gt=0, description="Half-life τ of intent scores")
    session_gap_s: float = Field(30.0, gt=0, description="A gap over this starts a new session")
    alpha_session: float = Field(0.85, gt=0, le=1, description="Decay applied on a session gap")
    alpha_contradict: float = Field(0.62, gt=0, le=1, description="Decay on a contradicting signal")
    contradict_dwell_ms: int = Field(2000, ge=0, description="A click then dwell below this contradicts")
    state_evidence_half_life: float = Field(
        0.0,
        ge=0,
        description="User state: old evidence halves per this much new positive evidence (clicks; 0: off)",
    )
    state_evidence_surprise: bool = Field(
        False,
        description="User state: scale that forgetting by the evidence's surprise (1 − its category's share "
        "of the state's intent mass)",
    )
    max_event_skew_s: float = Field(
        1800.0,
        gt=0,
        description="Events dated further after their Kafka record time (capped by the wall clock) "
        "are dead-lettered; at most the attribution window",
    )
    streams_verify_impressions: bool = Field(
        True,
        description="Dead-letter impressions without a valid replica signature (Impression.sig); off only "
        "where other trusted producers write ad.impressions without the key",
    )
    streams_verify_clicks: bool = Field(
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
    user_state_ttl_s: int = Field(7 * 24 * 3600, gt=0, description="TTL of a user's Redis record")
    state_dim: int = Field(32, ge=1, le=1024, description="Dimension of user state / ad vectors")
    sink_batch_size: int = Field(5000, ge=1, description="ClickHouse sink flushes at this many rows")
    sink_flush_s: float = Field(
        0.25,
        gt=0,
        description="…or after this many seconds: a batch's examples reach the trainer only once it "
        "is committed, so this bounds the worker's share of click→served freshness",
    )
    sink_max_partitions: int = Field(
        100, ge=1, description="Months (ClickHouse partitions) one INSERT block may span (server: 100)"
    )
    metrics_port: int = Field(9464, ge=0, description="Prometheus port of workers (0 = off)")
    metrics_host: str = Field(
        "127.0.0.1", description="Interface the worker's and trainer's metrics servers bind (0.0.0.0: all)"
    )
    merge_max_idle_s: float = Field(
        30.0, gt=0, description="An input partition silent this long no longer holds back the others"
    )
    merge_max_buffered: int = Field(
        100_000, ge=1, description="…nor once the merge holds this many records of its co-partition"
    )

    # -- trainers ------------------------------------------------------------------------
    lora_rank: int = Field(8, ge=1, le=256)
    lora_alpha: float = Field(16.0, gt=0)
    # The head (Linear 155 → 1 on the cross ‖ deep outputs) and the per-category, per-slot and
    # per-position bias tables: a trend shared by many users is one column of wide.category, a
    # position-bias or slot change one of wide.position / wide.slot. Against (cross, deep,
    # wide.category) the same drift runs learned as well (trend a little less, slot/position
    # shift more; benchmarks/results/online_drift_targets.json), and served with 1,000 mixed
    # adapters they cost 16 % of base throughput instead of 52 %: narrow layers are served from
    # their ΔW (serving.adapters). cross/deep targets remain available (benchmarks/rank.py --targets)
    lora_targets: tuple[str, ...] = Field(
        ("head", "wide.category", "wide.slot", "wide.position"),
        description="Ranker modules to adapt: Linear layers and small id tables (name or prefix)",
    )
    adapter_scheme: Literal["slot", "advertiser", "slot+advertiser"] = "slot"
    micro_batch: int = Field(256, ge=1)
    micro_batch_s: float = Field(0.5, gt=0)
    delta_percentile: float = Field(95.0, gt=0, lt=100)
    delta_max_norm: float = Field(10.0, gt=0, description="Deltas with a larger norm are rejected")
    snapshot_every_s: float = Field(30.0, gt=0)
    model_dir: Path = Field(Path(".adstream/models"), description="Checkpoints and ad index")
    online_lr: float = Field(0.003, gt=0, description="Adam learning rate of the online LoRA trainer")
    online_embedding_lr: float = Field(
        0.2, gt=0, description="SGD learning rate of LoRA on id tables (lora_targets like wide.category)"
    )
    delta_window_steps: int = Field(50, ge=1, description="Steps in the ΔW direction-magnitude window")
    progressive_window: int = Field(2000, ge=10, description="Examples in rolling AUC/logloss windows")
    reset_margin: float = Field(0.01, ge=0, description="Adapter AUC below base by more than this is bad")
    reset_patience: int = Field(20, ge=1, description="Bad micro-batches in a row before an adapter reset")
    trainer_group: str = Field("adstream-trainer", description="Consumer group of the online trainer")
    trainer_dedupe_ids: int = Field(
        200_000, ge=0, description="Recent example event_ids the trainer remembers to skip re-deliveries"
    )
    trainer_hold_labels: bool = Field(
        True, description="label_mode hold: learn examples in impression order after their window closes"
    )
    trainer_max_wait_s: float = Field(
        0.5, gt=0, description="An adapter's examples wait at most this long for a full step (freshness)"
    )
    # measured in benchmarks/online_drift.py (same seeds): see README / the benchmark's docstring
    label_mode: Literal["hold", "fn_weighted", "fn_calibrated"] = Field(
        "fn_weighted",
        description="Delayed feedback: hold (emit each impression once its window closes), or learn "
        "at once: a fake negative per impression, a positive duplicate at its click, with the "
        "fake-negative weighted (fn_weighted) or calibrated (fn_calibrated) loss (Ktena et al. 2019)",
    )

    # -- serving -------------------------------------------------------------------------
    http_host: str = "127.0.0.1"
    http_port: int = Field(8000, ge=1, le=65535)
    deadline_ms: int = Field(50, ge=1, le=10_000, description="Default request deadline")
    max_body_bytes: int = Field(64 * 1024, ge=1)
    recall_k: int = Field(500, ge=1)
    canary_share: float = Field(0.05, ge=0, le=1)
    canary_auc_gain: float = Field(
        0.005, ge=0, description="Online AUC gain over stable a candidate needs to be promoted"
    )
    canary_latency_slack: float = Field(0.03, ge=0)
    canary_max_error_rate: float = Field(0.005, ge=0, le=1)
    canary_error_window_s: float = Field(300.0, gt=0)
    frequency_cap: int = Field(5, ge=1, description="Max impressions of one ad per user per day")
    canary_min_samples: int = Field(500, ge=1, description="Impressions per arm before canary decides")
    canary_eval_s: float = Field(10.0, gt=0, description="How often a replica re-evaluates its canary")
    canary_cooldown_s: float = Field(
        300.0, ge=0, description="After a rollback, seconds before a candidate is canaried again"
    )
    rerank_max_per_advertiser: int = Field(2, ge=1, description="Diversity: ads per advertiser in a response")
    rerank_category_decay: float = Field(0.8, gt=0, le=1, description="Score factor per repeat of a category")
    rerank_long_tail_boost: float = Field(0.1, ge=0, description="Extra score share for rarely shown ads")
    rerank_reserve_price: float = Field(0.01, ge=0, description="GSP price floor (per click)")
    pacing_slack: float = Field(0.1, ge=0, description="Spend may run this far ahead of plan unthrottled")
    serve_replicas: int = Field(1, ge=1, description="Ray Serve replicas of the ad server")
    serve_max_ongoing: int = Field(128, ge=1, description="Requests a replica works on at once")
    serve_max_queued: int = Field(64, ge=-1, description="Queued requests before 503 (-1 = unbounded)")
    serve_admission_limit: int = Field(
        32,
        ge=1,
        description="/v1/ads requests per replica still reading their body (before their QoS class is "
        "known) past which a new one gets 503; classified requests queue at the QoS gate",
    )
    # QoS classes (serving.qos): a priority gate in front of the pipeline, shedding the lowest first
    # 2 kept the Guaranteed P99 within its deadline at 2x capacity (8: 82 ms) at the same capacity
    serve_qos_slots: int = Field(
        2, ge=1, description="QoS gate: /v1/ads requests in the pipeline at once; the rest wait by class"
    )
    serve_qos_default_class: QosClass = Field(
        "burstable",
        description="QoS class of requests that name none, in slots not in serve_qos_slot_class",
    )
    serve_qos_slot_class: dict[str, QosClass] = Field(
        default_factory=_QOS_SLOT_CLASS.copy,
        description="QoS class per slot for requests that name none",
    )
    serve_qos_deadline_ms: dict[QosClass, Annotated[int, Field(ge=1, le=10_000)]] = Field(
        default_factory=dict,
        description="Request deadline per QoS class for requests that name none (others: deadline_ms)",
    )
    serve_qos_queue_limit: dict[QosClass, Annotated[int, Field(ge=0)]] = Field(
        default_factory=_QOS_QUEUE_LIMIT.copy,
        description="Requests of a QoS class that may wait for the gate before more are shed (503)",
    )
    serve_qos_queue_timeout_ms: dict[QosClass, Annotated[float, Field(ge=0)]] = Field(
        default_factory=_QOS_QUEUE_TIMEOUT_MS.copy,
        description="Longest wait of a QoS class for the gate before the request is shed (503)",
    )
    serve_qos_retry_after_s: dict[QosClass, Annotated[int, Field(ge=0)]] = Field(
        default_factory=_QOS_RETRY_AFTER_S.copy,
        description="Retry-After (seconds) of a shed request, per QoS class",
    )
    serve_batch_max: int = Field(8, ge=1, description="@serve.batch: requests ranked together")
    serve_rank_thread: bool = Field(
        False, description="Rank on one worker thread beside the replica's event loop (torch frees the GIL)"
    )
    serve_batch_wait_ms: float = Field(0.0, ge=0, description="@serve.batch wait (0: take what is queued)")
    # measured in benchmarks/recall.py (1,000,000 ads): see README "Scale-out"
    recall_index: Literal["exact", "ivf", "usearch"] = Field(
        "exact",
        description="Recall backend: exact matmul, or for large catalogs an inverted file "
        "(serving.ivf; the measured choice) or usearch HNSW (serving.ann)",
    )
    recall_ivf_lists: int = Field(0, ge=0, description="ivf: k-means cells (0: 2·√ads at training)")
    recall_ivf_scan: float = Field(
        24.0, ge=1, description="ivf: scan the best cells until this × recall_k visible ads were seen"
    )
    recall_ann_min_ads: int = Field(
        20_000, ge=0, description="ivf, usearch: below this many ads recall stays exact (a matmul is faster)"
    )
    recall_ann_dtype: Literal["f32", "f16", "i8"] = Field(
        "i8", description="usearch: vector storage in the graph (candidates are re-scored in float32)"
    )
    recall_ann_connectivity: int = Field(16, ge=4, le=128, description="usearch: HNSW edges per node (M)")
    recall_ann_expansion_add: int = Field(128, ge=8, description="usearch: candidate list while inserting")
    recall_ann_expansion_search: int = Field(
        64, ge=8, description="usearch: minimum candidate list while searching (raised to what is fetched)"
    )
    recall_ann_oversample: float = Field(
        1.3, ge=1, description="usearch: fetch this × recall_k candidates, re-score exactly, keep recall_k"
    )
    serve_adapter_capacity: int = Field(2048, ge=1, description="Adapters a replica can hold")
    serve_rank_chunk: int = Field(2048, ge=1, description="Rank on CPU: candidates per forward pass")
    serve_interest_weight: float = Field(
        1.0,
        ge=0,
        description="Cold start: each category a new user declares (AdRequest.interests) counts as "
        "this many clicks in it, fading as the user's own evidence reaches it; 0 ignores interests",
    )
    serve_merge_group_limit: int = Field(
        8, ge=0, description="Rank: a batch with at most this many adapters runs all of them merged"
    )
    serve_merge_min: int = Field(
        64, ge=1, description="Rank: samples an adapter needs in a batch to run on merged weights"
    )
    serve_merge_max: int = Field(32, ge=0, description="Rank: most adapters of a batch run on merged weights")
    serve_adapter_max_norm: float = Field(1000.0, gt=0, description="Bound on a whole adapter's ΔW norm")
    serve_consume_deltas: bool = Field(True, description="Replicas follow ad.adapter-deltas and ad.catalog")
    serve_catalog_file: Path | None = Field(None, description="JSON lines of AdCreative loaded at start")
    serve_adapter_max_drift: float = Field(
        100.0,
        gt=0,
        description="Bound on how far (L2 of A, B) live deltas move an adapter from its promoted version",
    )
    serve_delta_replay_s: float = Field(
        3600.0,
        ge=0,
        description="A starting replica reads adapter deltas this far back (older ones: snapshots)",
    )
    serve_catalog_max_ads: int = Field(
        1_000_000, ge=1, description="Ads a replica's catalog holds; when full, inactive ads' rows are reused"
    )
    serve_impressions_pending: int = Field(
        10_000, ge=1, description="Impressions a replica buffers for Kafka before it drops (counted)"
    )
    snapshot_ttl_s: int = Field(
        30 * 24 * 3600, gt=0, description="TTL of an adapter's Redis snapshot (refreshed on every write)"
    )
    trainer_max_adapters: int = Field(
        4096, ge=1, description="Adapters the online trainer holds; the least recently trained is evicted"
    )
    title_cache_size: int = Field(100_000, ge=1, description="Titles whose MiniLM embedding is cached")

    # -- attribution ---------------------------------------------------------------------
    attribution_click_lookback_s: int = Field(
        7 * 86400, gt=0, description="A click counts toward a conversion this many seconds after it"
    )
    attribution_view_lookback_s: int = Field(
        86400, gt=0, description="An impression (view) counts toward a conversion this long after it"
    )
    attribution_lookback_by_advertiser: dict[str, tuple[int, int]] = Field(
        default_factory=dict,
        description='Per-advertiser (click_s, view_s) lookbacks, JSON: {"adv001": [604800, 3600]}',
    )
    attribution_journey_gap_s: int = Field(
        7 * 86400, gt=0, description="A journey without conversion is closed (a null path) after this gap"
    )
    attribution_bootstrap: int = Field(100, ge=0, description="Bootstrap replicates for CIs (0: none)")
    attribution_seed: int = Field(0, ge=0, description="Seed of bootstraps, data splits and sampling")
    attribution_markov_order: int = Field(
        0, ge=0, le=3, description="Markov order 1-3 (0: chosen by held-out likelihood)"
    )
    attribution_markov_removal: Literal["redistribute", "null"] = Field(
        "redistribute",
        description="Markov removal effect: 'redistribute' (a removed channel is never entered; its "
        "state's other transitions renormalised) or 'null' (its journeys end in NULL, the textbook rule)",
    )
    attribution_shapley_exact_max: int = Field(
        12, ge=1, le=20, description="Shapley is exact for journeys with at most this many channels"
    )
    attribution_shapley_permutations: int = Field(
        200, ge=2, description="Sampled permutations per journey above shapley_exact_max"
    )
    attribution_time_decay_half_life_s: float = Field(
        7 * 86400.0, gt=0, description="Time-decay model: a touch's weight halves per this age"
    )
    attribution_view_weight: float = Field(0.5, ge=0, description="Time-decay model: weight of a view")
    attribution_click_weight: float = Field(1.0, ge=0, description="Time-decay model: weight of a click")
    holdout_share: float = Field(
        0.0, ge=0, lt=1, description="Share of users per campaign held out (shown no ad) for lift"
    )
    holdout_salt: str = Field("adstream-holdout", description="Salt of the stable holdout assignment")


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

    url = settings if isinstance(settings, str) else settings.clickhouse_url
    name = urlparse(url).path.strip("/") or "adstream"
    # ASCII only: `str.isalnum` alone takes any script's letters and digits ("ads٣", "café")
    if not (name.isascii() and name.replace("_", "").isalnum()):
        raise ConfigError(f"clickhouse_url: database name {name!r} must be ASCII letters, digits or _")
    return name


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()


def env_example() -> str:
    """The text of `.env.example`: every setting with its default and description."""
    lines = ["# adstream settings (env prefix ADSTREAM_). Generated by `python -m schemas.jsonschema`.", ""]
    for name, field in Settings.model_fields.items():
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
        lines.append(f"ADSTREAM_{name.upper()}={value}")
    return "\n".join(lines) + "\n"
