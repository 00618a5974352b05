"""The replica's ad catalog as columns (numpy), so recall filters and rerank read arrays, not objects.

Ads arrive from a catalog file at start and from `ad.catalog` live; an update of a known `ad_id`
replaces its row. Spend per campaign (for pacing) and impressions per ad (popularity, long tail)
are counted here from what this replica served and refreshed from the shared Redis totals.

Campaigns (`Campaign` on `ad.campaigns`) carry the budget, schedule and targeting their creatives
share: `servable(audience)` masks the rows a request may see (active, budget left, in schedule,
in the campaign's audience) before recall scores anything.

Bounded: at most `max_ads` rows; when full, a new ad takes the row of an inactive one (the
oldest such), and a catalog full of active ads refuses new ones (`CatalogFull`, the caller
counts it). The advertiser/category/campaign code tables are compacted to the ids still in use
when they grow past twice the rows, so ids that came and went do not accumulate.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import ClassVar

import numpy as np

from schemas.billing import PER_MILLE
from schemas.errors import SchemaError
from schemas.events import DEVICES, AdCreative, Campaign, Device
from schemas.vectors import text_vector
from trainers.models.features import stable_bucket
from trainers.models.ranker import RankerConfig

Vectorizer = Callable[[AdCreative], np.ndarray]

# the pCTR the popular rung (no model) assumes for every ad (serving.request)
POPULAR_PCTR = 0.02


class CatalogFull(SchemaError):
    """A new ad arrived while every row holds an active ad (`serving.catalog_max_ads`)."""


@dataclass(frozen=True)
class CatalogRow:
    """The strings of one ad (what the response and impression events need)."""

    ad_id: str
    campaign_id: str
    advertiser_id: str
    category: str


@dataclass(frozen=True)
class Audience:
    """Who a request is for, as targeting reads it: when (unix seconds), where (ISO country code),
    on which device, with which declared interests (None: not said)."""

    now_s: float
    geo: str | None = None
    device: Device | None = None
    interests: frozenset[str] = frozenset()

    @classmethod
    def of(
        cls, now: datetime, geo: str | None, device: Device | None, interests: Collection[str] | None
    ) -> Audience:
        return cls(now.timestamp(), geo, device, frozenset(interests or ()))


_DEVICE_BIT: dict[str, int] = {d: 1 << i for i, d in enumerate(DEVICES)}


@dataclass
class CampaignTable:
    """Per-campaign columns indexed by the catalog's campaign code: spend and budget (pacing),
    and what a `Campaign` entry says (whether one arrived, active, schedule, targeting)."""

    size: int = 64
    spend: np.ndarray = field(init=False)
    budget: np.ndarray = field(init=False)
    entity: np.ndarray = field(init=False)  # a Campaign entry set the budget (creatives' do not)
    active: np.ndarray = field(init=False)
    start: np.ndarray = field(init=False)
    end: np.ndarray = field(init=False)
    devices: np.ndarray = field(init=False)  # bit mask over DEVICES; 0: every device
    cpm: np.ndarray = field(init=False)  # bid type "cpm" (else "cpc", also without an entry)
    # the codes of campaigns that target by geo or interests, with their sets (few campaigns do)
    geo: dict[int, frozenset[str]] = field(default_factory=dict)
    interests: dict[int, frozenset[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.size
        self.spend, self.budget = np.zeros(n), np.zeros(n)
        self.entity, self.active = np.zeros(n, dtype=bool), np.ones(n, dtype=bool)
        self.start, self.end = np.full(n, -np.inf), np.full(n, np.inf)
        self.devices = np.zeros(n, dtype=np.uint8)
        self.cpm = np.zeros(n, dtype=bool)

    _COLUMNS: ClassVar[tuple[str, ...]] = (
        "spend", "budget", "entity", "active", "start", "end", "devices", "cpm"
    )  # fmt: skip

    def grow(self, size: int) -> None:
        fresh = CampaignTable(size)
        for name in self._COLUMNS:
            old, new = getattr(self, name), getattr(fresh, name)
            new[: old.shape[0]] = old
            setattr(self, name, new)
        self.size = size

    def remap(self, old_to_new: dict[int, int], size: int) -> None:
        """Re-number to new codes (compaction): campaigns left out are dropped."""
        fresh = CampaignTable(size)
        src = np.fromiter(old_to_new.keys(), dtype=np.int64, count=len(old_to_new))
        dst = np.fromiter(old_to_new.values(), dtype=np.int64, count=len(old_to_new))
        for name in self._COLUMNS:
            getattr(fresh, name)[dst] = getattr(self, name)[src]
            setattr(self, name, getattr(fresh, name))
        self.geo = {old_to_new[c]: v for c, v in self.geo.items() if c in old_to_new}
        self.interests = {old_to_new[c]: v for c, v in self.interests.items() if c in old_to_new}
        self.size = size

    def set(self, code: int, c: Campaign) -> None:
        self.entity[code] = True
        self.budget[code] = c.daily_budget
        self.active[code] = c.active
        self.cpm[code] = c.bid_type == "cpm"
        self.start[code] = -np.inf if c.start is None else c.start.timestamp()
        self.end[code] = np.inf if c.end is None else c.end.timestamp()
        t = c.targeting
        self.devices[code] = sum(_DEVICE_BIT[d] for d in t.devices)
        for table, values in ((self.geo, t.geo), (self.interests, t.interests)):
            if values:
                table[code] = frozenset(values)
            else:
                table.pop(code, None)

    def restricts(self) -> bool:
        """Whether any campaign entry limits who or when (inactive, a schedule, targeting):
        without one, every audience sees every campaign and requests skip the masks."""
        return bool(
            self.geo
            or self.interests
            or not self.active.all()
            or np.isfinite(self.start).any()
            or np.isfinite(self.end).any()
            or self.devices.any()
        )

    def eligible(self, n: int, audience: Audience) -> np.ndarray:
        """Campaign codes [0, n) whose ads this audience may see now (budget aside)."""
        ok: np.ndarray = (
            self.active[:n] & (self.start[:n] <= audience.now_s) & (audience.now_s < self.end[:n])
        )
        devices = self.devices[:n]
        bit = _DEVICE_BIT[audience.device] if audience.device is not None else 0
        ok &= (devices == 0) | ((devices & bit) != 0)
        for code, geos in self.geo.items():
            if code < n and audience.geo not in geos:
                ok[code] = False
        for code, wanted in self.interests.items():
            if code < n and wanted.isdisjoint(audience.interests):
                ok[code] = False
        return ok


class Catalog:
    """Column store of ads; rows are stable indices (an ad keeps its row across updates)."""

    def __init__(
        self,
        dim: int,
        ranker: RankerConfig,
        vectorize: Vectorizer,
        capacity: int = 1024,
        max_ads: int = 1_000_000,
        text_dim: int = 128,
    ) -> None:
        self.dim = dim
        # each row's words (category and title) as a hashed bag of words, what a request's
        # `query` is matched against (`schemas.vectors.text_vector`); 0: none kept
        self.text_dim = text_dim
        self.text = np.zeros((capacity, text_dim), dtype=np.float32)
        self.max_ads = max_ads
        self.refused = 0  # new ads refused by a catalog full of active ones
        self.ranker = ranker
        self.vectorize = vectorize
        self.n = 0
        self.rows: list[CatalogRow] = []
        self.row_of: dict[str, int] = {}
        self.vectors = np.zeros((capacity, dim), dtype=np.float32)
        self.bid = np.zeros(capacity)
        self.budget = np.zeros(capacity)
        self.active = np.zeros(capacity, dtype=bool)
        self.impressions = np.zeros(capacity)
        self.advertiser = np.zeros(capacity, dtype=np.int64)
        self.category = np.zeros(capacity, dtype=np.int64)
        self.campaign = np.zeros(capacity, dtype=np.int64)
        self.ids = np.zeros(
            (capacity, 4), dtype=np.int64
        )  # ranker buckets: ad, advertiser, campaign, category
        self.codes: dict[str, dict[str, int]] = {"advertiser": {}, "category": {}, "campaign": {}}
        self.campaigns = CampaignTable()
        self._compact_above = 0  # code tables larger than this (and than 2 rows + 64) are compacted
        self.version = 0

    def _grow(self) -> None:
        cap = self.vectors.shape[0] * 2
        for name in (
            "vectors",
            "text",
            "bid",
            "budget",
            "active",
            "impressions",
            "advertiser",
            "category",
            "campaign",
            "ids",
        ):
            old = getattr(self, name)
            new = np.zeros((cap, *old.shape[1:]), dtype=old.dtype)
            new[: old.shape[0]] = old
            setattr(self, name, new)

    def _free_row(self) -> int:
        """A row for a new ad: the next one, or (full) the first inactive ad's, which is dropped."""
        if self.n < self.max_ads:
            if self.n == self.vectors.shape[0]:
                self._grow()
            self.n += 1
            return self.n - 1
        inactive = np.flatnonzero(~self.active[: self.n])
        if inactive.shape[0] == 0:
            self.refused += 1
            raise CatalogFull(
                f"catalog holds {self.max_ads} active ads (serving.catalog_max_ads); new ad refused"
            )
        row = int(inactive[0])
        del self.row_of[self.rows[row].ad_id]
        self.impressions[row] = 0.0
        return row

    def _compact_codes(self) -> None:
        """Re-number the code tables to the ids the rows use now (keeps campaigns' spend/budget)."""
        n = self.n
        in_use = {
            "advertiser": {r.advertiser_id for r in self.rows[:n]},
            "category": {r.category for r in self.rows[:n]},
        }
        for kind, column in (("advertiser", self.advertiser), ("category", self.category)):
            table = {v: i for i, v in enumerate(sorted(in_use[kind]))}
            old = {c: v for v, c in self.codes[kind].items()}
            column[:n] = [table[old[int(c)]] for c in column[:n]]
            self.codes[kind] = table
        # campaigns in use: those of the rows and those with a Campaign entry (it may precede its ads)
        old_codes = self.codes["campaign"]
        entries = self.campaigns.entity & self.campaigns.active  # an inactive entry without ads goes
        with_entry = {v for v, c in old_codes.items() if entries[c]}
        used = sorted({r.campaign_id for r in self.rows[:n]} | with_entry)
        table = {v: i for i, v in enumerate(used)}
        self.campaigns.remap({old_codes[v]: i for v, i in table.items()}, max(64, len(table)))
        old = {c: v for v, c in old_codes.items()}
        self.campaign[:n] = [table[old[int(c)]] for c in self.campaign[:n]]
        self.codes["campaign"] = table
        self._compact_above = 2 * max(len(t) for t in self.codes.values())

    def _code(self, kind: str, value: str) -> int:
        table = self.codes[kind]
        code = table.get(value)
        if code is None:
            code = table[value] = len(table)
            if kind == "campaign" and code >= self.campaigns.size:
                self.campaigns.grow(2 * self.campaigns.size)
        return code

    def upsert(self, ad: AdCreative, vector: np.ndarray | None = None) -> int:
        """Add or replace one ad (its vector from `vectorize` unless given); returns its row."""
        row = self.row_of.get(ad.ad_id)
        entry = CatalogRow(ad.ad_id, ad.campaign_id, ad.advertiser_id, ad.category)
        if row is None:
            row = self._free_row()
            self.row_of[ad.ad_id] = row
            if row == len(self.rows):
                self.rows.append(entry)
        self.rows[row] = entry
        cfg = self.ranker
        vec = self.vectorize(ad) if vector is None else vector
        self.vectors[row] = np.asarray(vec, dtype=np.float32)[: self.dim]
        if self.text_dim:
            self.text[row] = text_vector(f"{ad.category} {ad.title}", self.text_dim)
        self.bid[row] = ad.bid
        self.budget[row] = ad.daily_budget
        self.active[row] = ad.active
        self.advertiser[row] = self._code("advertiser", ad.advertiser_id)
        self.category[row] = self._code("category", ad.category)
        camp = self.campaign[row] = self._code("campaign", ad.campaign_id)
        if not self.campaigns.entity[camp]:  # without a Campaign entry, the creative's budget stands
            self.campaigns.budget[camp] = ad.daily_budget
        self.ids[row] = (
            stable_bucket(ad.ad_id, cfg.ad_buckets, "ad"),
            stable_bucket(ad.advertiser_id, cfg.advertiser_buckets, "advertiser"),
            stable_bucket(ad.campaign_id, cfg.campaign_buckets, "campaign"),
            stable_bucket(ad.category, cfg.category_buckets, "category"),
        )
        self.version += 1
        if max(len(t) for t in self.codes.values()) > max(2 * self.n + 64, self._compact_above):
            self._compact_codes()
        return row

    def upsert_campaign(self, campaign: Campaign) -> None:
        """Add or replace a campaign's entry: its budget (from now on, not its creatives'),
        schedule and targeting."""
        known = campaign.campaign_id in self.codes["campaign"]
        if not known and int(self.campaigns.entity.sum()) >= self.max_ads:
            self.refused += 1
            raise CatalogFull(
                f"catalog holds {self.max_ads} campaign entries (serving.catalog_max_ads); refused"
            )
        code = self._code("campaign", campaign.campaign_id)
        self.campaigns.set(code, campaign)
        self.version += 1
        if max(len(t) for t in self.codes.values()) > max(2 * self.n + 64, self._compact_above):
            self._compact_codes()

    def servable(self, audience: Audience | None = None) -> np.ndarray:
        """Rows that may be shown: active, with budget left today and, given the request's
        audience, in their campaign's schedule and targeting (without one: budget and active only,
        for callers with no request, e.g. popularity priors)."""
        n = self.n
        camp = self.campaign[:n]
        t = self.campaigns
        ok: np.ndarray = self.active[:n] & (t.spend[camp] < t.budget[camp])
        if audience is not None and t.restricts():
            ok &= t.eligible(len(self.codes["campaign"]), audience)[camp]
        return ok

    def servable_many(self, audiences: Sequence[Audience]) -> np.ndarray:
        """`servable` of a batch's requests, one row each: the budget mask once, and each
        distinct audience's campaign mask once (none while no campaign restricts its audience)."""
        base = self.servable()
        out = np.repeat(base[None, :], len(audiences), axis=0)
        t = self.campaigns
        if not t.restricts():
            return out
        camp = self.campaign[: self.n]
        n_codes = len(self.codes["campaign"])
        masks: dict[Audience, np.ndarray] = {}
        for i, audience in enumerate(audiences):
            mask = masks.get(audience)
            if mask is None:
                mask = masks[audience] = t.eligible(n_codes, audience)[camp]
            out[i] &= mask
        return out

    def spend_of(self, rows: np.ndarray) -> np.ndarray:
        out: np.ndarray = self.campaigns.spend[self.campaign[rows]]
        return out

    def budget_of(self, rows: np.ndarray) -> np.ndarray:
        out: np.ndarray = self.campaigns.budget[self.campaign[rows]]
        return out

    def record_served(self, rows: np.ndarray, cost: np.ndarray | None = None) -> None:
        """Count the impressions of what this replica just served (and `cost`, when given, as
        spend: serving bills nothing itself; the day's billed spend comes from Redis)."""
        np.add.at(self.impressions, rows, 1.0)
        if cost is not None:
            np.add.at(self.campaigns.spend, self.campaign[rows], cost)

    def cpm_of(self, rows: np.ndarray) -> np.ndarray:
        """Whether each row's campaign pays per shown impression (`Campaign.bid_type` "cpm")."""
        out: np.ndarray = self.campaigns.cpm[self.campaign[rows]]
        return out

    def set_spend(self, spend: dict[str, float]) -> None:
        """Take the shared day's spend per campaign (from Redis), never lowering a local count."""
        for campaign_id, value in spend.items():
            code = self.codes["campaign"].get(campaign_id)
            if code is not None:
                self.campaigns.spend[code] = max(self.campaigns.spend[code], value)

    def reset_day(self) -> None:
        self.campaigns.spend[:] = 0.0

    def popular(self, k: int, audience: Audience | None = None) -> np.ndarray:
        """Servable rows (for `audience`, when given) by popularity prior (impressions + 1) × the
        bid's value per impression, best first: a CPC bid (per click) at the `POPULAR_PCTR` the
        popular rung assumes, a CPM bid (per thousand shown) / 1000, as the auction compares them."""
        ok = np.flatnonzero(self.servable(audience))
        if ok.shape[0] == 0:
            return ok
        per_imp = np.where(self.cpm_of(ok), 1.0 / PER_MILLE, POPULAR_PCTR)
        prior = (self.impressions[ok] + 1.0) * self.bid[ok] * per_imp
        top = np.argsort(-prior, kind="stable")[:k]
        return ok[top]
