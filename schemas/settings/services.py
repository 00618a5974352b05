"""Settings of the services adstream talks to: Kafka, Redis, ClickHouse, and its metrics endpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator

from schemas.settings.base import Group


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
    session_timeout_ms: int = Field(
        10_000,
        ge=1000,
        le=300_000,
        description="Consumer groups (streams workers, trainers): a member silent this long is dropped and "
        "its partitions move to the others (Kafka brokers accept 6000 and up by default; the local Tansu "
        "also waits half of it before answering a group join)",
    )
    heartbeat_interval_ms: int = Field(
        1000,
        ge=100,
        description="Consumer groups: heartbeat period (under a third of kafka.session_timeout_ms)",
    )
    fetch_max_wait_ms: int = Field(
        100,
        ge=0,
        le=30_000,
        description="Every consumer (streams workers of both engines, trainers, replicas): how long a "
        "fetch may wait for new records. A click waits up to this long at each hop of the loop "
        "(Faust hard-codes 1500, aiokafka defaults to 500; the local Tansu answers a fetch with "
        "nothing new only then); lower costs idle fetch requests, not throughput",
    )

    @model_validator(mode="after")
    def _heartbeat_below_session(self) -> KafkaSettings:
        if self.heartbeat_interval_ms * 3 > self.session_timeout_ms:
            raise ValueError(
                f"kafka.heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be at most a third of "
                f"kafka.session_timeout_ms ({self.session_timeout_ms})"
            )
        return self


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


class MetricsSettings(Group):
    """The Prometheus servers of the worker and the trainer."""

    port: int = Field(9464, ge=0, description="Prometheus port of workers (0 = off)")
    host: str = Field(
        "127.0.0.1", description="Interface the worker's and trainer's metrics servers bind (0.0.0.0: all)"
    )
