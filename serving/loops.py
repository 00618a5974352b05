"""The ad server replica's start-up loading and background loops (catalog, adapter deltas, clicks,
counters, spend and canary): `ReplicaLoops`, a part of `serving.app.AdServer` built with the
collaborators it needs; everything here runs on the replica's event loop between requests.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any

from schemas import topics
from schemas.events import AdapterDelta, AdCreative, Campaign, Click, Message
from schemas.settings import Settings
from schemas.signing import check_event
from serving.adapters import CANDIDATE, STABLE
from serving.canary import Canary
from serving.catalog import Catalog
from serving.hotswap import DeltaApplier
from serving.io import RedisIO, follow
from serving.metrics import ServingMetrics
from serving.pipeline import AdPipeline, utcnow
from serving.ranking import RankModel
from serving.towers import TowerSpace
from serving.variant_feedback import VariantFeedback, wanted

log = logging.getLogger(__name__)


def read_catalog_file(path: str | os.PathLike[str]) -> list[AdCreative]:
    """The ads of a JSON-lines catalog file (`read_catalog_entries`)."""
    return read_catalog_entries(path)[0]


def read_catalog_entries(path: str | os.PathLike[str]) -> tuple[list[AdCreative], list[Campaign]]:
    """The ads and campaigns of a JSON-lines catalog file (`serving.catalog_file`): every line
    whose `kind` is `ad` (or absent: the contract's default) or `campaign`; other events are
    skipped, blank lines too.

    Each line is parsed as JSON, not searched for the text `"kind":"ad"` (an ad spelled with a
    tab or without `kind` was left out). A line that is not a JSON object, or an entry the
    contract refuses, raises SchemaError naming `file:line`: a replica must not start on a catalog
    that is silently short.
    """
    import json

    from schemas.codec import decode
    from schemas.errors import SchemaError

    ads: list[AdCreative] = []
    campaigns: list[Campaign] = []
    with open(path, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{os.fspath(path)}:{n}"
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise SchemaError(f"{where}: not JSON ({exc})") from exc
            if not isinstance(obj, dict):
                raise SchemaError(f"{where}: not a JSON object")
            kind = obj.get("kind", "ad")
            if kind not in ("ad", "campaign"):
                continue
            try:
                msg = decode(AdCreative if kind == "ad" else Campaign, line)
            except SchemaError as exc:
                raise SchemaError(f"{where}: {exc}") from exc
            if isinstance(msg, AdCreative):
                ads.append(msg)
            else:
                assert isinstance(msg, Campaign)
                campaigns.append(msg)
    return ads, campaigns


class ReplicaLoops:
    """Start-up loading and background loops of a serving replica, owned by its `AdServer`.

    Built with exactly what the loops read and write; `start()` loads the trainers' snapshots and
    the admin pins, then runs each loop supervised (restarted with a backoff when it ends or
    raises); `stop()` cancels them and writes the pending counters. Everything here runs on the
    replica's event loop between requests.
    """

    def __init__(  # noqa: PLR0913 - settings, metrics and the replica's parts, keyword-only
        self,
        settings: Settings,
        metrics: ServingMetrics,
        *,
        rank: RankModel,
        catalog: Catalog,
        pipe: AdPipeline,
        towers: TowerSpace | None,
        applier: DeltaApplier,
        canary: Canary,
        redis: RedisIO,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.rank = rank
        self.catalog = catalog
        self.pipe = pipe
        self.towers = towers
        self.applier = applier
        self.canary = canary
        self.redis = redis
        self.max_swap_pause_s = 0.0  # the longest a delta swap held the loop (and every request)
        self.max_swap_pause_cpu_s = 0.0  # of which the loop thread's own CPU time
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._restarts: dict[str, int] = {}
        # each adapter's re-sync from its snapshot while it runs (`_start_resync`)
        self._resyncs: dict[str, asyncio.Task[str]] = {}
        # where each follower left off survives reconnects and task restarts: never a full replay
        self._positions: dict[str, dict[int, int]] = {}

    # -- life cycle -------------------------------------------------------------------------
    def load_catalog_file(self) -> None:
        """Start-up: the ads of `serving.catalog_file` (a no-op without one)."""
        path = self.settings.serving.catalog_file
        if path is None:
            return
        ads, campaigns = read_catalog_entries(path)
        for campaign in campaigns:
            self.catalog.upsert_campaign(campaign)
        vectors = self.towers.ad_vectors(ads) if self.towers is not None else [None] * len(ads)
        for ad, vec in zip(ads, vectors, strict=True):
            self.pipe.add_ad(ad, vec)

    async def start(self) -> None:
        """Load snapshots and pins (before any delta lands or a request is served), then start the
        followers (catalog, deltas, clicks: with `serving.consume_deltas`), housekeeping and the
        counter flush."""
        await self._load_adapters()
        if self.settings.serving.consume_deltas:
            self._supervise("catalog", lambda: self._follow(topics.CATALOG, self._on_ad, True))
            self._supervise("campaigns", lambda: self._follow(topics.CAMPAIGNS, self._on_campaign, True))
            self._supervise("deltas", lambda: self._follow(topics.ADAPTER_DELTAS, self._on_delta, True))
            self._supervise("clicks", lambda: self._follow(topics.CLICKS, self._on_click, False))
            if wanted(self.settings):  # clicks teach the creative variant bandit (labelled examples)
                self._supervise("variants", VariantFeedback(self.settings, self.pipe.variants).follow)
        self._supervise("housekeeping", self._housekeeping)
        self._supervise("counters", self._flush_counters)

    async def stop(self, flush_timeout_s: float = 2.0) -> None:
        """Cancel the loops, then write the pending frequency-cap and spend counters to Redis."""
        for task in self._tasks.values():
            task.cancel()
        try:
            await asyncio.wait_for(self.redis.flush(), flush_timeout_s)
        except Exception as exc:
            log.warning("final counter flush failed: %s", exc)

    # -- supervision ------------------------------------------------------------------------
    def _supervise(self, name: str, loop: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run a background loop for the replica's life: when it ends or raises, log it, count it
        (`adstream_serving_task_restarts_total{task}`) and start it again after a backoff."""

        def done(task: asyncio.Task[None]) -> None:
            if task.cancelled():
                return
            exc = task.exception()
            if exc is not None:
                log.error("background task %s died: %r; restarting", name, exc, exc_info=exc)
            else:
                log.error("background task %s ended; restarting", name)
            self.metrics.task_restarts.labels(name).inc()
            self._restarts[name] = self._restarts.get(name, 0) + 1
            delay = min(30.0, 0.5 * 2 ** min(self._restarts[name] - 1, 6))

            async def again() -> None:
                await asyncio.sleep(delay)
                await loop()

            self._start_task(name, again, done)

        self._start_task(name, loop, done)

    def _start_task(
        self,
        name: str,
        factory: Callable[[], Coroutine[Any, Any, None]],
        done: Callable[[asyncio.Task[None]], None],
    ) -> None:
        task = asyncio.get_running_loop().create_task(factory(), name=f"adstream-{name}")
        task.add_done_callback(done)
        self._tasks[name] = task

    # -- start-up loading -------------------------------------------------------------------
    async def _load_adapters(self) -> None:
        """Start-up: the trainers' snapshots, then the admin pins, before the delta follower starts
        and the replica reports ready. A replica that started after a rollback elsewhere must not
        serve the rolled-back version until its first housekeeping pass (a second later); if the
        pins cannot be read now, that pass retries them (counted, `pins_at_start`)."""
        await self._load_snapshots()
        if not await self._sync_pins():
            self.metrics.task_errors.labels("pins_at_start").inc()

    async def _load_snapshots(self) -> None:
        try:
            ids = await self.redis.snapshot_ids()
        except Exception as exc:
            log.warning("could not list adapter snapshots: %s", exc)
            return
        for adapter_id in ids:
            try:
                snap = await self.redis.snapshot(adapter_id)
            except Exception as exc:
                log.warning("could not load the snapshot of adapter %r: %s", adapter_id, exc)
                continue
            outcome = "missing" if snap is None else self.applier.apply(snap, initial=True)
            self.metrics.deltas.labels(f"snapshot_{outcome}").inc()
        self.applier.promote()  # what the trainers last snapshotted is the stable starting point

    async def _follow(self, base: str, handle: Any, from_beginning: bool) -> None:
        def invalid(reason: str) -> None:
            self.metrics.deltas.labels("invalid").inc() if base == topics.ADAPTER_DELTAS else None
            log.warning("invalid message on %s: %s", base, reason)

        positions = self._positions.setdefault(base, {})
        # deltas older than the replay window are in the snapshots loaded at start
        replay = self.settings.serving.delta_replay_s if base == topics.ADAPTER_DELTAS else None
        await follow(
            self.settings, base, handle, from_beginning, invalid, replay_s=replay, positions=positions
        )

    async def _on_ad(self, msg: Message) -> None:
        assert isinstance(msg, AdCreative)
        vec = None
        if self.towers is not None and not self.towers.knows(msg):
            # a new ad's title goes through MiniLM off the loop: requests keep being served meanwhile
            vec = await asyncio.to_thread(self.towers.ad_vector, msg)
        self.pipe.add_ad(msg, vec)

    def _on_campaign(self, msg: Message) -> None:
        assert isinstance(msg, Campaign)
        self.catalog.upsert_campaign(msg)  # a full catalog's CatalogFull is counted by `follow`

    async def _on_delta(self, msg: Message) -> None:
        assert isinstance(msg, AdapterDelta)
        arms = (STABLE, CANDIDATE) if self.canary.share(time.time()) >= 1.0 else (CANDIDATE,)
        # verify, decode, check and fold off the loop (requests keep being served); on the loop
        # only the swap: a few tensor copies into the buffers no batch reads
        prep = await asyncio.to_thread(self.applier.prepare, msg)
        t, cpu = time.perf_counter(), time.thread_time()
        outcome = self.applier.commit(msg, prep, arms)
        pause = time.perf_counter() - t  # the loop (and every request on it) waited this long
        pause_cpu = time.thread_time() - cpu  # of which the swap's own work
        self.metrics.swap_pause.observe(pause)
        self.max_swap_pause_s = max(self.max_swap_pause_s, pause)
        self.max_swap_pause_cpu_s = max(self.max_swap_pause_cpu_s, pause_cpu)
        self.metrics.swap_pause_max.set(self.max_swap_pause_s)
        self.metrics.swap_pause_cpu_max.set(self.max_swap_pause_cpu_s)
        self.metrics.deltas.labels(outcome).inc()
        if outcome in ("gap", "new_epoch"):  # a new epoch's deltas follow its snapshot in Redis
            outcome = await self.resync(msg.adapter_id, "resync")
            if outcome == "applied":  # the snapshot may end right before this delta: try it again
                self.metrics.deltas.labels(f"after_resync_{self.applier.apply(msg, arms)}").inc()

    def _on_click(self, msg: Message) -> None:
        assert isinstance(msg, Click)
        # a fabricated click (no token, another user's or ad's) must not steer the canary (M10.b)
        if self.settings.streams.verify_clicks and check_event(msg, self.pipe.event_key) is not None:
            self.metrics.clicks_refused.inc()
            return
        if self.canary.clicked(msg.impression_id):
            self.metrics.clicks_joined.inc()

    async def _flush_counters(self) -> None:
        """Frequency-cap and spend counters go to Redis in one pipeline every `serving.counter_flush_s`
        (50 ms), not per request."""
        while True:
            await asyncio.sleep(self.settings.serving.counter_flush_s)
            t = time.perf_counter()
            try:
                if await self.redis.flush():
                    self.metrics.spent("flush", time.perf_counter() - t)
            except Exception as exc:
                log.warning("counter flush to Redis failed: %s", exc)

    async def unpinned(self, adapter_id: str) -> None:
        """An admin's unpin, after its pin left Redis: the adapter is lifted here and re-synced
        from its snapshot, and this returns once that is done, so the answer reports the
        re-synced version. While the pin was being cleared, the pin loop (`_sync_pins`) may have
        found it gone first and be re-syncing the adapter already: then that re-sync is awaited
        (shielded: a caller that goes away does not cancel the loop's work), not a second one
        started."""
        lifted = self.applier.unpin(adapter_id)
        running = self._resyncs.get(adapter_id)
        if running is not None:
            await asyncio.shield(running)
        elif lifted:
            await self.resync(adapter_id, "unpin")

    async def resync(self, adapter_id: str, why: str) -> str:
        """Load an adapter's latest snapshot from Redis; counts the outcome as `<why>_<outcome>`."""
        return await self._start_resync(adapter_id, why)

    def _start_resync(self, adapter_id: str, why: str) -> asyncio.Task[str]:
        """`resync` as a task, known in `_resyncs` from the moment it starts (before any await)
        until it ends: what an admin's unpin waits for when the pin loop lifted the pin first."""

        async def run() -> str:
            outcome = await self.applier.resync(adapter_id, self.redis.snapshot)
            self.metrics.deltas.labels(f"{why}_{outcome}").inc()
            return outcome

        task = asyncio.get_running_loop().create_task(run())
        self._resyncs[adapter_id] = task

        def done(t: asyncio.Task[str]) -> None:
            if self._resyncs.get(adapter_id) is t:
                del self._resyncs[adapter_id]

        task.add_done_callback(done)
        return task

    async def _sync_pins(self) -> bool:
        """Follow the admin pins other replicas set or lifted (Redis); re-sync what was unpinned.
        A pin at a seq this replica does not hold installs the weights stored with the pin.
        False when the pins could not be read (logged; the next pass tries again)."""
        try:
            shared = await self.redis.pins()
            missing = self.applier.missing_pins(shared)
            weights = await self.redis.pin_snapshots(missing) if missing else {}
        except Exception as exc:
            log.warning("adapter pin refresh failed: %s", exc)
            return False
        # every lifted adapter's re-sync known at once (an admin's unpin of any of them waits for it)
        resyncs = [self._start_resync(a, "unpin") for a in self.applier.sync_pins(shared, weights)]
        if resyncs:
            await asyncio.gather(*resyncs)  # a failure is raised (the pass is retried), none is lost
        return True

    async def _housekeeping(self) -> None:
        """Every `serving.housekeeping_s`: the day's spend from Redis (pacing) and gauges; every
        `canary.eval_s`: the canary decision (it sorts the arms' windows, so not more often)."""
        day = utcnow().date()
        next_eval = time.time() + self.settings.canary.eval_s
        while True:
            await asyncio.sleep(self.settings.serving.housekeeping_s)
            try:
                day, next_eval = await self._housekeeping_step(day, next_eval)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a Redis timeout, a bad pin: the next second tries again
                self.metrics.task_errors.labels("housekeeping").inc()
                log.warning("housekeeping step failed: %r", exc)

    async def _housekeeping_step(self, day: Any, next_eval: float) -> tuple[Any, float]:
        """One second of `_housekeeping`; returns the (day, next canary evaluation) it moved to."""
        now = time.time()
        if utcnow().date() != day:  # a new day: a new spend plan
            day = utcnow().date()
            self.catalog.reset_day()
        try:
            self.catalog.set_spend(await self.redis.spend(utcnow()))
        except Exception as exc:
            log.warning("spend refresh failed: %s", exc)
        if now >= next_eval:
            next_eval = now + self.settings.canary.eval_s
            action = self.canary.evaluate(now)
            if action != "hold":
                self.metrics.canary_actions.labels(action).inc()
            if self.canary.stage == "full":  # promoted past 50 %: candidate becomes stable
                self.applier.promote()
                self.canary.stage = "canary"
        await self._sync_pins()
        self.metrics.canary_share.set(self.canary.share(now))
        self.metrics.swaps.set(self.rank.bank.swaps)
        self.metrics.adapters.set(len(self.rank.bank.meta))
        self.metrics.staleness.set(self.applier.max_staleness_s())
        self.metrics.catalog.set(self.catalog.n)
        return day, next_eval
