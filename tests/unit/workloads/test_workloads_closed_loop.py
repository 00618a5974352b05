"""The closed loop against a small fake serving endpoint that speaks the HTTP contract."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from schemas.api import SHADOW_HEADER, AdRequest, AdResponse, ServedAd, StageMs
from schemas.codec import decode_any, encode
from schemas.events import Click, Dwell, Message, View
from schemas.ids import impression_event_id
from schemas.signing import check_event, click_token
from workloads import Market, MarketConfig
from workloads.closed_loop import run_closed_loop, served_auc

KEY = b"f" * 32  # the fake replica's event key


class FakeServing(BaseHTTPRequestHandler):
    """Serves the first k ads of a catalog (rotating), or misbehaves on request numbers in `bad`."""

    catalog: ClassVar[list[tuple[str, str]]] = []
    bad: ClassVar[dict[int, str]] = {}
    seen: ClassVar[list[AdRequest]] = []
    # request number → the shadow slate header it answers with ("reverse": the served ads reversed)
    shadow: ClassVar[dict[int, str]] = {}

    def log_message(self, *args: object) -> None:
        return None

    def do_POST(self) -> None:
        n = len(self.seen)
        body = self.rfile.read(int(self.headers["content-length"]))
        req = AdRequest.model_validate_json(body)
        self.seen.append(req)
        mode = self.bad.get(n)
        if mode == "500":
            self.send_response(500)
            self.end_headers()
            return
        ads = [  # each ad with its click token, as a replica gives it
            ServedAd(
                ad_id=a, campaign_id=c, score=1.0 - i / 10, pctr=0.05, price=0.5,
                click_token=click_token(KEY, impression_event_id(f"req{n}", i), req.user_id, a),
            )
            for i, (a, c) in enumerate(self.catalog[n % 3 : n % 3 + req.k])
        ]  # fmt: skip
        stage = StageMs(recall=1.0, rank=2.0, rerank=0.5)
        resp = AdResponse(
            request_id=f"req{n}", ads=ads, degraded=False, stage_ms=stage, model_version="fake-1"
        )
        payload = resp.model_dump_json().encode()
        if mode == "invalid":
            payload = json.dumps({"request_id": "x"}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        header = self.shadow.get(n)
        if header is not None:
            ids = [a.ad_id for a in ads]
            rows = {"reverse": json.dumps(ids[::-1]), "same": json.dumps(ids)}
            self.send_header(SHADOW_HEADER, rows.get(header, header))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def fake_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


async def test_closed_loop_responds_to_what_was_served(fake_server: str) -> None:
    market = Market(MarketConfig(seed=11, n_users=50, n_ads=20, bias=-1.5, drift_at=None, new_ads_at=None))
    FakeServing.catalog = [(c.ad_id, c.campaign_id) for c in market.catalog()]
    FakeServing.bad = {3: "500", 5: "invalid"}
    FakeServing.seen = []
    FakeServing.shadow = {}
    emitted: list[Message] = []

    async def sink(batch: list[Message]) -> None:
        emitted.extend(batch)

    report = await run_closed_loop(market, fake_server, 60, sink)
    assert report.requests == 60 and len(FakeServing.seen) == 60
    assert report.errors == {"http_500": 1, "invalid_response": 1}
    assert {r.user_id for r in FakeServing.seen} <= {market.user_id(i) for i in range(50)}
    assert (
        report.served
        == len(report.impressions)
        == sum(r.k for r in FakeServing.seen) - sum(FakeServing.seen[i].k for i in (3, 5))
    )
    served_ids = {imp.event_id for imp in report.impressions}
    assert impression_event_id("req0", 0) in served_ids
    clicks = [m for m in emitted if isinstance(m, Click)]
    assert clicks, "with bias -1.5 some of ~100 impressions must be clicked"
    assert all(c.impression_id in served_ids for c in clicks)
    assert len([m for m in emitted if isinstance(m, Dwell)]) == len(clicks)
    # every served ad is shown: its render beacon a second after serving (an impression from then)
    views = [m for m in emitted if isinstance(m, View)]
    assert sorted(v.impression_id for v in views) == sorted(served_ids)
    assert all(v.event_id == f"v/{v.impression_id}" for v in views)
    # every view, click and dwell echoes the served ad's token: the worker would take each of them
    assert all(check_event(m, KEY) is None for m in emitted if isinstance(m, View | Click | Dwell))
    for m in emitted:
        assert decode_any(encode(m)) == m
    for imp in report.impressions:
        assert market.oracle_pctr(imp) == pytest.approx(
            market.true_pctr(imp.user_id, imp.ad_id, imp.slot, imp.position)
        )
    assert sum(report.events.values()) == len(emitted)
    assert 0.0 <= served_auc(report, market) <= 1.0  # the served pCTR against those clicks


async def test_closed_loop_counts_a_dead_endpoint_instead_of_crashing() -> None:
    market = Market(MarketConfig(seed=12, n_users=5, n_ads=5))
    emitted: list[Message] = []

    async def sink(batch: list[Message]) -> None:
        emitted.extend(batch)

    report = await run_closed_loop(market, "http://127.0.0.1:9", 3, sink, timeout_s=0.5)
    assert report.errors == {"transport": 3}
    assert report.served == 0
    assert math.isnan(served_auc(report, market))  # nothing served: no AUC


def test_closed_loop_command_writes_the_users_responses(fake_server: str, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from deploy.cli import app

    market = Market(MarketConfig(seed=3, n_users=50, n_ads=20))
    FakeServing.catalog = [(c.ad_id, c.campaign_id) for c in market.catalog()]
    FakeServing.bad = {}
    FakeServing.seen = []
    out = tmp_path / "loop.jsonl"
    args = ["closed-loop", "--url", fake_server, "--requests", "40", "--rate", "0", "--users", "50",
            "--ads", "20", "--seed", "3", "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert len(FakeServing.seen) == 40
    kinds = {decode_any(line).kind for line in out.read_bytes().splitlines()}  # type: ignore[attr-defined]
    assert kinds <= {"view", "click", "dwell", "conversion", "ad"}
    assert "oracle AUC" in result.output


async def test_closed_loop_requests_say_the_audience_and_search_text(fake_server: str) -> None:
    """The loop's requests carry what a publisher knows (issue 34): country and device on every
    request, a query on search requests, so serving's targeting and query recall are exercised."""
    market = Market(MarketConfig(seed=5, n_users=40, n_ads=20, drift_at=None, new_ads_at=None))
    FakeServing.catalog = [(c.ad_id, c.campaign_id) for c in market.catalog()]
    FakeServing.bad = {}
    FakeServing.seen = []

    async def sink(batch: list[Message]) -> None:
        return None

    await run_closed_loop(market, fake_server, 60, sink)
    seen = FakeServing.seen
    assert len(seen) == 60 and all(r.geo and r.device for r in seen)
    for r in seen:
        assert (r.geo, r.device) == market.audience.of(int(r.user_id[1:]))
    assert {r.slot for r in seen if r.query} == {"search"}
    assert all(r.query for r in seen if r.slot == "search")


