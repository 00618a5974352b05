"""The `/v1/ads` request path, top-down, over a batch of requests that arrived together:

    plan (the deadline's first rung) → user read (one Redis round trip for the batch, within
    the deadline's I/O budget) → recall (one matmul) → rank (one forward per adapter use) →
    rerank, exploration and signing (per request) → record (caps, spend, canary, impressions:
    one produce call for the batch) → responses.

Each stage is a method taking the batch; `timed` wraps it and gives every request of the batch
the stage's time (`RequestContext.stage_ms`, the `part` histogram). The rungs of the ladder
(`serving.deadline`) are decided per request: a request whose deadline leaves no time for recall
is served popular ads; one whose user read did not answer in its budget is served without the
user's state, one rung down (`degraded`); rank runs on the rung the time left allows.

`RequestPath` has no Ray in it: the Serve ingress (`serving.app`) batches requests into it, and
tests drive it directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from schemas.api import AdResponse, RankRequest
from schemas.events import Impression
from serving.arms import uses_adapters, uses_correction
from serving.catalog import POPULAR_PCTR
from serving.deadline import io_budget_ms, lower, plan_rank, plan_start
from serving.pipeline import AdPipeline, RequestContext, Served, UserView, audience_of, recall_pctr
from serving.ranking import RankInput, at_positions

log = logging.getLogger(__name__)
Batch = list[RequestContext]
Reads = list[tuple[UserView | None, list[str]]]  # per user: state (None: cold) and capped ads
ScoreFn = Callable[[list[tuple[RankInput, bool]]], Awaitable[list[np.ndarray]]]
F = TypeVar("F", bound=Callable[..., Any])
_T = TypeVar("_T")


class UserStore(Protocol):
    """What the path needs of Redis (`serving.io.RedisIO`)."""

    async def read_many(self, user_ids: list[str], now: datetime) -> Reads: ...

    def pending_capped(self, user_id: str, now: datetime) -> list[str]: ...

    def record(
        self, user_id: str, now: datetime, imps: list[Impression], spend: list[float] | None = None
    ) -> None: ...


class Recorder(Protocol):
    """Where the path reports: time per part, stage times, the rung that served."""

    def spent(self, part: str, seconds: float) -> None: ...

    def stage_ms(self, stage: str, ms: float) -> None: ...

    def served_by(self, rung: str) -> None: ...


class NoRecorder:
    """Reports nothing (tests, tools)."""

    def spent(self, part: str, seconds: float) -> None:
        pass

    def stage_ms(self, stage: str, ms: float) -> None:
        pass

    def served_by(self, rung: str) -> None:
        pass


def timed(part: str) -> Callable[[F], F]:
    """Time a stage of `RequestPath` (a method taking the batch first): each request of the
    batch gets the stage's wall time in `stage_ms[part]`, and the recorder its share."""

    def wrap(fn: F) -> F:
        def took(path: RequestPath, batch: Batch, seconds: float) -> None:
            ms = seconds * 1000
            for ctx in batch:
                ctx.stage_ms[part] = ctx.stage_ms.get(part, 0.0) + ms
            if batch:
                share = seconds / len(batch)
                for _ in batch:
                    path.recorder.spent(part, share)

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(path: RequestPath, batch: Batch, *args: Any) -> Any:
                t = time.perf_counter()
                try:
                    return await fn(path, batch, *args)
                finally:
                    took(path, batch, time.perf_counter() - t)

            return run_async  # type: ignore[return-value]

        @functools.wraps(fn)
        def run(path: RequestPath, batch: Batch, *args: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(path, batch, *args)
            finally:
                took(path, batch, time.perf_counter() - t)

        return run  # type: ignore[return-value]

    return wrap


class RequestPath:
    """Recall → user read → rank → rerank → record for a batch of requests (see the module).

    `score` ranks a list of (input, with adapters) in one forward per flag (the replica runs it
    on its rank thread); `served` tells the canary what a learning-arm impression was served
    with; `emit` produces impressions (one call per batch).
    """

    def __init__(
        self,
        pipe: AdPipeline,
        users: UserStore,
        score: ScoreFn,
        emit: Callable[[list[Impression]], None],
        served: Callable[[str, str, float], None] | None = None,
        recorder: Recorder | None = None,
    ) -> None:
        self.pipe = pipe
        self.users = users
        self.score = score
        self.emit = emit
        self.served = served
        self.recorder: Recorder = recorder or NoRecorder()

    async def serve(self, batch: Batch) -> list[AdResponse]:
        """The responses of a batch of requests, in order (each `ctx` carries its deadline)."""
        live = self.plan(batch)
        if live:
            await self.read_users(live)
            self.recall(live)
            await self.rank(self.rankable(live))
        for ctx in batch:
            if ctx.rung == "popular" or ctx.rows.shape[0] == 0:
                self.popular(ctx)
        served = await self.rerank(batch)
        self.record(batch, served)
        self.observe(batch)
        return [self.pipe.respond(ctx, s) for ctx, s in zip(batch, served, strict=True)]

    # -- the stages, in order --------------------------------------------------------------
    def plan(self, batch: Batch) -> Batch:
        """The first rung of each request: popular ads when even recall + rerank do not fit."""
        costs, live = self.pipe.costs, []
        for ctx in batch:
            ctx.rung = plan_start(_remaining(ctx), costs)
            if ctx.rung == "popular":
                costs.relax("recall")
            else:
                live.append(ctx)
        return live

    @timed("redis")
    async def read_users(self, batch: Batch) -> None:
        """Every user's state and frequency caps in one round trip, waited for at most the
        smallest I/O budget of the batch (`serving.deadline.io_budget_ms`). Past it (Redis
        hung, slow or down) the batch goes on without: users cold, capped by what this replica
        counted, and one rung down (the response says `degraded`)."""
        budget_ms = min(io_budget_ms(_remaining(ctx), self.pipe.costs) for ctx in batch)
        got: Reads | None = None
        if budget_ms > 0:
            ids = [ctx.req.user_id for ctx in batch]
            got = await _within(self.users.read_many(ids, batch[0].now), budget_ms / 1000)
        for i, ctx in enumerate(batch):
            ctx.read_missed = got is None
            if got is None:
                ctx.rung = lower(ctx.rung, "base_model")
                user, ctx.capped = None, self.users.pending_capped(ctx.req.user_id, ctx.now)
            else:
                user, ctx.capped = got[i]
            if user is not None and user.bias and not uses_correction(ctx.ab_arm):
                user = dataclasses.replace(user, bias={})  # the control arm: no per-user correction
            ctx.user = user
            ctx.user_vector = None if user is None else user.vector  # the variant choice's context

    @timed("recall")
    def recall(self, batch: Batch) -> None:
        """The batch's candidates (one matmul over the catalog) and their rank inputs; a
        `/v1/rank` request's candidates are the ones it brought (those it may be shown)."""
        own = [c for c in batch if not isinstance(c.req, RankRequest)]
        if own:
            recalled = self.pipe.recall_many(
                [c.req for c in own],
                [c.user for c in own],
                [c.capped for c in own],
                own[0].now.hour,
                own[0].now,
            )
            for ctx, rec in zip(own, recalled, strict=True):
                ctx.recalled, ctx.rows = rec, rec.rows
        for ctx in batch:
            if isinstance(ctx.req, RankRequest):
                rows, ctx.unknown, ctx.ineligible = self.pipe.candidates(ctx.req, ctx.capped, ctx.now)
                rec = self.pipe.recall_candidates(ctx.req, ctx.user, rows, ctx.now.hour)
                ctx.recalled, ctx.rows = rec, rec.rows

    def rankable(self, batch: Batch) -> Batch:
        """The rung each request can still afford after recall; those on a model rung are returned
        (the rest are served on their recall scores)."""
        costs, out = self.pipe.costs, []
        for ctx in batch:
            costs.observe("recall", ctx.stage_ms.get("redis", 0.0) + ctx.stage_ms.get("recall", 0.0))
            ctx.rung = lower(ctx.rung, plan_rank(_remaining(ctx), costs))
            if ctx.rung != "adapter":
                costs.relax("rank_adapter")
                if ctx.rung != "base_model":
                    costs.relax("rank_base")
            rec = ctx.recalled
            if rec is not None and rec.rank_input is not None and ctx.rung in ("adapter", "base_model"):
                out.append(ctx)
            elif ctx.rows.shape[0]:
                ctx.rung = "recall_score"
                ctx.pctr = recall_pctr(rec.scores if rec is not None else np.zeros(0))
        return out

    @timed("rank")
    async def rank(self, batch: Batch) -> None:
        """pCTR of every candidate of the batch: one forward with adapters, one without (with
        `ab.shadow_slates`, a request ranked with adapters is scored without them too)."""
        if not batch:
            return
        items: list[tuple[RankInput, bool]] = []
        shadows: list[tuple[RequestContext, RankInput]] = []
        shadow = self.pipe.settings.ab.shadow_slates
        for ctx in batch:
            assert ctx.recalled is not None and ctx.recalled.rank_input is not None
            base = ctx.recalled.rank_input
            inp, use = base, ctx.rung == "adapter" and uses_adapters(ctx.ab_arm)
            if use:
                slot = ctx.req.slot
                bank_rows = self.pipe.adapter_rows(slot, ctx.rows, ctx.arm)
                shared = self.pipe.shared_adapter_row(slot, ctx.arm)
                # the offset stays
                inp = dataclasses.replace(inp, rows=torch.from_numpy(bank_rows), row=shared)
                if shadow:
                    shadows.append((ctx, base))
            ctx.scored, ctx.scored_adapters = inp, use
            items.append((inp, use))
        # the shadow: the same input without the adapters' rows (the correction's offset stays)
        items += [(b, False) for _, b in shadows]
        scores = await self.score(items)
        for ctx, pctr in zip(batch, scores[: len(batch)], strict=True):
            ctx.pctr = pctr
        for (ctx, _), pctr in zip(shadows, scores[len(batch) :], strict=True):
            ctx.shadow_pctr = pctr

    def popular(self, ctx: RequestContext) -> None:
        """The last rung: cached popular ads (the user's known frequency caps still hold)."""
        ctx.rung, ctx.scored, ctx.scored_adapters = "popular", None, False
        if isinstance(ctx.req, RankRequest):  # the caller's own candidates (rerank orders them by bid)
            ctx.rows, ctx.unknown, ctx.ineligible = self.pipe.candidates(ctx.req, ctx.capped, ctx.now)
            ctx.pctr = np.full(ctx.rows.shape[0], POPULAR_PCTR)
            return
        rows = self.pipe.popular(max(ctx.req.k * 4, 40))
        rows = rows[
            self.pipe.catalog.servable(audience_of(ctx.req, ctx.now))[rows]
        ]  # its campaigns' audience
        if ctx.capped:
            row_of = self.pipe.catalog.row_of
            capped_rows = {row_of.get(a) for a in ctx.capped}
            rows = np.asarray([r for r in rows if int(r) not in capped_rows], dtype=np.int64)
        ctx.rows, ctx.pctr = rows, np.full(rows.shape[0], POPULAR_PCTR)

    @timed("rerank")
    async def rerank(self, batch: Batch) -> list[Served]:
        """Each request's ads: rerank (caps, pacing, diversity) and exploration choose them, the
        ranker scores each at its position, then variants and signing."""
        chosen = [self.pipe.choose(ctx) for ctx in batch]
        for ctx in batch:
            if ctx.shadow_pctr is not None and ctx.rung == "adapter":  # still ranked with adapters
                order = self.pipe.choose(ctx, ctx.shadow_pctr).order
                ctx.shadow_ads = [self.pipe.catalog.rows[int(r)].ad_id for r in ctx.rows[order]]
        at = await self.at_positions(batch, [c.order for c in chosen])
        return [self.pipe.finish(ctx, c, p) for ctx, c, p in zip(batch, chosen, at, strict=True)]

    async def at_positions(self, batch: Batch, orders: Sequence[np.ndarray]) -> list[np.ndarray | None]:
        """The pCTR of each served ad at the position it is served at, by the model that ranked
        it (its adapters, its correction), for the requests ranked by the model: one more
        forward per adapter flag for the batch, over k ads a request. Rank scores every
        candidate at position 0 (the order does not depend on where an ad will be shown), but an
        impression's logged pCTR is what the per-user correction learns from (its gradient is
        click − pCTR): at position 0 the lower positions' lower click rates became a negative
        correction of the users' categories. None: not ranked by the model (its recall score or
        a popular ad)."""
        out: list[np.ndarray | None] = [None] * len(batch)
        items, where = [], []
        max_position = self.pipe.rank.config.max_position
        for i, (ctx, order) in enumerate(zip(batch, orders, strict=True)):
            if ctx.scored is None or ctx.rung not in ("adapter", "base_model") or not order.shape[0]:
                continue
            items.append((at_positions(ctx.scored, order, max_position), ctx.scored_adapters))
            where.append(i)
        if items:
            for i, p in zip(where, await self.score(items), strict=True):
                out[i] = p
        return out

    @timed("record")
    def record(self, batch: Batch, served: Sequence[Served]) -> None:
        """What was served (previews are not): catalog counts, frequency caps, the
        canary's view of learning-arm impressions, and the batch's impressions in one produce."""
        out: list[Impression] = []
        for ctx, s in zip(batch, served, strict=True):
            if ctx.req.preview or not s.impressions:
                continue
            self.pipe.catalog.record_served(s.rows)  # spend: billed on views and clicks
            if self.served is not None and uses_adapters(ctx.ab_arm):  # the canary: learning arm only
                for imp in s.impressions:
                    self.served(ctx.canary_arm, imp.event_id, imp.pctr or 0.0)
            self.users.record(ctx.req.user_id, ctx.now, s.impressions)
            out.extend(s.impressions)
        if out:
            self.emit(out)

    def observe(self, batch: Batch) -> None:
        """Stage times into the ladder's cost estimates and the recorder, the rung that served."""
        costs, rec = self.pipe.costs, self.recorder
        for ctx in batch:
            ms = ctx.stage_ms
            if "rank" in ms:
                use = ctx.rung == "adapter" and uses_adapters(ctx.ab_arm)
                costs.observe("rank_adapter" if use else "rank_base", ms["rank"])
            costs.observe("rerank", ms.get("rerank", 0.0))
            rec.served_by(ctx.rung)
            rec.stage_ms("recall", ms.get("redis", 0.0) + ms.get("recall", 0.0))
            rec.stage_ms("rank", ms.get("rank", 0.0))
            rec.stage_ms("rerank", ms.get("rerank", 0.0))


async def _within(read: Awaitable[_T], timeout_s: float) -> _T | None:
    """The result of `read` if it comes within `timeout_s`, else None (and None when it
    fails: Redis down or refusing is the same as no answer in time). Never waits longer: a
    read past its time is cancelled without waiting for the cancellation to finish (a client
    cleaning up a connection to a hung server could take as long as the server)."""
    task = asyncio.ensure_future(read)
    done, _ = await asyncio.wait({task}, timeout=timeout_s if math.isfinite(timeout_s) else None)
    if not done:
        task.cancel()
        task.add_done_callback(_retrieve)
        return None
    if task.exception() is not None:
        log.debug("user read failed: %s", task.exception())
        return None
    return task.result()


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("late user read failed: %s", task.exception())


def _remaining(ctx: RequestContext) -> float:
    return float("inf") if ctx.deadline is None else ctx.deadline.remaining_ms()
