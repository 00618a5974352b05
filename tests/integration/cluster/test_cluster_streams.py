"""The whole loop on a two-node Ray cluster on one box, with a worker and a node killed mid-load.

`ray start --head` and a second `ray start` node (ports 18300–18373, own temp dir and token), the
Serve app with one replica on each (`deploy.cluster.deploy_spread`), two `adstream worker`s (on
each engine: faust, aiokafka) and two `adstream trainer`s each owning a share of their topics'
partitions (one consumer group each), all started from one `adstream init`. The closed loop
(`workloads.closed_loop`: users ask the balancer for ads, serving produces the impressions, the
users' clicks, dwell and conversions are produced to Kafka) runs against the balancer; mid-load
one worker is killed with SIGKILL and so is every process of the second Ray node. Afterwards:

* the load went on through the balancer (outcomes per 10 s window, no client retries);
* the survivor took the dead worker's partitions over: how long each partition's first record
  after the kill waited to be applied (the longest: the rebalance time);
* every event on the four user topics is in ClickHouse exactly once by event id, none missing,
  none extra, after the merge that collapses a batch the survivor inserted again (the rows
  before that merge are printed), and every user's state in Redis counts each of the user's
  events once;
* both trainers published deltas, and the surviving replica holds every adapter at the last
  seq on the deltas topic.

Slow (minutes on 2 cores). Figures are printed (`pytest -s`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import secrets
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from deploy.cluster import RayNode, RayPorts, kill_ray_node, ray_node_argv, session_pids, start_ray_node_up
from schemas import topics
from schemas.codec import MODEL_BY_TOPIC, topic_of
from schemas.settings import Settings
from schemas.user_record import read_user_state
from streams.state import USER_EVENTS
from tests.integration.cluster import ledger
from tests.integration.cluster.test_ray_two_nodes import cluster_view, wait_for
from tests.integration.deploy.harness import metric
from tests.integration.deploy.loop import Isolation, replica_urls

pytestmark = [pytest.mark.ray, pytest.mark.kafka, pytest.mark.redis, pytest.mark.clickhouse,
              pytest.mark.slow, pytest.mark.timeout(2400)]  # fmt: skip

ROOT = Path(__file__).resolve().parents[3]
BIN = ROOT / ".venv" / "bin"
GCS_PORT, DASHBOARD_PORT, CLIENT_PORT, HTTP_PORT = 18300, 18301, 18302, 18360
HEAD_PORTS = RayPorts(18304, 18305, 18303, 18307, 18306, 18308, 18310, 18329)
NODE_PORTS = RayPorts(18334, 18335, 18333, 18337, 18336, 18338, 18340, 18359)
HEAD_INGRESS, NODE_INGRESS = (18361, 18364), (18365, 18368)
WORKER_METRICS, TRAINER_METRICS = (18370, 18371), (18372, 18373)
USERS, ADS, SEED = 150, 60, 11
SESSION, HEARTBEAT = "ADSTREAM_KAFKA__SESSION_TIMEOUT_MS", "ADSTREAM_KAFKA__HEARTBEAT_INTERVAL_MS"
RATE, BEFORE_S, AFTER_S = 6.0, 45.0, 60.0  # closed-loop requests per second; seconds of load


def _env(stack: Settings, iso: Isolation, keys: dict[str, str], ingress: tuple[int, int]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ADSTREAM_", "RAY_"))}
    env.update(iso.overrides() | keys | {
        "PATH": f"{BIN}:{env.get('PATH', '')}", "PYTHONUNBUFFERED": "1",
        "RAY_AUTH_MODE": "token",
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_HAPROXY_NBTHREAD": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(ingress[0]),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(ingress[1]),
        "RAY_worker_niceness": "0", "RAY_agent_register_timeout_ms": "180000",
        "RAY_raylet_start_wait_time_s": "120",
        "ADSTREAM_REDIS__URL": stack.redis.url, "ADSTREAM_CLICKHOUSE__URL": iso.clickhouse_url,
        "ADSTREAM_KAFKA__BOOTSTRAP": stack.kafka.bootstrap,
        # one adapter per advertiser: enough adapters that both trainers own some
        "ADSTREAM_ADAPTER_SCHEME": "advertiser",
        "ADSTREAM_SINK__FLUSH_S": "0.5", "ADSTREAM_ONLINE__SNAPSHOT_EVERY_S": "10",
        # the suite's short group timeouts (tests/conftest.py), for the CLIs too
        "ADSTREAM_KAFKA__SESSION_TIMEOUT_MS": os.environ.get(SESSION, "3000"),
        "ADSTREAM_KAFKA__HEARTBEAT_INTERVAL_MS": os.environ.get(HEARTBEAT, "500"),
    })  # fmt: skip
    return env


class Procs:
    """The `adstream` processes of the run (own sessions: killed as a whole)."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.killed: set[str] = set()
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, *argv: str, env: dict[str, str] | None = None) -> None:
        with (self.logs / f"{name}.log").open("ab") as out:
            self.procs[name] = subprocess.Popen(
                [str(BIN / "adstream"), *argv], env=self.env | (env or {}), stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT,
            )  # fmt: skip

    def alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None and name not in self.killed:
                raise AssertionError(f"{name} exited {p.returncode}:\n{self.tail(name)}")

    def kill9(self, name: str) -> None:
        self.killed.add(name)
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait(10)

    def tail(self, name: str, n: int = 3000) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-n:]

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


