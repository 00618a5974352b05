"""The one exception tree of adstream: every error we raise on purpose derives from AdstreamError."""

from __future__ import annotations


class AdstreamError(Exception):
    """Root of all adstream errors; catch this to handle anything we raise on purpose."""


class SchemaError(AdstreamError):
    """A record does not satisfy the wire contract (the message names the field and value)."""


class ConfigError(AdstreamError, ValueError):
    """Settings or CLI arguments are inconsistent or point at something unusable."""


class StackError(AdstreamError):
    """A local service could not be found, started, reached or stopped."""


class BrokerError(AdstreamError):
    """The Kafka brokers could not be reached, or refused what a client asked of them."""


class StoreError(AdstreamError):
    """A state store (Redis, ClickHouse) refused or lost a read or write."""


class AdapterError(AdstreamError):
    """A LoRA adapter or weight delta failed its checks (shape, dtype, finite, norm, sequence)."""


class ModelError(AdstreamError):
    """A model checkpoint is missing, malformed or incompatible."""
