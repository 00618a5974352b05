"""Settings of the event collector (`POST /v1/events`): limits and the per-key rate limit."""

from __future__ import annotations

from pydantic import Field

from schemas.settings.base import Group


class CollectorSettings(Group):
    """The event collector: body and batch limits, the per-key token bucket, produce timeout."""

    max_body_bytes: int = Field(
        256 * 1024, ge=1, description="Largest /v1/events body (bytes); a larger one gets 413 unread"
    )
    max_events: int = Field(500, ge=1, le=100_000, description="Events one /v1/events batch may carry")
    rate_per_s: float = Field(
        200.0,
        gt=0,
        description="Events per second one API key may send (token bucket refill); past it 429 + Retry-After",
    )
    burst: int = Field(
        2000, ge=1, description="Token bucket size per API key: events a key may send at once after a pause"
    )
    max_keys: int = Field(
        10_000, ge=1, description="API keys (or client addresses, without keys) whose buckets are kept"
    )
    produce_timeout_s: float = Field(
        10.0, gt=0, le=120, description="Longest wait for the broker's acks=all of a batch before 503"
    )
    cors_origins: list[str] = Field(
        default_factory=list,
        description="Origins of web pages that may call /v1/ads and /v1/events (the web snippet), e.g. "
        '["https://news.example"]; "*": any; empty: no CORS (same-origin pages and servers only)',
    )
    http_port: int = Field(8010, ge=1, le=65535, description="Port of the stand-alone `adstream collector`")
