"""The knobs of a simulated ad market: one frozen dataclass, checked on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum

from schemas.errors import ConfigError
from schemas.events import DEVICES, MAX_VARIANTS, SLOTS

DEFAULT_START = datetime(2026, 1, 1, tzinfo=UTC)


class DriftMode(StrEnum):
    """How users' tastes change at the drift point (`MarketConfig.drift_mode`)."""

    redraw = "redraw"  # each drifted user redraws their taste
    trend = "trend"  # a shared category shift
    handover = "handover"  # the in-season categories change


class LoggingPolicy(StrEnum):
    """Which ads the open-loop market shows (`MarketConfig.policy`)."""

    random = "random"
    popularity = "popularity"
    epsilon = "epsilon"


DRIFT_MODES: tuple[str, ...] = tuple(m.value for m in DriftMode)
LOGGING_POLICIES: tuple[str, ...] = tuple(p.value for p in LoggingPolicy)


def _fail(name: str, value: object, why: str) -> None:
    raise ConfigError(f"MarketConfig.{name}={value!r}: {why}")


@dataclass(frozen=True)
class MarketConfig:
    """Everything that decides a simulated market; the same config gives the same events.

    `drift_at` and `new_ads_at` are a fraction of the run's impressions when in (0, 1), an
    impression index when ≥ 1, and off when None.
    """

    seed: int = 0
    n_users: int = 1000
    n_ads: int = 200
    n_categories: int = 12
    n_advertisers: int = 20
    campaigns_per_advertiser: int = 3
    # -- time --------------------------------------------------------------------------
    start: datetime = DEFAULT_START
    rate: float = 100.0  # ad requests per second of simulated time (on average)
    session_requests: float = 4.0  # mean requests per user session (geometric)
    session_gap_s: float = 8.0  # mean seconds between requests within a session
    # -- click model: logit = interest_scale·u[cat] + quality + advertiser + slot + pos + bias
    interest_scale: float = 1.0
    favorite_categories: int = 2
    favorite_boost: float = 3.0
    interest_noise: float = 0.5
    # declared interests (sign-up picks, sent with every request as `AdRequest.interests`): each
    # user's `declared_interests` truly top categories, each one swapped with probability
    # `declared_error` for a category outside that top (users misreport, or pick on a whim)
    declared_interests: int = 2
    declared_error: float = 0.25
    bias: float = -4.6
    ad_quality_sd: float = 0.3
    advertiser_sd: float = 0.3
    position_bias: tuple[float, ...] = (0.0, -0.35, -0.6, -0.8, -0.95, -1.1, -1.2, -1.3, -1.4, -1.5)
    slot_effect: dict[str, float] = field(
        default_factory=lambda: {"feed": 0.0, "search": 0.6, "splash": -0.4}
    )
    slot_share: dict[str, float] = field(default_factory=lambda: {"feed": 0.6, "search": 0.3, "splash": 0.1})
    slot_k: dict[str, int] = field(default_factory=lambda: {"feed": 4, "search": 3, "splash": 1})
    click_delay_s: float = 4.0  # mean seconds from impression to click
    # -- dwell: lognormal, median grows with match; short bounces when the match is poor
    dwell_median_ms: float = 20_000.0
    dwell_sigma: float = 0.8
    bounce_prob_max: float = 0.5  # bounce probability at zero match, falling to 5% of it
    # -- conversions: hazard = base + Σ lift[channel] over touches (each touch an impression)
    channel_lift: dict[str, float] = field(
        default_factory=lambda: {"feed": 0.002, "search": 0.008, "splash": 0.004}
    )
    base_conversion: float = 0.002  # organic conversions per ad request
    conversion_delay_s: float = 600.0  # mean delay from touch to caused conversion
    conversion_value_mean: float = 40.0
    # -- non-stationarity ------------------------------------------------------------------
    drift_at: float | None = 0.5
    drift_share: float = 0.3
    # redraw: each drifted user draws new tastes (idiosyncratic); trend: the drifted segment's
    # interest in `trend_up` shared categories rises by `trend_delta` and in `trend_down` falls
    # by it (a seasonal / holiday trend; which categories is drawn from the seed); handover: the
    # segment's interest is raised by `trend_delta` in `trend_up` in-season categories before
    # the drift and in `trend_up` other ones after it (one season handing over to the next: as
    # many hot categories, as hot, before and after, so clicks are as easy to predict)
    drift_mode: str = "redraw"
    trend_up: int = 2
    trend_down: int = 2
    trend_delta: float = 2.0
    new_ads_at: float | None = 0.5
    n_new_ads: int = 20
    # -- creative variants (`workloads.variants`): each ad gets `n_variants` (0: none, as before);
    # a variant's effect on the click logit is the lift of its emphasis in the user's segment
    # (normal, sd `variant_effect_sd`, centred over segments) plus a main effect of the emphasis
    # (sd `variant_main_sd`) plus its own part (sd `variant_own_sd`); the open loop
    # shows a uniformly random variant and records it with its propensity
    n_variants: int = 0
    n_segments: int = 4
    variant_effect_sd: float = 0.8
    variant_own_sd: float = 0.2
    variant_main_sd: float = 0.3  # an emphasis's effect shared by every segment
    # -- audience (`workloads.audience`): users' countries and devices (sent with every request
    # as `AdRequest.geo` / `device`), and the share of campaigns (`Market.campaigns`) that target
    # one or two countries or device classes; search requests carry a query (`AdRequest.query`)
    geo_share: dict[str, float] = field(
        default_factory=lambda: {"US": 0.4, "GB": 0.2, "DE": 0.15, "FR": 0.15, "JP": 0.1}
    )
    device_share: dict[str, float] = field(
        default_factory=lambda: {"mobile": 0.6, "desktop": 0.3, "tablet": 0.08, "tv": 0.02}
    )
    targeted_share: float = 0.2
    # -- billing (`schemas.billing`): the share of campaigns that pay per thousand shown
    # impressions (CPM, `Campaign.bid_type`; their creatives bid per mille, `Market.creative`),
    # the rest per click. 0 by default: the markets of earlier runs (and their benchmark figures)
    # stay as they were; the demo's closed loop runs with some (`deploy.demo.DemoSpec.cpm_share`)
    cpm_share: float = 0.0
    # -- logging policy (open loop) --------------------------------------------------------
    policy: str = "random"  # random | popularity | epsilon
    epsilon: float = 0.1
    id_prefix: str | None = None  # event ids are f"{id_prefix}{counter}"; default f"s{seed}-"

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_time()
        self._check_drift()
        self._check_slots()
        self._check_policy()
        self._check_variants()
        self._check_audience()

    def _check_sizes(self) -> None:
        for name in ("n_users", "n_ads", "n_categories", "n_advertisers", "campaigns_per_advertiser"):
            if getattr(self, name) < 1:
                _fail(name, getattr(self, name), "must be >= 1")
        if self.n_new_ads < 0:
            _fail("n_new_ads", self.n_new_ads, "must be >= 0")
        if not 0 <= self.favorite_categories <= self.n_categories:
            _fail("favorite_categories", self.favorite_categories, "must be in [0, n_categories]")
        if not 0 <= self.declared_interests <= self.n_categories:
            _fail("declared_interests", self.declared_interests, "must be in [0, n_categories]")
        if not 0 <= self.declared_error <= 1:
            _fail("declared_error", self.declared_error, "must be a probability in [0, 1]")

    def _check_time(self) -> None:
        if self.start.tzinfo is None:
            _fail("start", self.start, "must be timezone-aware")
        if not self.rate > 0:
            _fail("rate", self.rate, "must be > 0 requests per simulated second")
        if not self.session_requests >= 1:
            _fail("session_requests", self.session_requests, "must be >= 1 request per session")
        if not self.session_gap_s > 0:
            _fail("session_gap_s", self.session_gap_s, "must be > 0 seconds")
        for name in ("drift_at", "new_ads_at"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                _fail(name, value, "must be a fraction in (0, 1), an index >= 1, or None")

    def _check_drift(self) -> None:
        if not 0 <= self.drift_share <= 1:
            _fail("drift_share", self.drift_share, "must be in [0, 1]")
        if self.drift_mode not in DRIFT_MODES:
            _fail("drift_mode", self.drift_mode, f"must be one of {', '.join(DRIFT_MODES)}")
        too_many = (self.drift_mode == "trend" and self.trend_up + self.trend_down > self.n_categories) or (
            self.drift_mode == "handover" and 2 * self.trend_up > self.n_categories
        )
        if self.trend_up < 0 or self.trend_down < 0 or too_many:
            why = "trend_up and trend_down must be >= 0 with a sum <= n_categories"
            _fail("trend_up", (self.trend_up, self.trend_down), why)
        if not (math.isfinite(self.trend_delta) and self.trend_delta >= 0):
            _fail("trend_delta", self.trend_delta, "must be a finite number >= 0")

    def _check_slots(self) -> None:
        for name in ("slot_effect", "slot_share", "slot_k", "channel_lift"):
            keys = set(getattr(self, name))
            if keys != set(SLOTS):
                _fail(name, getattr(self, name), f"needs exactly the slots {list(SLOTS)}")
        if any(v < 0 for v in self.slot_share.values()) or sum(self.slot_share.values()) <= 0:
            _fail("slot_share", self.slot_share, "needs non-negative shares with a positive sum")
        if any(not 1 <= k <= len(self.position_bias) for k in self.slot_k.values()):
            _fail("slot_k", self.slot_k, f"each k must be in [1, {len(self.position_bias)}]")
        if any(v < 0 for v in self.channel_lift.values()) or self.base_conversion < 0:
            _fail("channel_lift", self.channel_lift, "lifts and base_conversion must be >= 0")
        if self.n_ads < max(self.slot_k.values()):
            _fail("n_ads", self.n_ads, f"must be >= the largest slot_k ({max(self.slot_k.values())})")

    def _check_policy(self) -> None:
        if self.policy not in LOGGING_POLICIES:
            _fail("policy", self.policy, "must be random, popularity or epsilon")
        if not 0 <= self.epsilon <= 1:
            _fail("epsilon", self.epsilon, "must be in [0, 1]")

    def _check_variants(self) -> None:
        if not 0 <= self.n_variants <= MAX_VARIANTS:
            _fail("n_variants", self.n_variants, f"must be in [0, {MAX_VARIANTS}]")
        if self.n_segments < 1:
            _fail("n_segments", self.n_segments, "must be >= 1")
        for name in ("variant_effect_sd", "variant_own_sd", "variant_main_sd"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                _fail(name, value, "must be a finite number >= 0")

    def _check_audience(self) -> None:
        for name, known in (("geo_share", None), ("device_share", DEVICES)):
            shares: dict[str, float] = getattr(self, name)
            if (
                any(not (math.isfinite(v) and v >= 0) for v in shares.values())
                or not sum(shares.values()) > 0
            ):
                _fail(name, shares, "needs non-negative shares with a positive sum")
            bad = [k for k in shares if (k not in known if known else not (len(k) == 2 and k.isupper()))]
            if bad:
                what = f"one of {list(known)}" if known else "an ISO 3166-1 alpha-2 code (FR)"
                _fail(name, shares, f"{bad[0]!r} is not {what}")
        if not 0 <= self.targeted_share <= 1:
            _fail("targeted_share", self.targeted_share, "must be in [0, 1]")
        if not 0 <= self.cpm_share <= 1:
            _fail("cpm_share", self.cpm_share, "must be in [0, 1]")

    @property
    def prefix(self) -> str:
        """The prefix of every event id of this market."""
        return self.id_prefix if self.id_prefix is not None else f"s{self.seed}-"


def resolve_at(at: float | None, n_impressions: int) -> int | None:
    """The impression index where a fractional or absolute change point falls (None = never)."""
    if at is None:
        return None
    if at < 1:
        return int(at * n_impressions)
    return int(at)
