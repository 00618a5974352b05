"""The audience side of a simulated market, as a publisher reports it on each request: every
user's country and device, the text of search requests, and campaigns that target some of them
(and a share that pays per thousand shown impressions, CPM, rather than per click).

Each part draws from its own child stream of the seed, apart from the traffic and the responses,
so the same config gives the same requests, clicks and conversions as before these existed.
Targeting does not change who clicks what (the truth model); it narrows who may be shown a
campaign's ads, which serving enforces (`serving.catalog`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import numpy as np

from schemas.events import BidType, Campaign, Device, Targeting
from workloads.config import MarketConfig
from workloads.world import World


@dataclass(frozen=True)
class Audience:
    """Each user's country (index into `geos`) and device (index into `devices`)."""

    geos: tuple[str, ...]
    devices: tuple[Device, ...]
    geo: np.ndarray
    device: np.ndarray

    def of(self, user: int) -> tuple[str, Device]:
        return self.geos[int(self.geo[user])], self.devices[int(self.device[user])]


def _draw(rng: np.random.Generator, shares: dict[str, float], n: int) -> tuple[tuple[str, ...], np.ndarray]:
    names = tuple(shares)
    p = np.array([shares[k] for k in names], dtype=float)
    return names, rng.choice(len(names), size=n, p=p / p.sum())


def draw_audience(cfg: MarketConfig) -> Audience:
    """Every user's country and device, by `geo_share` and `device_share`."""
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 3]))
    geos, geo = _draw(rng, cfg.geo_share, cfg.n_users)
    devices, device = _draw(rng, cfg.device_share, cfg.n_users)
    return Audience(geos, devices, geo, device)  # type: ignore[arg-type]  # checked by MarketConfig


def search_query(rng: np.random.Generator, world: World, user: int) -> str:
    """What a user types into a search box: the name of one of the categories they declared (one
    of their two likeliest, without declarations) and a word of its vocabulary, which its ads'
    titles carry."""
    declared = world.declared[user] if world.declared.size else np.zeros(0, np.int64)
    picks = declared if declared.shape[0] else np.argsort(-world.interests[user])[:2]
    category = int(picks[int(rng.integers(picks.shape[0]))])
    vocab = world.vocabularies[category]
    return f"{vocab[0]} {vocab[1 + int(rng.integers(len(vocab) - 1))]}"


def cpm_campaigns(cfg: MarketConfig) -> np.ndarray:
    """Which campaigns pay per thousand shown impressions: a bool per (advertiser, campaign index),
    each CPM with probability `cpm_share` (its own stream of the seed: the rest of the market is
    drawn as without it; none at share 0)."""
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 6]))
    draws = rng.random((cfg.n_advertisers, cfg.campaigns_per_advertiser))
    out: np.ndarray = draws < cfg.cpm_share
    return out


def campaigns(
    cfg: MarketConfig, world: World, include_new: bool, ts: datetime, cpm: np.ndarray | None = None
) -> list[Campaign]:
    """One `Campaign` entry per campaign of the catalog's ads (with `include_new`, of the ads that
    arrive later too), its budget the last of its creatives' (as serving took it before campaign
    entries existed); a `targeted_share` of them target a few countries or device classes; those
    `cpm` marks (default `cpm_campaigns(cfg)`) pay per thousand shown impressions."""
    cpm = cpm_campaigns(cfg) if cpm is None else cpm
    a = world.ads
    n = len(a.ad_ids) if include_new else cfg.n_ads
    budget: dict[tuple[int, int], float] = {}
    for i in range(n):
        budget[(int(a.advertiser[i]), int(a.campaign[i]))] = float(a.daily_budget[i])
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 5]))
    geos = [g for g, share in cfg.geo_share.items() if share > 0]
    devices: list[Device] = [d for d, share in cfg.device_share.items() if share > 0]  # type: ignore[misc]
    out = []
    for (adv, cmp), daily_budget in sorted(budget.items()):
        targeting = Targeting()
        if rng.random() < cfg.targeted_share:
            if rng.random() < 0.5:
                k = 1 + int(rng.integers(min(2, len(geos))))
                targeting = Targeting(geo=tuple(sorted(rng.choice(geos, size=k, replace=False).tolist())))
            else:
                k = 1 + int(rng.integers(min(2, len(devices))))
                picked = sorted(rng.choice(len(devices), size=k, replace=False).tolist())
                targeting = Targeting(devices=tuple(devices[i] for i in picked))
        campaign_id = f"cmp{adv:03d}_{cmp}"
        bid_type: BidType = "cpm" if cpm[adv, cmp] else "cpc"
        out.append(
            Campaign(event_id=f"{cfg.prefix}cmp-{campaign_id}", ts=ts, campaign_id=campaign_id,
                     advertiser_id=f"adv{adv:03d}", daily_budget=daily_budget, targeting=targeting,
                     bid_type=bid_type)
        )  # fmt: skip
    return out