@pytest.fixture(params=["faust", "aiokafka"])
def cluster(stack: Settings, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The run's deployment, its workers on the engine `request.param` (`adstream worker --engine`)."""
    iso = Isolation.make(stack, "mnw", tmp_path)
    keys = {"RAY_AUTH_TOKEN": secrets.token_hex(24),
            "ADSTREAM_SERVING__ADMIN_TOKEN": secrets.token_urlsafe(32),
            "ADSTREAM_EVENT_SIGNING_KEY": secrets.token_urlsafe(40),
            "ADSTREAM_DELTA_SIGNING_KEY": secrets.token_urlsafe(40)}  # fmt: skip
    env = _env(stack, iso, keys, HEAD_INGRESS)
    procs = Procs(env, tmp_path / "logs")
    nodes: list[RayNode] = []
    temp = Path("/tmp/ray-mnw")
    try:
        init = ["init", "--cold-start-impressions", "3000", "--epochs", "1", "--threads", "1"]
        out = subprocess.run([str(BIN / "adstream"), *init], env=env, capture_output=True, text=True,
                             timeout=900, cwd=ROOT)  # fmt: skip
        assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
        ray = str(BIN / "ray")
        head = ray_node_argv(ray, HEAD_PORTS, temp, head_port=GCS_PORT, dashboard_port=DASHBOARD_PORT,
                             client_port=CLIENT_PORT)  # fmt: skip
        nodes.append(start_ray_node_up("head", head, env, tmp_path))
        node = ray_node_argv(ray, NODE_PORTS, temp, address=f"127.0.0.1:{GCS_PORT}")
        nodes.append(start_ray_node_up("node", node, _env(stack, iso, keys, NODE_INGRESS), tmp_path))
        for i in (0, 1):
            procs.start(f"worker{i}", "worker", "--loglevel", "warn", "--engine", request.param,
                        env={"ADSTREAM_METRICS__PORT": str(WORKER_METRICS[i])})  # fmt: skip
            procs.start(f"trainer{i}", "trainer", "--metrics-port", str(TRAINER_METRICS[i]))
        yield {"iso": iso, "env": env, "procs": procs, "nodes": nodes, "settings": iso.settings(stack),
               "admin": keys["ADSTREAM_SERVING__ADMIN_TOKEN"], "engine": request.param}  # fmt: skip
    finally:
        procs.stop()
        for n in reversed(nodes):
            kill_ray_node(n)
        time.sleep(2)
        for n in nodes:  # what was still starting (a worker spawned mid-kill)
            kill_ray_node(n)
        iso.clean(stack)
        leftover = [p for n in nodes for p in session_pids(n.proc.pid)]
        assert not leftover, leftover


def _deploy(env: dict[str, str], alive: Any) -> str:
    script = f"from deploy.cluster import deploy_spread; print(deploy_spread(2, {HTTP_PORT}))"
    ray_env = env | {"RAY_ADDRESS": f"127.0.0.1:{GCS_PORT}"}
    out = subprocess.run([str(BIN / "python"), "-c", script], env=ray_env, capture_output=True, text=True,
                         timeout=900, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    proxy = f"http://127.0.0.1:{HTTP_PORT}"
    wait_for(
        "the app through the balancer", lambda: httpx.get(f"{proxy}/healthz").status_code == 200, 300, alive
    )
    view = wait_for(
        "2 replicas", lambda: (c := cluster_view(ray_env)) and len(c["replicas"]) == 2 and c, 300, alive
    )
    assert sorted(view["replicas"]) == sorted(view["nodes"]) and len(view["nodes"]) == 2, view
    return proxy


def _scrape(port: int, name: str) -> float:
    return metric(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text, name)


class ClosedLoop:
    """`workloads.closed_loop` against the balancer in a thread of its own; every event it
    produces and every impression serving answered with, by id."""

    def __init__(self, s: Settings, proxy: str, requests: int) -> None:
        from workloads import Market, MarketConfig

        cfg = MarketConfig(seed=SEED, n_users=USERS, n_ads=ADS, drift_at=None, new_ads_at=None, n_new_ads=0)
        self.market, self.s, self.proxy, self.n = Market(cfg), s, proxy, requests
        self.client = ledger.CountingClient(base_url=proxy, timeout=10.0)
        self.produced: set[tuple[str, str]] = set()  # (contract topic, event id) the loop produced (acked)
        self.report: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def catalog(self) -> None:
        from workloads.sinks import KafkaSink

        async def go() -> None:
            async with KafkaSink(self.s) as sink:
                await sink.send_many(self.market.catalog())

        asyncio.run(go())

    def _run(self) -> None:
        from workloads.closed_loop import ClosedLoopReport, run_closed_loop
        from workloads.sinks import KafkaSink

        self.report = ClosedLoopReport()

        async def go() -> None:
            async with KafkaSink(self.s) as sink, self.client:

                async def send(batch: list[Any]) -> None:
                    await sink.send_many(batch)
                    self.produced.update((topic_of(m), m.event_id) for m in batch)

                await run_closed_loop(self.market, self.proxy, self.n, send, rate=RATE,
                                      client=self.client, report=self.report)  # fmt: skip

        try:
            asyncio.run(go())
        except BaseException as exc:
            self.error = exc


def _start(procs: Procs, env: dict[str, str], alive: Any) -> tuple[str, list[str]]:
    """Serve deployed, both replicas with the catalog, every worker and trainer up."""
    proxy = _deploy(env, alive)

    def direct() -> list[str] | None:
        urls = replica_urls(range(HEAD_INGRESS[0], NODE_INGRESS[1] + 1))
        return urls if len(urls) == 2 else None

    replicas = wait_for("both replicas' direct ports", direct, 120, alive)

    def catalog() -> bool:
        return all(_scrape_url(u, "adstream_serving_catalog_ads") >= ADS for u in replicas)

    wait_for("the catalog in both replicas", catalog, 180, alive)
    for port in (*WORKER_METRICS, *TRAINER_METRICS):
        wait_for(f"metrics on :{port}", functools.partial(_answers, port), 300, alive)
    return proxy, replicas


def _answers(port: int) -> bool:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200


def _scrape_url(url: str, name: str) -> float:
    return metric(httpx.get(f"{url}/metrics", timeout=5).text, name)


Topics = dict[str, list[ledger.Record]]
# the topics whose events a user's state counts (`streams.state.USER_EVENTS`)
STATE_TOPICS = tuple(t for t, model in MODEL_BY_TOPIC.items() if model in USER_EVENTS)


def _stored_once(s: Settings, on_topics: Topics, rejected: set[str]) -> dict[str, Any]:
    """Per table: the event ids on its topic (but those the worker must reject) against the rows
    in ClickHouse, before and after the merge (`OPTIMIZE … FINAL`) that collapses a batch
    inserted again by the worker that took the partition over."""
    tables: dict[str, Any] = {}
    for topic, table in ledger.TABLES.items():
        ids = Counter(e for e in ledger.event_ids(on_topics[topic]) if e not in rejected)
        before = ledger.stored(s, table)
        rows = ledger.stored_ids(s, table, optimize=True)
        tables[table] = {
            "on_topic": len(ids), "topic_duplicates": sum(n - 1 for n in ids.values()),
            "rows_before_merge": before["raw"], "final": before["final"], "distinct": before["distinct"],
            "rows_after_merge": sum(rows.values()), "missing": len(ids.keys() - rows.keys()),
            "extra": len(rows.keys() - ids.keys()),
            "doubled_after_merge": sum(1 for n in rows.values() if n > 1),
        }  # fmt: skip
    return tables


def _wrong_states(r: Any, s: Settings, on_topics: Topics, rejected: set[str]) -> list[Any]:
    """Users whose state in Redis does not count each of their events on the topics (but those
    the worker must reject) once; the counters do not depend on the order of the topics' merge."""
    kept = {
        t: [x for x in on_topics[t] if json.loads(x.value)["event_id"] not in rejected] for t in STATE_TOPICS
    }
    events = ledger.users_of([x for recs in kept.values() for x in recs])
    imps = ledger.users_of(kept[topics.IMPRESSIONS])
    clicks = ledger.users_of(kept[topics.CLICKS])
    wrong = []
    for user, n in events.items():
        st = read_user_state(r, s.redis_prefix, user)
        got = (st.events, st.impressions, st.clicks) if st else None
        if got != (n, imps[user], clicks[user]):
            wrong.append((user, got, (n, imps[user], clicks[user])))
    return wrong


def _adapters_behind(s: Settings, proxy: str, token: str) -> dict[str, tuple[int, int]]:
    """Adapter → (seq the serving replica holds, last seq on the deltas topic), where behind."""
    last: dict[str, int] = {}
    for rec in ledger.read_topic(s, topics.ADAPTER_DELTAS):
        d = json.loads(rec.value)
        last[d["adapter_id"]] = max(last.get(d["adapter_id"], -1), d["seq"])
    body = httpx.get(f"{proxy}/v1/adapters", headers={"Authorization": f"Bearer {token}"}, timeout=10).json()
    held = {a["adapter_id"]: a["seq"] for a in body}
    return {a: (held.get(a, -1), q) for a, q in last.items() if held.get(a, -1) < q}


def _trainers(s: Settings, proxy: str, token: str) -> dict[str, Any]:
    """Both trainers' deltas and adapters; the surviving replica caught up with every adapter."""
    behind = _adapters_behind(s, proxy, token)
    for _ in range(12):
        if not behind:
            break
        time.sleep(5)
        behind = _adapters_behind(s, proxy, token)
    return {
        "deltas_published": [_scrape(p, "adstream_trainers_deltas_total") for p in TRAINER_METRICS],
        "adapters_owned": [_scrape(p, "adstream_trainers_adapters") for p in TRAINER_METRICS],
        "examples_learned": [_scrape(p, "adstream_trainers_examples_total") for p in TRAINER_METRICS],
        "duplicate_examples_skipped": [
            _scrape(p, "adstream_trainers_duplicate_examples_total") for p in TRAINER_METRICS
        ],
        "adapters_behind_in_survivor": behind,
    }


def test_streams_and_trainers_survive_losing_a_worker_and_a_node(cluster: dict[str, Any]) -> None:
    s, env, procs, nodes = cluster["settings"], cluster["env"], cluster["procs"], cluster["nodes"]

    def alive() -> None:
        procs.alive()
        for n in nodes[: 1 if "node" in procs.killed else 2]:
            assert n.proc.poll() is None, f"{n.name} exited:\n{n.log.read_text()[-2000:]}"

    loop = ClosedLoop(s, f"http://127.0.0.1:{HTTP_PORT}", int(RATE * (BEFORE_S + AFTER_S)))
    loop.catalog()
    proxy, _ = _start(procs, env, alive)
    r = redis.Redis.from_url(s.redis.url)
    t_start = time.monotonic()
    loop.thread.start()

    # both workers hold partitions (each has consumed something) before one of them goes
    def consuming() -> bool:
        return all(_scrape(p, "adstream_streams_events_in_total") > 0 for p in WORKER_METRICS)

    wait_for("both workers consuming", consuming, 300, alive)
    while time.monotonic() - t_start < BEFORE_S:
        alive()
        time.sleep(1)
    in_before = [_scrape(p, "adstream_streams_events_in_total") for p in WORKER_METRICS]
    t_kill = time.monotonic()
    watch = ledger.ProgressWatch(r, s)
    procs.kill9("worker1")
    killed = kill_ray_node(nodes[1])
    procs.killed.add("node")
    loop.thread.join(AFTER_S * 10 + 600)
    t_end = time.monotonic()
    assert not loop.thread.is_alive(), "the closed loop did not finish"
    assert loop.error is None, repr(loop.error)

    # the survivor applies everything on the topics (Redis offsets written with the states); the
    # last offsets from the records themselves: Tansu's end offsets can be short (docs/limitations)
    on_topics = {t: ledger.read_topic(s, t) for t in {*ledger.TABLES, *STATE_TOPICS}}
    ends = ledger.last_offsets(s, on_topics)

    def all_applied() -> bool:
        done = ledger.applied_offsets(r, s)
        return all(done.get(k, -1) >= v for k, v in ends.items())

    wait_for("every record applied", all_applied, 600, alive)
    waits = watch.close()
    count = loop.client.count
    on_any = {(t, e) for t, recs in on_topics.items() for e in ledger.event_ids(recs)}
    served = {i.event_id for i in loop.report.impressions}
    # what the worker must dead-letter: events dated too far after their record (see ledger)
    rejected = {
        e for recs in on_topics.values() for e in ledger.ahead_of_time(recs, s.streams.max_event_skew_s)
    }
    read = {topics.topic_name(t, s.topic_prefix) for t in on_topics}
    dead = [d for d in ledger.dead_letters(s) if d["topic"] in read]
    wrong = _wrong_states(r, s, on_topics, rejected)
    figures: dict[str, Any] = {
        "engine": cluster["engine"],
        "killed_node_processes": len(killed),
        "worker_events_in_before_kill": in_before,
        "requests": {"before_kill": count(t_start, t_kill), "kill_to_15s": count(t_kill, t_kill + 15),
                     "after_15s": count(t_kill + 15, t_end)},
        "windows_10s_before_kill": ledger.windows(loop.client.log, t_start, t_kill, 10.0),
        "windows_10s_from_kill": ledger.windows(loop.client.log, t_kill, t_end, 10.0),
        # per partition: how long its first record after the kill waited to be applied
        "first_record_wait_s_after_kill": waits,
        "rebalance_s": max(waits.values()) if waits else None,
        "tables": _stored_once(s, on_topics, rejected),
        "produced_by_loop": dict(Counter(t for t, _ in loop.produced)),
        # the loop's acknowledged events of the topics read that are not there
        "loop_events_not_on_topics": len({p for p in loop.produced if p[0] in on_topics} - on_any),
        "dead_letters": {"records": len(dead), "distinct_events": len({d["event_id"] for d in dead}),
                         "expected": len(rejected), "first": dead[:3]},
        "served_impressions": len(served),
        # answered 2xx but never produced: queued in the killed replica's impression sender
        "served_impressions_not_on_topic": len(served - set(ledger.event_ids(on_topics[topics.IMPRESSIONS]))),
        "user_states": {"users": len(ledger.users_of([x for v in on_topics.values() for x in v])),
                        "wrong": len(wrong), "wrong_first": wrong[:5]},
        "trainers": _trainers(s, proxy, cluster["admin"]),
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
    }  # fmt: skip
    print("multi-node streams figures:", json.dumps(figures, indent=1, default=str))

    assert count(t_start, t_kill).get("2xx", 0) > 0
    after = figures["requests"]["after_15s"]
    assert after.get("2xx", 0) / max(1, sum(after.values())) >= 0.95, after  # traffic continues
    assert len(killed) > 0 and in_before[1] > 0
    assert not figures["loop_events_not_on_topics"]
    assert {d["event_id"] for d in dead} == rejected, dead  # dead-lettered: those, and no other
    for table, t in figures["tables"].items():
        assert t["missing"] == t["extra"] == t["doubled_after_merge"] == 0, (table, t)
        assert t["final"] == t["distinct"] == t["on_topic"] - t["topic_duplicates"], (table, t)
    assert not wrong, wrong[:5]
    trainers = figures["trainers"]
    assert all(p > 0 for p in trainers["deltas_published"]), trainers  # both owned adapters
    assert not trainers["adapters_behind_in_survivor"], trainers