async def test_closed_loop_scores_each_shadow_slate_and_its_served_one_by_the_truth(fake_server: str) -> None:
    market = Market(MarketConfig(seed=13, n_users=40, n_ads=20, drift_at=None, new_ads_at=None))
    FakeServing.catalog = [(c.ad_id, c.campaign_id) for c in market.catalog()]
    FakeServing.bad, FakeServing.seen = {}, []
    # request 1: the served ads reversed; 2: the same slate; 4: a header that is not a list of ids
    FakeServing.shadow = {1: "reverse", 2: "same", 4: '{"not": "a list"}', 6: "reverse"}

    async def sink(batch: list[Message]) -> None:
        return None

    report = await run_closed_loop(market, fake_server, 8, sink)
    FakeServing.shadow = {}
    assert report.errors == {"invalid_shadow": 1}  # request 4: counted, its response still served
    assert report.served == sum(r.k for r in FakeServing.seen)
    assert [p.request_id for p in report.shadows] == ["req1", "req2", "req6"]
    for pair in report.shadows:
        n = int(pair.request_id[3:])
        req, imps = FakeServing.seen[n], [i for i in report.impressions if i.request_id == pair.request_id]
        served = [i.ad_id for i in imps]
        shadow = served[::-1] if n != 2 else served
        assert pair.user_id == req.user_id
        # impressions served before this request's: the earlier requests' k
        assert pair.served_index == sum(r.k for r in FakeServing.seen[:n])
        by_hand = [sum(market.true_pctr(req.user_id, a, req.slot, pos) for pos, a in enumerate(ads))
                   for ads in (served, shadow)]  # fmt: skip
        assert (pair.served, pair.shadow) == pytest.approx(by_hand)
        assert pair.same == (served == shadow)
    assert report.shadows[1].same and report.shadows[1].served == report.shadows[1].shadow
