"""Clicks teach a replica's variant bandit through the loop: labelled examples → `VariantSelector`.

The streams label join puts on every `TrainingExample` the creative variant its impression showed
(`variant_id`, `variant_propensity`) and the user state vector it was served with. A replica
follows `ad.training-examples` like the adapter deltas (no consumer group: every replica learns
every label, so replicas agree; `variants.replay_s` back at start, then on from where it left
off across reconnects) and learns each labelled variant's click into its posterior, in batches of
`variants.learn_batch` or every `variants.learn_interval_s`.

Labels by kind (`settings.online.label_mode`): a `final` example is one impression's click or
non-click; a `fake_negative` is learned as a non-click at once, and the `click` that follows
corrects it (`serving.variants.update`, `new=False`: the target moves, the precision stays), so
the posterior ends as if the final label had been learned once; `dwell` updates teach nothing here.

Idempotent under replays and duplicates: the last `variants.remembered` impressions learned are
remembered with their label (an ordered map, oldest forgotten first: bounded memory), and an
example of one of them that adds nothing (a second final, a repeated click) is skipped and
counted. Only a duplicate older than that many impressions could be learned twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence

import numpy as np

from schemas import topics
from schemas.events import Message, TrainingExample
from schemas.settings import Settings
from serving.io import follow
from serving.variants import VariantSelector

log = logging.getLogger(__name__)


def wanted(settings: Settings) -> bool:
    """Whether replicas learn variants from labels (`variants.enabled` and `variants.learn`)."""
    return settings.variants.enabled and settings.variants.learn


class VariantFeedback:
    """Labelled examples into one replica's `VariantSelector`: buffered, deduplicated, learned."""

    def __init__(self, settings: Settings, selector: VariantSelector) -> None:
        self.settings = settings
        self.selector = selector
        self.params = settings.variants
        # impression id → learned as a click: what makes a replayed or duplicated example a no-op
        self.learned: OrderedDict[str, bool] = OrderedDict()
        self.counts: Counter[str] = Counter()
        self.positions: dict[int, int] = {}  # where the follower left off (survives reconnects)
        self._pending: list[TrainingExample] = []
        self._since = 0.0  # monotonic time of the oldest pending example

    # -- the follower's handler -------------------------------------------------------------
    def offer(self, msg: Message) -> None:
        """One labelled example from the topic: kept for the next batch (learned at once when the
        batch is full or its oldest example has waited `learn_interval_s`)."""
        if not isinstance(msg, TrainingExample):
            self.counts["not_an_example"] += 1
            return
        if msg.variant_id is None or msg.label_kind == "dwell":
            self.counts["no_variant" if msg.variant_id is None else "dwell"] += 1
            return
        if not self._pending:
            self._since = time.monotonic()
        self._pending.append(msg)
        if self.due():
            self.flush()

    def due(self) -> bool:
        """Whether the pending examples should be learned now."""
        if not self._pending:
            return False
        waited = time.monotonic() - self._since
        return len(self._pending) >= self.params.learn_batch or waited >= self.params.learn_interval_s

    def flush(self) -> int:
        """Learn the pending examples in one posterior update; returns how many changed it."""
        batch, self._pending = self._pending, []
        return self.learn(batch)

    def learn(self, examples: Sequence[TrainingExample]) -> int:
        """Learn labelled examples, each impression's label once (see the module); returns how
        many were learned (examples of ads or variants the replica does not hold are skipped)."""
        picked: list[tuple[TrainingExample, bool, bool]] = []  # example, clicked, new
        for ex in examples:
            if ex.variant_id is None or ex.label_kind == "dwell":
                continue
            before = self.learned.get(ex.impression_id)
            if ex.label_kind == "click":
                if before is True:
                    self.counts["duplicate"] += 1
                    continue
                picked.append((ex, True, before is None))  # after its fake negative: a correction
                self._remember(ex.impression_id, True)
            elif before is not None:  # a final or fake negative of an impression already learned
                self.counts["duplicate"] += 1
            else:
                picked.append((ex, ex.click, True))
                self._remember(ex.impression_id, ex.click)
        if not picked:
            return 0
        dim = max(len(ex.user_vector) for ex, _, _ in picked)
        vectors = np.zeros((len(picked), dim))
        for i, (ex, _, _) in enumerate(picked):
            vectors[i, : len(ex.user_vector)] = ex.user_vector
        n = self.selector.learn(
            [ex.ad_id for ex, _, _ in picked],
            vectors,
            [ex.variant_id or "" for ex, _, _ in picked],
            [clicked for _, clicked, _ in picked],
            [new for _, _, new in picked],
        )
        self.counts["learned"] += n
        self.counts["unknown_ad_or_variant"] += len(picked) - n
        return n

    def _remember(self, impression_id: str, clicked: bool) -> None:
        self.learned[impression_id] = clicked
        self.learned.move_to_end(impression_id)
        while len(self.learned) > self.params.remembered:
            self.learned.popitem(last=False)
            self.counts["forgotten"] += 1

    # -- the replica's loop -----------------------------------------------------------------
    async def follow(self) -> None:
        """Follow `ad.training-examples` for the replica's life (supervised by its loops): a
        starting replica learns `variants.replay_s` back; a reconnect goes on where it left off."""
        ticker = asyncio.get_running_loop().create_task(self._tick(), name="adstream-variant-flush")
        try:
            await follow(
                self.settings,
                topics.TRAINING_EXAMPLES,
                self.offer,
                True,
                self._invalid,
                replay_s=self.params.replay_s,
                positions=self.positions,
            )
        finally:
            ticker.cancel()

    async def _tick(self) -> None:
        """Learn what waited `learn_interval_s` when no further example arrives to trigger it."""
        while True:
            await asyncio.sleep(self.params.learn_interval_s / 2)
            if self.due():
                self.flush()

    def _invalid(self, reason: str) -> None:
        self.counts["invalid"] += 1
        log.warning("invalid message on %s: %s", topics.TRAINING_EXAMPLES, reason)
