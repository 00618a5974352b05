"""API fuzz: schemathesis against the running ad server's own OpenAPI document (issue 14).

Every operation is driven with schema-valid (positive) and schema-violating (negative) requests,
admin routes with and without the token. Each answer must be below 500, and every error must
say what was wrong: a 422 lists each field (`detail[i].loc`), any other 4xx carries a `detail`
sentence. `test_api_fuzz_full` sends ≥ 10,000 requests (slow); `test_api_fuzz_quick` a few
hundred, in the default run.
"""

from __future__ import annotations

import collections
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from helpers_serving import ADMIN
from hypothesis import HealthCheck, Phase
from schemathesis.generation import GenerationMode

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.kafka]


def _check(resp: httpx.Response, label: str) -> None:
    assert resp.status_code < 500, f"{label}: {resp.status_code} {resp.text[:300]}"
    if resp.status_code < 400:
        return
    body = resp.json()
    if resp.status_code == 422 and "rejected" in body:  # /v1/events: no event of the batch accepted
        assert body["accepted"] == 0 and body["rejected"], f"{label}: 422 names no refused event"
        for r in body["rejected"]:
            assert {"index", "field", "reason", "message"} <= set(r), f"{label}: refusal unnamed: {r}"
        return
    assert "detail" in body, f"{label}: {resp.status_code} without a detail: {resp.text[:300]}"
    if resp.status_code == 422:
        errors = body["detail"]
        assert isinstance(errors, list) and errors, f"{label}: 422 without field errors"
        for e in errors:
            assert e.get("loc") and e.get("msg"), f"{label}: 422 error names no field: {e}"
    else:
        assert isinstance(body["detail"], str) and body["detail"], f"{label}: {body}"


def _fuzz(server: httpx.Client, budget: dict[tuple[str, str], int]) -> collections.Counter[str]:
    base = str(server.base_url).rstrip("/")
    schema = schemathesis.openapi.from_dict(server.get("/openapi.json").json())
    seen: collections.Counter[str] = collections.Counter()
    client = httpx.Client(base_url=base, timeout=30)
    try:
        for op in schema.get_all_operations():
            operation = op.ok()
            label = f"{operation.method.upper()} {operation.path}"
            admin = operation.path.startswith("/v1/adapters")
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                n = budget.get((label, mode.value), budget.get(("*", mode.value), 0))
                if n == 0:
                    continue

                run = _runner(client, base, operation, mode, n, label, admin, seen)
                try:
                    run()
                except hypothesis.errors.Unsatisfiable:
                    # an operation without parameters or body has nothing to violate (negative mode)
                    seen[f"unsatisfiable {label} [{mode.value}]"] += 1
    finally:
        client.close()
    return seen


def _runner(
    client: httpx.Client,
    base: str,
    operation: Any,
    mode: GenerationMode,
    n: int,
    label: str,
    admin: bool,
    seen: collections.Counter[str],
) -> Any:
    """A hypothesis test sending `n` generated requests of `operation` in `mode`."""

    @hypothesis.settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        kw = case.as_transport_kwargs(base_url=base)
        headers = dict(kw.get("headers") or {})
        if admin and mode is GenerationMode.POSITIVE and seen[label] % 2 == 0:
            headers.update(ADMIN)
        resp = client.request(
            kw["method"], kw["url"], params=kw.get("params"), headers=headers,
            content=_content(kw), cookies=kw.get("cookies"),
        )  # fmt: skip
        seen[label] += 1
        seen[f"status {resp.status_code}"] += 1
        _check(resp, f"{label} [{mode.value}] {case.body!r:.200}")

    return run


def _content(kw: dict[str, Any]) -> bytes | None:
    import json

    if "json" in kw:
        return json.dumps(kw["json"]).encode()
    data = kw.get("data")
    if isinstance(data, str):
        return data.encode()
    return data  # type: ignore[no-any-return]


def test_api_fuzz_quick(server: httpx.Client) -> None:
    seen = _fuzz(
        server,
        {
            ("POST /v1/ads", "positive"): 150,
            ("POST /v1/ads", "negative"): 150,
            ("POST /v1/events", "positive"): 100,
            ("POST /v1/events", "negative"): 100,
            ("POST /v1/rank", "positive"): 60,
            ("POST /v1/rank", "negative"): 60,
            ("*", "positive"): 15,
            ("*", "negative"): 15,
        },
    )
    assert sum(v for k, v in seen.items() if not k.startswith(("status", "unsatisfiable"))) >= 300
    assert seen["status 200"] and seen["status 422"]


@pytest.mark.slow
def test_api_fuzz_full(server: httpx.Client) -> None:
    """≥ 10,000 generated requests; prints the status counts."""
    seen = _fuzz(
        server,
        {
            ("POST /v1/ads", "positive"): 5000,
            ("POST /v1/ads", "negative"): 5000,
            ("*", "positive"): 300,
            ("*", "negative"): 300,
        },
    )
    total = sum(v for k, v in seen.items() if not k.startswith(("status", "unsatisfiable")))
    print(f"api fuzz: {total} requests; {dict(sorted(seen.items()))}")
    assert total >= 10_000
