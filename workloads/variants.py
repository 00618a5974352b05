"""Creative variants in the simulated market, with known truth: a variant lifts or lowers its
ad's click logit by how its emphasis (the slot its headline leads with: price, promotion,
benefit …) suits the user's segments.

Segments are groups of categories (dealt out evenly over `n_segments`); a user belongs to each
in proportion to their taste's share in its categories, `share[u, s]` (a softmax of the user's
interests before any drift, summed per group), and `segment[u]` is their main one. Truth:

    effect(user, ad, v) = Σ_s share[user, s] · (lift[s, emphasis(ad, v)] + own[ad, v, s]),

added to the market's click logit (`Market.true_pctr(…, variant_id=…)`). What a user engages
with — their state vector — tells their shares: `state_vectors` is that vector as the streams
worker comes to hold it, the shared content vectors (`schemas.vectors`) of the categories
weighted by the same softmax, so the effect is linear in it wherever those vectors are
independent (12 categories in 32 dimensions).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schemas.events import CREATIVE_SLOTS, CreativeVariant
from schemas.vectors import content_vector


@dataclass(frozen=True)
class VariantWorld:
    """Segments, emphases and effects of every ad's variants, drawn once from the seed."""

    segment: np.ndarray  # (n_users,) int: each user's main segment
    share: np.ndarray  # (n_users, n_segments): each user's membership of each segment, rows sum to 1
    segment_of_category: np.ndarray  # (n_categories,) int
    lift: np.ndarray  # (n_segments, len(CREATIVE_SLOTS)) logit lift of an emphasis in a segment
    emphasis: np.ndarray  # (n_ads, n_variants) index into CREATIVE_SLOTS
    own: np.ndarray  # (n_ads, n_variants, n_segments) each variant's own part, per segment

    @property
    def n_variants(self) -> int:
        return int(self.emphasis.shape[1])

    def effects(self, users: np.ndarray, ads: np.ndarray) -> np.ndarray:
        """The logit effect of each variant, (len(users), n_variants), for user-ad pairs."""
        users, ads = np.asarray(users, dtype=np.int64), np.asarray(ads, dtype=np.int64)
        share = self.share[users]  # (n, S)
        per_segment = self.lift[:, self.emphasis[ads]].transpose(1, 2, 0) + self.own[ads]  # (n, V, S)
        out: np.ndarray = np.einsum("nvs,ns->nv", per_segment, share)
        return out


def build_variant_world(
    seed: int,
    interests: np.ndarray,
    n_ads: int,
    n_variants: int,
    n_segments: int,
    effect_sd: float,
    own_sd: float,
    main_sd: float = 0.3,
) -> VariantWorld:
    """Draw the variant truth from its own child stream of the seed (the rest of the world is
    unchanged by it). Each ad's variants take distinct emphases while there are enough slots."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 7]))
    n_categories = interests.shape[1]
    segment_of_category = rng.permutation(np.arange(n_categories) % n_segments)
    share = taste_weights(interests) @ np.eye(n_segments)[segment_of_category]
    segment = np.argmax(share, axis=1)
    # per segment, centred over the segments (what differs between segments), plus a main effect
    # of each emphasis shared by all of them
    per_segment = rng.normal(0.0, effect_sd, size=(n_segments, len(CREATIVE_SLOTS)))
    per_segment -= per_segment.mean(axis=0, keepdims=True)
    lift = per_segment + rng.normal(0.0, main_sd, size=(1, len(CREATIVE_SLOTS)))
    slots = len(CREATIVE_SLOTS)
    emphasis = np.stack(
        [np.resize(rng.permutation(slots), n_variants) for _ in range(n_ads)]
    ) if n_ads else np.zeros((0, n_variants), dtype=np.int64)  # fmt: skip
    own = rng.normal(0.0, own_sd, size=(n_ads, n_variants, n_segments))
    return VariantWorld(segment, share, segment_of_category, lift, emphasis.astype(np.int64), own)


def taste_weights(interests: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Each user's weight on each category, (n_users, n_categories): a softmax of the interests."""
    z = interests / temperature
    w = np.exp(z - z.max(axis=1, keepdims=True))
    out: np.ndarray = w / w.sum(axis=1, keepdims=True)
    return out


def variant_creatives(world: VariantWorld, ad: int, title: str) -> tuple[CreativeVariant, ...]:
    """The contract variants of an ad (`v0` … `v{n-1}`), each saying what it emphasises."""
    out = []
    for v in range(world.n_variants):
        slot = CREATIVE_SLOTS[int(world.emphasis[ad, v])]
        out.append(
            CreativeVariant(
                variant_id=f"v{v}", locale="en", headline=f"{title} — {slot}",
                body=f"{title}: see the {slot}.", cta="Shop now", disclosure="Sponsored",
                emphasis=slot,  # type: ignore[arg-type]
            )
        )  # fmt: skip
    return tuple(out)


def variant_index(variant_id: str, n_variants: int) -> int | None:
    """The index of a market variant id (`v3` → 3), None for anything else.

    >>> variant_index("v3", 4), variant_index("v4", 4), variant_index("zh-h0b0c0", 4)
    (3, None, None)
    """
    tail = variant_id[1:]
    if variant_id.startswith("v") and tail.isdigit() and int(tail) < n_variants:
        return int(tail)
    return None


def state_vectors(
    interests: np.ndarray, categories: list[str], dim: int, temperature: float = 1.0
) -> np.ndarray:
    """Each user's state vector, (n_users, dim), unit length: the content vectors of the
    categories, weighted by a softmax of the user's interest in them."""
    basis = np.asarray([content_vector(c, c, dim) for c in categories], dtype=np.float64)
    x = taste_weights(interests, temperature) @ basis
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    out: np.ndarray = x / np.where(norm > 0, norm, 1.0)
    return out
