"""The static world of a simulated market: categories, titles, ads, advertisers and user tastes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from workloads.config import MarketConfig

CATEGORY_NAMES = (
    "shoes", "travel", "games", "finance", "beauty", "electronics", "books", "food",
    "fitness", "home", "pets", "music", "auto", "fashion", "kids", "garden",
    "movies", "sports", "health", "education", "jewelry", "outdoor", "office", "crafts",
)  # fmt: skip
GENERIC_WORDS = ("new", "best", "deal", "sale", "top", "premium", "smart", "fresh", "classic", "pro")
_ONSETS = ("b", "br", "c", "d", "f", "g", "gl", "k", "l", "m", "n", "p", "pl", "r", "s", "st", "t", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
_CODAS = ("", "n", "r", "s", "x", "l", "m", "k")


def category_names(n: int) -> list[str]:
    """Readable names for n categories (`cat24`, `cat25`… beyond the built-in list)."""
    return [CATEGORY_NAMES[i] if i < len(CATEGORY_NAMES) else f"cat{i:02d}" for i in range(n)]


def _word(rng: np.random.Generator) -> str:
    syllables = int(rng.integers(2, 4))
    return "".join(
        _ONSETS[int(rng.integers(len(_ONSETS)))]
        + _VOWELS[int(rng.integers(len(_VOWELS)))]
        + _CODAS[int(rng.integers(len(_CODAS)))]
        for _ in range(syllables)
    )


def category_vocabularies(rng: np.random.Generator, categories: list[str], size: int = 8) -> list[list[str]]:
    """Generated words per category, so titles carry their category's vocabulary."""
    return [[name, *(_word(rng) for _ in range(size))] for name in categories]


def make_title(rng: np.random.Generator, vocab: list[str]) -> str:
    """A creative title: a generic word, then two to four words of the ad's category."""
    n = int(rng.integers(2, 5))
    picks = rng.choice(len(vocab), size=min(n, len(vocab)), replace=False)
    words = [GENERIC_WORDS[int(rng.integers(len(GENERIC_WORDS)))], *(vocab[int(i)] for i in picks)]
    return " ".join(words).capitalize()


def draw_interests(rng: np.random.Generator, n_users: int, cfg: MarketConfig) -> np.ndarray:
    """Latent user×category interest: small noise plus a boost on a few favourite categories."""
    u = rng.normal(0.0, cfg.interest_noise, size=(n_users, cfg.n_categories))
    for i in range(n_users):
        favs = rng.choice(cfg.n_categories, size=cfg.favorite_categories, replace=False)
        u[i, favs] += cfg.favorite_boost
    return u


def declare_interests(rng: np.random.Generator, interests: np.ndarray, k: int, error: float) -> np.ndarray:
    """Each user's declared categories, [n_users, k]: their k truly top ones (by `interests`),
    each swapped with probability `error` for a random category outside that top."""
    n_users, n_cats = interests.shape
    top = np.argsort(-interests, axis=1, kind="stable")[:, :k].astype(np.int64)
    declared = top.copy()
    wrong = rng.random((n_users, k)) < error
    for u, j in zip(*np.nonzero(wrong), strict=True):
        others = np.setdiff1d(np.arange(n_cats), np.concatenate([top[u], declared[u]]))
        if others.shape[0]:
            declared[u, j] = others[int(rng.integers(others.shape[0]))]
    return declared


@dataclass(frozen=True)
class Ads:
    """Column arrays of every ad the market will ever have (initial ones first, then new ones)."""

    ad_ids: list[str]
    category: np.ndarray  # int index into categories
    advertiser: np.ndarray  # int index
    campaign: np.ndarray  # int index within its advertiser
    bid: np.ndarray
    daily_budget: np.ndarray
    quality: np.ndarray
    titles: list[str]


def draw_ads(rng: np.random.Generator, n: int, cfg: MarketConfig, vocabs: list[list[str]]) -> Ads:
    """Ads spread over categories and advertisers, with CPC bids, budgets and quality effects."""
    category = rng.integers(cfg.n_categories, size=n)
    advertiser = rng.integers(cfg.n_advertisers, size=n)
    campaign = rng.integers(cfg.campaigns_per_advertiser, size=n)
    bid = np.round(np.exp(rng.normal(np.log(0.8), 0.5, size=n)), 4) + 0.01
    daily_budget = np.round(bid * rng.uniform(100.0, 1000.0, size=n), 2) + 1.0
    quality = rng.normal(0.0, cfg.ad_quality_sd, size=n)
    titles = [make_title(rng, vocabs[int(c)]) for c in category]
    ad_ids = [f"ad{i:05d}" for i in range(n)]
    return Ads(ad_ids, category, advertiser, campaign, bid, daily_budget, quality, titles)


