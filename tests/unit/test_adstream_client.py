"""adstream_client without a server: which answers are retried (and how long it waits), which
are final, and the click/view events it builds from a response (verified by the worker's rule)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import httpx
import pytest

from adstream_client import (
    AdstreamClient,
    AdstreamHTTPError,
    AsyncAdstreamClient,
    RetryPolicy,
    click_for,
    dwell_for,
    view_for,
)
from schemas.api import AdResponse, ServedAd, StageMs
from schemas.errors import SchemaError
from schemas.signing import check_event, click_token

KEY = b"k" * 32
FAST = RetryPolicy(attempts=3, initial_s=0.0, max_s=0.01, jitter_s=0.0)
RESULT = {"accepted": 1, "rejected": []}


def scripted(*answers: tuple[int, dict[str, str]]) -> tuple[list[httpx.Request], httpx.MockTransport]:
    """A transport answering `answers` in turn (status, headers), recording each request."""
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        status, headers = answers[min(len(seen), len(answers) - 1)]
        seen.append(request)
        return httpx.Response(status, json=RESULT if status < 300 else {"detail": "no"}, headers=headers)

    return seen, httpx.MockTransport(handle)


def response() -> AdResponse:
    ads = [
        ServedAd(
            ad_id=f"ad{i}", campaign_id="c1", score=1.0, pctr=0.1, price=0.2,
            click_token=click_token(KEY, f"r1/{i}", "u1", f"ad{i}"),
        )
        for i in range(2)
    ]  # fmt: skip
    return AdResponse(
        request_id="r1",
        ads=ads,
        degraded=False,
        stage_ms=StageMs(recall=0, rank=0, rerank=0),
        model_version="m",
    )


def test_rate_limited_and_overloaded_answers_are_retried_then_succeed() -> None:
    seen, transport = scripted((429, {"Retry-After": "0"}), (503, {}), (200, {}))
    with AdstreamClient("http://x", api_key="pub-1", retry=FAST, transport=transport) as client:
        result = client.events([click_for(response(), 0, "u1")])
    assert result.accepted == 1 and len(seen) == 3
    assert {r.headers["x-api-key"] for r in seen} == {"pub-1"}
    assert [json.loads(r.content)["events"][0]["event_id"] for r in seen] == ["c/r1/0"] * 3  # same batch


def test_the_render_beacon_call_sends_the_view_of_the_served_ad() -> None:
    seen, transport = scripted(
        (200, {}),
    )
    with AdstreamClient("http://x", retry=FAST, transport=transport) as client:
        assert client.view(response(), 1, "u1").accepted == 1
    [sent] = json.loads(seen[0].content)["events"]
    assert seen[0].url.path == "/v1/events"
    assert (sent["kind"], sent["event_id"], sent["impression_id"]) == ("view", "v/r1/1", "r1/1")
    assert sent["click_token"] == click_token(KEY, "r1/1", "u1", "ad1")


def test_retries_stop_after_the_policys_attempts() -> None:
    seen, transport = scripted((503, {"Retry-After": "0"}))
    with (
        AdstreamClient("http://x", retry=FAST, transport=transport) as client,
        pytest.raises(AdstreamHTTPError) as info,
    ):
        client.events([click_for(response(), 1, "u1")])
    assert info.value.status == 503 and len(seen) == 3


@pytest.mark.parametrize("status", [400, 401, 413, 415, 422])
def test_client_errors_are_final(status: int) -> None:
    seen, transport = scripted((status, {}))
    with (
        AdstreamClient("http://x", retry=FAST, transport=transport) as client,
        pytest.raises(AdstreamHTTPError) as info,
    ):
        client.events([])
    assert info.value.status == status and info.value.detail == "no" and len(seen) == 1


def test_connection_errors_are_retried() -> None:
    calls = []

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) < 2:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json=RESULT)

    with AdstreamClient("http://x", retry=FAST, transport=httpx.MockTransport(handle)) as client:
        assert client.events([]).accepted == 1
    assert len(calls) == 2


async def test_async_client_retries_the_same_way() -> None:
    seen, transport = scripted((502, {}), (200, {}))
    async with AsyncAdstreamClient("http://x", retry=FAST, transport=transport) as client:
        result = await client.view(response(), 0, "u1")
    assert result.accepted == 1 and len(seen) == 2
    assert json.loads(seen[-1].content)["events"][0]["kind"] == "view"


def test_wait_honours_retry_after_beyond_the_backoff() -> None:
    from tenacity import RetryCallState, Retrying

    wait = FAST.tenacity_args()["wait"]
    state = RetryCallState(Retrying(), fn=None, args=(), kwargs={})
    state.set_exception((AdstreamHTTPError, AdstreamHTTPError(429, "slow down", retry_after=2.0), None))
    assert wait(state) == 2.0
    state = RetryCallState(Retrying(), fn=None, args=(), kwargs={})
    state.set_exception((AdstreamHTTPError, AdstreamHTTPError(503, "x"), None))
    assert 0 <= wait(state) <= FAST.max_s


def test_click_and_view_carry_the_served_token_and_verify() -> None:
    resp, ts = response(), datetime(2026, 12, 3, tzinfo=UTC)
    click, view = click_for(resp, 1, "u1", ts), view_for(resp, 1, "u1", ts)
    dwell = dwell_for(resp, 1, "u1", 1500, ts)
    assert (click.impression_id, click.event_id, view.event_id) == ("r1/1", "c/r1/1", "v/r1/1")
    assert (view.kind, view.impression_id, dwell.event_id, dwell.dwell_ms) == ("view", "r1/1", "d/r1/1", 1500)
    assert all(check_event(e, KEY) is None for e in (click, view, dwell))
    assert check_event(view_for(resp, 1, "u2", ts), KEY) is not None  # not served to u2: refused
    assert check_event(click_for(resp, 1, "u2", ts), KEY) is not None  # another user: refused
    with pytest.raises(SchemaError, match="position 5"):
        click_for(resp, 5, "u1")


def test_retry_policy_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
