"""Settings of the streams worker and the trainers: user state, streams, sink, LoRA, online learning."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from schemas.retry import Backoff
from schemas.settings.base import Group


class EngagementSettings(Group):
    """How much each kind of evidence moves a user's state vector and intent scores."""

    # An impression is the policy's choice, not the user's: under a random logging policy it is
    # pure noise on the intent scores, under a targeted one it feeds the ranker's own past
    # choices back as "intent". At 0.05 (20 impressions = 1 click) that noise cost the ranker
    # 0.010 and 0.015 holdout AUC at the simulator's defaults (seeds 0, 1; nothing measurable
    # with 10,000 impressions per user, where clicks dominate): benchmarks/offline_quality.py
    # with and without --impression-weight 0.05. 0 measured the same as 0.001, but at 0.001 an
    # impression still registers in the state (a user who was only shown ads keeps a non-zero
    # vector, which serving's recall treats as warm, as before).
    impression: float = Field(0.001, ge=0, description="Weight of an impression (exposure, not taste)")
    click: float = Field(1.0, ge=0, description="Weight of a click")
    dwell: float = Field(1.0, ge=0, description="Weight of a full dwell")
    dwell_full_ms: int = Field(30_000, gt=0, description="A dwell this long counts fully")
    skip: float = Field(0.3, ge=0, description="Weight of a short dwell (a skip: negative evidence)")
    conversion: float = Field(2.0, ge=0, description="Weight of a conversion")


class StateSettings(Group):
    """The per-user intent state of the streams worker (streams.state)."""

    half_life_s: float = Field(3600.0, gt=0, description="Half-life τ of intent scores")
    session_gap_s: float = Field(30.0, gt=0, description="A gap over this starts a new session")
    alpha_session: float = Field(0.85, gt=0, le=1, description="Decay applied on a session gap")
    alpha_contradict: float = Field(0.62, gt=0, le=1, description="Decay on a contradicting signal")
    contradict_dwell_ms: int = Field(2000, ge=0, description="A click then dwell below this contradicts")
    evidence_half_life: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="User state: old evidence halves per this much new positive evidence (clicks; 0: off)",
    )
    evidence_surprise: bool = Field(
        False,
        description="User state: scale that forgetting by the evidence's surprise (1 − its category's share "
        "of the state's intent mass)",
    )
    feedback_lr: float = Field(
        0.5,
        ge=0,
        le=10,
        allow_inf_nan=False,
        description="Per-user correction: SGD step of each (user, category) logit bias on every impression's "
        "outcome — minus this times the served pctr at the impression, plus this at its click (0: off)",
    )
    feedback_max: float = Field(
        4.0, gt=0, le=20, allow_inf_nan=False, description="Per-user correction: the bias stays within ±this"
    )
    ttl_s: int = Field(7 * 24 * 3600, gt=0, description="TTL of a user's Redis record")
    max_intents: int = Field(16, ge=1, description="Intent scores kept per user (the strongest)")
    weights: EngagementSettings = Field(
        default_factory=EngagementSettings, description="Weights of the kinds of evidence"
    )


class StreamsSettings(Group):
    """The streams worker: event-time checks, label join, co-partition merge."""

    max_event_skew_s: float = Field(
        1800.0,
        gt=0,
        description="Events dated further after their Kafka record time (capped by the wall clock) "
        "are dead-lettered; at most the attribution window",
    )
    verify_impressions: bool = Field(
        True,
        description="Dead-letter impressions without a valid replica signature (Impression.sig); off only "
        "where other trusted producers write ad.impressions without the key",
    )
    verify_clicks: bool = Field(
        True,
        description="Dead-letter clicks and dwells without the click token of an impression served to "
        "that user and ad (ServedAd.click_token); replicas leave such clicks out of the canary's join",
    )
    watermark_window: int = Field(
        32,
        ge=1,
        description="Stream time is the median event time of this many recent records (label join, "
        "trainer): fewer than half of them, however far ahead, cannot move it",
    )
    attribution_window_s: float = Field(1800.0, gt=0, description="Impression→click/dwell join window")
    merge_max_idle_s: float = Field(
        30.0, gt=0, description="An input partition silent this long no longer holds back the others"
    )
    merge_max_buffered: int = Field(
        100_000, ge=1, description="…nor once the merge holds this many records of its co-partition"
    )
    fetch_records: int = Field(
        5000, ge=1, description="Records the worker reads per fetch, both engines (Faust's default: 500)"
    )
    fetch_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="Bytes per partition and fetch (Faust's and aiokafka's default: 1 MiB)",
    )
    cache_users: int = Field(
        200_000, ge=1, description="User states the worker keeps in memory (its partitions share them)"
    )
    backlog: int = Field(
        4, ge=1, description="While a write is in flight a batch grows to at most this many × sink.batch_size"
    )
    produce_linger_ms: int = Field(
        5, ge=0, le=1000, description="The worker's producer waits this long to fill a batch (examples, DLQ)"
    )
    produce_batch_bytes: int = Field(
        512 * 1024,
        ge=16 * 1024,
        description="The worker's producer batch per partition (a commit produces thousands of examples)",
    )
    retry_first_s: float = Field(
        0.5,
        gt=0,
        description="First wait before a streams step (Redis, ClickHouse, Kafka) that failed with a "
        "transient error is retried; the waits double up to streams.retry_max_s and never give up "
        "(the worker pauses)",
    )
    retry_max_s: float = Field(
        30.0, gt=0, description="Longest wait between retries of a streams step (>= streams.retry_first_s)"
    )

    @model_validator(mode="after")
    def _retry_waits(self) -> StreamsSettings:
        if self.retry_first_s > self.retry_max_s:
            raise ValueError(
                f"streams.retry_first_s ({self.retry_first_s}) must be <= "
                f"streams.retry_max_s ({self.retry_max_s})"
            )
        return self

    @property
    def retry_backoff(self) -> Backoff:
        """The backoff of the worker's steps (`schemas.retry`): no give-up."""
        return Backoff(self.retry_first_s, self.retry_max_s, None)