@dataclass(frozen=True)
class World:
    """Users, ads and effects of a market, drawn once from the seed."""

    categories: list[str]
    vocabularies: list[list[str]]
    interests: np.ndarray  # before drift, (n_users, n_categories)
    interests_after: np.ndarray  # after drift (drifted rows differ)
    drift_users: np.ndarray  # bool mask of users whose taste changes
    advertiser_effect: np.ndarray
    ads: Ads
    # trend / handover modes: the categories whose interest rises / falls at the drift
    trend_up: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    trend_down: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # declared interests (category indices, [n_users, declared_interests]): see declare_interests
    declared: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))


def build_world(cfg: MarketConfig) -> World:
    """Draw the world from independent child streams of the seed (changing one part of the
    config, e.g. the drift share, leaves the users and ads as they were)."""
    s_words, s_users, s_ads, s_adv, s_drift, s_declared = (
        np.random.default_rng(s) for s in np.random.SeedSequence(cfg.seed).spawn(6)
    )
    categories = category_names(cfg.n_categories)
    vocabs = category_vocabularies(s_words, categories)
    interests = draw_interests(s_users, cfg.n_users, cfg)
    declared = declare_interests(s_declared, interests, cfg.declared_interests, cfg.declared_error)
    ads = draw_ads(s_ads, cfg.n_ads + cfg.n_new_ads, cfg, vocabs)
    advertiser_effect = s_adv.normal(0.0, cfg.advertiser_sd, size=cfg.n_advertisers)
    drift_users = s_drift.random(cfg.n_users) < cfg.drift_share
    if cfg.drift_mode == "trend":
        up, down, shift = trend_shift(s_drift, cfg)
        interests_after = interests + np.where(drift_users[:, None], shift, 0.0)
        return World(
            categories,
            vocabs,
            interests,
            interests_after,
            drift_users,
            advertiser_effect,
            ads,
            up,
            down,
            declared,
        )
    if cfg.drift_mode == "handover":
        before, after, shift_before, shift_after = handover_shift(s_drift, cfg)
        segment = drift_users[:, None]
        return World(
            categories,
            vocabs,
            interests + np.where(segment, shift_before, 0.0),
            interests + np.where(segment, shift_after, 0.0),
            drift_users,
            advertiser_effect,
            ads,
            after,
            before,
            declared,
        )
    fresh = draw_interests(s_drift, cfg.n_users, cfg)
    interests_after = np.where(drift_users[:, None], fresh, interests)
    return World(
        categories, vocabs, interests, interests_after, drift_users, advertiser_effect, ads, declared=declared
    )


def handover_shift(
    rng: np.random.Generator, cfg: MarketConfig
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One season handing over to the next: (in-season categories before, after, the interest
    shift per category before, after). `trend_up` categories each, disjoint, raised by
    `trend_delta`: the same number of hot categories, as hot, on both sides of the drift."""
    picks = rng.permutation(cfg.n_categories)
    k = cfg.trend_up
    before, after = np.sort(picks[:k]), np.sort(picks[k : 2 * k])
    shift_before, shift_after = np.zeros(cfg.n_categories), np.zeros(cfg.n_categories)
    shift_before[before] = cfg.trend_delta
    shift_after[after] = cfg.trend_delta
    return before, after, shift_before, shift_after


def trend_shift(rng: np.random.Generator, cfg: MarketConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A shared trend: (rising categories, falling categories, per-category interest shift).

    The same shift applies to every drifted user, so the post-drift truth is the old one plus a
    category effect — what a model can learn from everyone's clicks, unlike a taste redraw.
    """
    picks = rng.permutation(cfg.n_categories)
    up, down = np.sort(picks[: cfg.trend_up]), np.sort(picks[cfg.trend_up : cfg.trend_up + cfg.trend_down])
    shift = np.zeros(cfg.n_categories)
    shift[up] += cfg.trend_delta
    shift[down] -= cfg.trend_delta
    return up, down, shift
