"""A typed Python client of adstream's HTTP API (`POST /v1/ads`, `POST /v1/events`), sync and
async, on httpx, with retries (exponential backoff with jitter, honouring Retry-After) through
tenacity. It imports only the contract (`schemas`), so what it sends is what the server checks.

>>> from adstream_client import AdstreamClient, click_for
>>> with AdstreamClient("http://127.0.0.1:8000", api_key="pub-…") as client:  # doctest: +SKIP
...     resp = client.ads("u-42", slot="feed", k=3)
...     shown = client.view(resp, 0, "u-42")  # the render beacon, once the ad is in view
...     result = client.events([click_for(resp, 0, "u-42")])
"""

from adstream_client.client import (
    AdstreamClient,
    AdstreamHTTPError,
    AsyncAdstreamClient,
    RetryPolicy,
)
from adstream_client.events import click_for, dwell_for, view_for

__all__ = [
    "AdstreamClient",
    "AdstreamHTTPError",
    "AsyncAdstreamClient",
    "RetryPolicy",
    "click_for",
    "dwell_for",
    "view_for",
]