class SinkSettings(Group):
    """The ClickHouse sink of the streams worker."""

    batch_size: int = Field(5000, ge=1, description="ClickHouse sink flushes at this many rows")
    flush_s: float = Field(
        0.25,
        gt=0,
        description="…or after this many seconds: a batch's examples reach the trainer only once it "
        "is committed, so this bounds the worker's share of click→served freshness",
    )
    max_partitions: int = Field(
        100, ge=1, description="Months (ClickHouse partitions) one INSERT block may span (server: 100)"
    )


class LoraSettings(Group):
    """LoRA adapters: rank, alpha and the ranker modules they adapt."""

    rank: int = Field(8, ge=1, le=256)
    alpha: float = Field(16.0, gt=0)
    # The head (Linear 155 → 1 on the cross ‖ deep outputs) and the per-category, per-slot and
    # per-position bias tables: a trend shared by many users is one column of wide.category, a
    # position-bias or slot change one of wide.position / wide.slot. Against (cross, deep,
    # wide.category) the same drift runs learned as well (trend a little less, slot/position
    # shift more; benchmarks/results/online_drift_targets.json), and served with 1,000 mixed
    # adapters they cost 16 % of base throughput instead of 52 %: narrow layers are served from
    # their ΔW (serving.adapters). cross/deep targets remain available (benchmarks/rank.py --targets)
    targets: tuple[str, ...] = Field(
        ("head", "wide.category", "wide.slot", "wide.position"),
        min_length=1,
        description="Ranker modules to adapt: Linear layers and small id tables (name or prefix)",
    )

    @property
    def scaling(self) -> float:
        """The factor PEFT multiplies B @ A by (alpha / rank)."""
        return self.alpha / self.rank


