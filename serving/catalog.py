"""The replica's ad catalog as columns (numpy), so recall filters and rerank read arrays, not objects.

Ads arrive from a catalog file at start and from `ad.catalog` live; an update of a known `ad_id`
replaces its row. Spend per campaign (for pacing) and impressions per ad (popularity, long tail)
are counted here from what this replica served and refreshed from the shared Redis totals.

Bounded: at most `max_ads` rows; when full, a new ad takes the row of an inactive one (the
oldest such), and a catalog full of active ads refuses new ones (`CatalogFull`, the caller
counts it). The advertiser/category/campaign code tables are compacted to the ids still in use
when they grow past twice the rows, so ids that came and went do not accumulate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from schemas.errors import SchemaError
from schemas.events import AdCreative
from trainers.models.features import stable_bucket
from trainers.models.ranker import RankerConfig

Vectorizer = Callable[[AdCreative], np.ndarray]


class CatalogFull(SchemaError):
    """A new ad arrived while every row holds an active ad (`serving.catalog_max_ads`)."""


@dataclass(frozen=True)
class CatalogRow:
    """The strings of one ad (what the response and impression events need)."""

    ad_id: str
    campaign_id: str
    advertiser_id: str
    category: str


class Catalog:
    """Column store of ads; rows are stable indices (an ad keeps its row across updates)."""

    def __init__(
        self,
        dim: int,
        ranker: RankerConfig,
        vectorize: Vectorizer,
        capacity: int = 1024,
        max_ads: int = 1_000_000,
    ) -> None:
        self.dim = dim
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
        self.campaign_spend = np.zeros(64)
        self.campaign_budget = np.zeros(64)
        self.version = 0

    def _grow(self) -> None:
        cap = self.vectors.shape[0] * 2
        for name in (
            "vectors",
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
        used = sorted({r.campaign_id for r in self.rows[:n]})
        table = {v: i for i, v in enumerate(used)}
        old_codes = self.codes["campaign"]
        size = max(64, len(table))
        spend, budget = np.zeros(size), np.zeros(size)
        for v, i in table.items():
            spend[i] = self.campaign_spend[old_codes[v]]
            budget[i] = self.campaign_budget[old_codes[v]]
        old = {c: v for v, c in old_codes.items()}
        self.campaign[:n] = [table[old[int(c)]] for c in self.campaign[:n]]
        self.codes["campaign"] = table
        self.campaign_spend, self.campaign_budget = spend, budget

    def _code(self, kind: str, value: str) -> int:
        table = self.codes[kind]
        code = table.get(value)
        if code is None:
            code = table[value] = len(table)
            if kind == "campaign" and code >= self.campaign_spend.shape[0]:
                self.campaign_spend = np.append(self.campaign_spend, np.zeros(self.campaign_spend.shape[0]))
                self.campaign_budget = np.append(
                    self.campaign_budget, np.zeros(self.campaign_budget.shape[0])
                )
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
        self.bid[row] = ad.bid
        self.budget[row] = ad.daily_budget
        self.active[row] = ad.active
        self.advertiser[row] = self._code("advertiser", ad.advertiser_id)
        self.category[row] = self._code("category", ad.category)
        camp = self.campaign[row] = self._code("campaign", ad.campaign_id)
        self.campaign_budget[camp] = ad.daily_budget
        self.ids[row] = (
            stable_bucket(ad.ad_id, cfg.ad_buckets, "ad"),
            stable_bucket(ad.advertiser_id, cfg.advertiser_buckets, "advertiser"),
            stable_bucket(ad.campaign_id, cfg.campaign_buckets, "campaign"),
            stable_bucket(ad.category, cfg.category_buckets, "category"),
        )
        self.version += 1
        if max(len(t) for t in self.codes.values()) > 2 * self.n + 64:
            self._compact_codes()
        return row

    def servable(self) -> np.ndarray:
        """Rows that may be shown at all: active and with budget left today."""
        n = self.n
        spend = self.campaign_spend[self.campaign[:n]]
        return self.active[:n] & (spend < self.campaign_budget[self.campaign[:n]])

    def spend_of(self, rows: np.ndarray) -> np.ndarray:
        out: np.ndarray = self.campaign_spend[self.campaign[rows]]
        return out

    def budget_of(self, rows: np.ndarray) -> np.ndarray:
        out: np.ndarray = self.campaign_budget[self.campaign[rows]]
        return out

    def record_served(self, rows: np.ndarray, cost: np.ndarray) -> None:
        """Count impressions and expected spend of what this replica just served."""
        np.add.at(self.impressions, rows, 1.0)
        np.add.at(self.campaign_spend, self.campaign[rows], cost)

    def set_spend(self, spend: dict[str, float]) -> None:
        """Take the shared day's spend per campaign (from Redis), never lowering a local count."""
        for campaign_id, value in spend.items():
            code = self.codes["campaign"].get(campaign_id)
            if code is not None:
                self.campaign_spend[code] = max(self.campaign_spend[code], value)

    def reset_day(self) -> None:
        self.campaign_spend[:] = 0.0

    def popular(self, k: int) -> np.ndarray:
        """Servable rows by popularity prior (impressions + 1) × bid, best first."""
        ok = np.flatnonzero(self.servable())
        if ok.shape[0] == 0:
            return ok
        prior = (self.impressions[ok] + 1.0) * self.bid[ok]
        top = np.argsort(-prior, kind="stable")[:k]
        return ok[top]
