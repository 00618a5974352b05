"""The one settings class of adstream, one frozen sub-model per concern: env prefix `ADSTREAM_`
(`ADSTREAM_ONLINE__LR` is `settings.online.lr`), a `.env` file, or CLI flags."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.settings.ab import AbSettings, ExploreSettings
from schemas.settings.attribution import AttributionSettings
from schemas.settings.base import Group
from schemas.settings.collector import CollectorSettings
from schemas.settings.loop import (
    EngagementSettings,
    LoraSettings,
    OnlineSettings,
    SinkSettings,
    StateSettings,
    StreamsSettings,
)
from schemas.settings.renamed import RENAMED
from schemas.settings.services import ClickHouseSettings, KafkaSettings, MetricsSettings, RedisSettings
from schemas.settings.serving import (
    CanarySettings,
    QosSettings,
    RecallSettings,
    RerankSettings,
    ServingSettings,
)
from schemas.settings.slots import SlotSettings
from schemas.settings.variants import VariantsSettings

__all__ = [
    "RENAMED",
    "AbSettings",
    "AttributionSettings",
    "CanarySettings",
    "ClickHouseSettings",
    "CollectorSettings",
    "EngagementSettings",
    "ExploreSettings",
    "Group",
    "KafkaSettings",
    "LoraSettings",
    "MetricsSettings",
    "OnlineSettings",
    "QosSettings",
    "RecallSettings",
    "RedisSettings",
    "RerankSettings",
    "ServingSettings",
    "Settings",
    "SinkSettings",
    "SlotSettings",
    "StateSettings",
    "StreamsSettings",
    "VariantsSettings",
    "env_example",
    "env_name",
    "get_settings",
    "leaf_fields",
    "nested",
]


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
    slots: SlotSettings = Field(
        default_factory=SlotSettings,
        description="The slots (ad surfaces) requests may name; feed, search and splash by default.",
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
    ab: AbSettings = Field(
        default_factory=AbSettings,
        description="Live learning's A/B arms (serving.arms): control and correction-only shares of users.",
    )
    explore: ExploreSettings = Field(
        default_factory=ExploreSettings,
        description="Exploration in rerank with logged propensities (serving.explore).",
    )
    variants: VariantsSettings = Field(
        default_factory=VariantsSettings,
        description="The creative variant bandit (serving.variants): prior, floor, learning from labels.",
    )
    attribution: AttributionSettings = Field(
        default_factory=AttributionSettings,
        description="Multi-touch attribution: lookbacks, models and lift holdout.",
    )
    collector: CollectorSettings = Field(
        default_factory=CollectorSettings,
        description="The event collector (POST /v1/events): limits and per-key rate limit.",
    )

    def __init__(self, **values: Any) -> None:
        # a keyword that names no setting (a pre-nesting flat name, a typo) would be dropped
        # silently by extra="ignore", which exists for the environment's other ADSTREAM_ names
        _refuse_unknown_keywords(values)
        super().__init__(**values)

    def model_post_init(self, context: Any, /) -> None:
        _refuse_flat_env(os.environ)

    @model_validator(mode="after")
    def _per_slot_settings_name_configured_slots(self) -> Settings:
        # a slot named in a per-slot setting but not configured would never be served: a typo
        unknown = [s for s in self.serving.shown_on_serve if s not in self.slots.names]
        if unknown:
            raise ValueError(
                f"serving.shown_on_serve names {unknown}, which slots.names ({', '.join(self.slots.names)}) "
                "does not list"
            )
        return self


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


def _refuse_unknown_keywords(values: Mapping[str, Any]) -> None:
    """ConfigError for `Settings(...)` keywords that are no setting; a pre-nesting flat name is
    told its nested name (`kafka.bootstrap` is `kafka.bootstrap`: `Settings(kafka={"bootstrap": …})`)."""
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