class OnlineSettings(Group):
    """The online LoRA trainer (trainers.online, trainers.service)."""

    micro_batch: int = Field(
        256, ge=1, description="A trainer micro-batch closes at this many records (or at online.max_wait_s)"
    )
    micro_batch_s: float = Field(
        0.5,
        gt=0,
        description="With nothing arriving, the trainer's loop wakes this often (snapshots, waiting "
        "examples)",
    )
    delta_percentile: float = Field(95.0, gt=0, lt=100)
    delta_max_norm: float = Field(10.0, gt=0, description="Deltas with a larger norm are rejected")
    snapshot_every_s: float = Field(30.0, gt=0)
    # Measured in the live loop (benchmarks/live_loop.py, docs/limitations.md): at 0.003 / 0.2 the
    # adapters diverged on served traffic (online − frozen logit sd 3–4, guard resets), but that was
    # before a deadline step on n < min_step_examples took n / min_step_examples of the rates
    # (AdapterOptimizer.step): steps of a few examples each moved the adapter a full lr. 0.001 / 0.02
    # then recovered 57 % of the replay's handover drift, 0.002 / 0.1 110 % (60,000 impressions,
    # seeds 7–8); in the live loop (seeds 3, 5) 0.002 / 0.1 kept the logit sd at 0.5–0.9 (no
    # divergence) and the adapters' lift over the correction arm rose (docs/live-learning.md)
    lr: float = Field(0.002, gt=0, description="Adam learning rate of the online LoRA trainer")
    embedding_lr: float = Field(
        0.1, gt=0, description="SGD learning rate of LoRA on id tables (lora.targets like wide.category)"
    )
    # docs/live-learning.md ("Measured with the adapters served"): where the online AUC did not beat
    # the frozen one after the drift, the adapters still ranked the old season above the new one
    embedding_decay: float = Field(
        0.0,
        ge=0,
        description="Forgetting of the LoRA id tables: SGD weight decay, each step shrinks them by "
        "online.embedding_lr × this × the step's share of the rates; 0 keeps what they learned",
    )
    delta_window_steps: int = Field(50, ge=1, description="Steps in the ΔW direction-magnitude window")
    progressive_window: int = Field(2000, ge=10, description="Examples in rolling AUC/logloss windows")
    reset_margin: float = Field(0.01, ge=0, description="Adapter AUC below base by more than this is bad")
    reset_patience: int = Field(20, ge=1, description="Bad micro-batches in a row before an adapter reset")
    # trainers.online.OnlineTrainer._guard says why examples; measured under no loss (two equally
    # good scorers, steps of 4 examples): see the commit of issue 32 and docs/live-learning.md
    reset_patience_examples: int = Field(
        2000,
        ge=0,
        description="…and examples learned in a row while the loss stays significant, at most one "
        "online.progressive_window (then the loss is confirmed on evidence all new)",
    )
    guard_z: float = Field(
        1.96,
        gt=0,
        description="The guard resets only on a significant loss: when online − base AUC (paired, "
        "DeLong) + guard_z standard errors is still below −reset_margin",
    )
    correction_offset: bool = Field(
        True,
        description="Adapters learn the residual of what is served: each example's loss is taken "
        "with the user's per-category correction (state.feedback_lr, read from Redis) as a fixed "
        "logit offset (trainers.corrections)",
    )
    group: str = Field("adstream-trainer", description="Consumer group of the online trainer")
    dedupe_ids: int = Field(
        200_000, ge=0, description="Recent example event_ids the trainer remembers to skip re-deliveries"
    )
    hold_labels: bool = Field(
        True,
        description="online.label_mode hold: learn examples in impression order after their window closes",
    )
    # 0.5 s was the trainer's hop of click→served (0.53 s at P50 of 1.12 s in
    # benchmarks/freshness.py); a step of a few examples costs a few ms, and is taken at its
    # share of the learning rates (trainers.online.AdapterOptimizer.step)
    max_wait_s: float = Field(
        0.03,
        gt=0,
        description="A trainer micro-batch closes when its oldest example was produced this long ago (or "
        "at online.micro_batch records); an adapter's examples wait at most this long for a full step "
        "(freshness)",
    )
    # measured in benchmarks/online_drift.py (same seeds): see README / the benchmark's docstring
    label_mode: Literal["hold", "fn_weighted", "fn_calibrated"] = Field(
        "fn_weighted",
        description="Delayed feedback: hold (emit each impression once its window closes), or learn "
        "at once: a fake negative per impression, a positive duplicate at its click, with the "
        "fake-negative weighted (fn_weighted) or calibrated (fn_calibrated) loss (Ktena et al. 2019)",
    )
    snapshot_ttl_s: int = Field(
        30 * 24 * 3600, gt=0, description="TTL of an adapter's Redis snapshot (refreshed on every write)"
    )
    max_adapters: int = Field(
        4096, ge=1, description="Adapters the online trainer holds; the least recently trained is evicted"
    )
    min_step_examples: int = Field(
        64, ge=1, description="An adapter's examples wait for this many (or online.max_wait_s) before a step"
    )
    min_guard_examples: int = Field(
        500, ge=1, description="Examples in an adapter's window before its AUC guard may reset it"
    )
    min_guard_positives: int = Field(
        10, ge=1, description="Clicks in an adapter's window before its AUC guard may reset it"
    )

    @property
    def fn_loss(self) -> Literal["weighted", "calibrated"]:
        """The fake-negative loss of `label_mode` (hold learns finished labels: weighted)."""
        return "calibrated" if self.label_mode == "fn_calibrated" else "weighted"

    redis_retry_first_s: float = Field(
        0.05,
        gt=0,
        description="First wait before the trainer retries a Redis operation that failed with a transient "
        "error; the waits double up to online.redis_retry_max_s",
    )
    redis_retry_max_s: float = Field(
        2.0, gt=0, description="Longest wait between the trainer's Redis retries (>= redis_retry_first_s)"
    )
    redis_give_up_s: float = Field(
        300.0,
        ge=0,
        description="The trainer gives a Redis operation up (StoreError) once it has failed this long",
    )

    @model_validator(mode="after")
    def _redis_retry_waits(self) -> OnlineSettings:
        if self.redis_retry_first_s > self.redis_retry_max_s:
            raise ValueError(
                f"online.redis_retry_first_s ({self.redis_retry_first_s}) must be <= "
                f"online.redis_retry_max_s ({self.redis_retry_max_s})"
            )
        return self

    @property
    def redis_backoff(self) -> Backoff:
        """The backoff of the trainer's Redis operations (`schemas.retry`)."""
        return Backoff(self.redis_retry_first_s, self.redis_retry_max_s, self.redis_give_up_s)
