"""Shapley-value attribution per journey, over the journey's distinct channels.

The game: a coalition S of channels is worth v(S), the conversion rate of journeys whose
distinct channels are exactly S (conversions / (conversions + null journeys)), shrunk toward a
non-negative linear-probability model v₀ + Σ_{c∈S} β_c fitted to all journeys (NNLS, weighted
by journeys) with the weight of `prior_journeys` pseudo-journeys; a coalition never observed
takes the model's value, and v(∅) = v₀, the fitted baseline rate. For each distinct channel
set J the Shapley values φ_c over the players J sum to v(J) − v₀; the set's conversions and
value are split in proportion to max(φ_c, 0) (equal split if none is positive), so credits sum
to the totals. Exact (every subset of J, vectorised over all sets of one size) when
|J| ≤ `exact_max`; above it, `permutations` random orders per set (seeded), with the standard
error of each channel's credit reported in `meta["se"]`. With up to 20 channels in all, v is
tabulated over every coalition and the exact values of all journeys come at once from its
Harsanyi dividends (`_exact_all`); with more, each set's subsets are enumerated.

The "simplified Shapley" of Ads Data Hub is a different, cheaper thing: linear credit over a
journey's distinct channels (`attribution.models.heuristics.distinct_linear`).
"""

from __future__ import annotations

from math import factorial

import numpy as np
from scipy.optimize import nnls

from attribution.paths import AttributionInputError, Paths

MAX_CHANNELS = 63  # a channel set is one uint64 bitmask
_CHUNK_VALUES = 4_000_000  # subset values held at once (memory bound of the exact pass)
_FIT_SETS = 50_000  # the backoff model is fitted on at most this many (largest) sets
DENSE_MAX = 20  # up to this many channels v is tabulated over all 2^n coalitions


def channel_masks(paths: Paths) -> np.ndarray:
    """Bitmask of each path's distinct channels (0 for an empty path)."""
    if len(paths.channels) > MAX_CHANNELS:
        raise AttributionInputError(
            f"shapley supports at most {MAX_CHANNELS} channels; these paths have {len(paths.channels)}"
        )
    bits = np.left_shift(np.uint64(1), paths.channel.astype(np.uint64))
    out = np.zeros(paths.n, np.uint64)
    full = paths.lengths > 0
    # reduceat over the non-empty paths' starts only: an empty segment would yield the next
    # path's first touch (or index past the end when last)
    if np.any(full):
        out[full] = np.bitwise_or.reduceat(bits, paths.offsets[:-1][full])
    return out


class CoalitionValue:
    """v(S) for bitmasks S, from the journeys' exact-set rates and the fitted backoff model."""

    def __init__(self, masks: np.ndarray, conv: np.ndarray, nulls: np.ndarray, n_channels: int,
                 prior_journeys: float = 5.0) -> None:  # fmt: skip
        self.masks = masks  # sorted, unique
        journeys = conv + nulls
        self.n_channels = n_channels
        top = np.argsort(-journeys, kind="stable")[:_FIT_SETS]
        bits = ((masks[top, None] >> np.arange(n_channels, dtype=np.uint64)) & np.uint64(1)).astype(float)
        design = np.hstack([np.ones((top.shape[0], 1)), bits])
        sw = np.sqrt(journeys[top])
        rate = np.divide(conv[top], journeys[top], out=np.zeros(top.shape[0]), where=journeys[top] > 0)
        # the same least squares on the (n_channels + 1)-row triangle of a QR: nnls stays tiny
        q, r = np.linalg.qr(design * sw[:, None])
        coef, _ = nnls(r, q.T @ (rate * sw), maxiter=50 * (n_channels + 1))
        self.v0 = float(min(coef[0], 1.0))
        self.beta = coef[1:]
        self.conv = conv
        self.journeys = journeys
        self.prior_journeys = prior_journeys
        # few channels: every coalition's value in one table, looked up by index
        self.table: np.ndarray | None = None
        if n_channels <= DENSE_MAX:
            every = np.arange(2**n_channels, dtype=np.uint64)
            self.table = self._value(every, self.prior(every))

    def set_baseline(self, v0: float) -> None:
        """Fix v(∅) (and the backoff's intercept) to `v0`, e.g. a baseline measured elsewhere."""
        self.v0 = float(v0)
        if self.table is not None:
            every = np.arange(2**self.n_channels, dtype=np.uint64)
            self.table = self._value(every, self.prior(every))

    def prior(self, masks: np.ndarray) -> np.ndarray:
        out = np.full(masks.shape, self.v0)
        for c in np.flatnonzero(self.beta > 0):
            out += self.beta[c] * ((masks >> np.uint64(c)) & np.uint64(1))
        return np.asarray(np.clip(out, 0.0, 1.0), dtype=np.float64)

    def __call__(self, masks: np.ndarray, prior: np.ndarray | None = None) -> np.ndarray:
        """v at each mask (`prior` may be given when the caller has it already)."""
        if self.table is not None:
            return self.table[masks.astype(np.int64)]
        return self._value(masks, self.prior(masks) if prior is None else prior)

    def _value(self, masks: np.ndarray, pri: np.ndarray) -> np.ndarray:
        pos = np.clip(np.searchsorted(self.masks, masks), 0, self.masks.shape[0] - 1)
        found = self.masks[pos] == masks
        conv = np.where(found, self.conv[pos], 0.0)
        jour = np.where(found, self.journeys[pos], 0.0)
        den = jour + self.prior_journeys
        v = np.divide(conv + self.prior_journeys * pri, den, out=pri.astype(float), where=den > 0)
        return np.where(masks == 0, self.v0, v)


def _exact_group(sets: np.ndarray, k: int, value: CoalitionValue) -> np.ndarray:
    """Shapley values (m, k) of m channel sets of size k, their channels in ascending order."""
    m = sets.shape[0]
    positions = np.zeros((m, k), dtype=np.uint64)
    rest = sets.copy()
    for i in range(k):  # lowest set bit, k times
        low = rest & (~rest + np.uint64(1))
        positions[:, i] = low
        rest = rest ^ low
    local = np.arange(2**k, dtype=np.int64)
    local_bits = ((local[:, None] >> np.arange(k)) & 1).astype(bool)  # (2^k, k)
    size = local_bits.sum(axis=1)
    weight = np.array([factorial(s) * factorial(k - s - 1) / factorial(k) for s in range(k)])
    without = np.stack([local[~local_bits[:, i]] for i in range(k)])  # (k, 2^(k-1))
    with_i = without | (1 << np.arange(k))[:, None]
    w = weight[size[without]]  # (k, 2^(k-1))
    beta_pos = np.zeros((m, k))
    lowbit_index = np.log2(positions.astype(np.float64)).round().astype(np.int64)
    beta_pos = value.beta[lowbit_index]  # (m, k)
    bits_f = local_bits.astype(np.float64)
    out = np.zeros((m, k))
    step = max(1, _CHUNK_VALUES // 2**k)
    for lo in range(0, m, step):
        hi = min(m, lo + step)
        if value.table is not None:  # masks < 2^20: exact in float64, one BLAS product
            glob = (bits_f @ positions[lo:hi].astype(np.float64).T).astype(np.int64)
            v = value.table[glob]  # (2^k, chunk)
        else:
            glob = np.zeros((2**k, hi - lo), dtype=np.uint64)
            for i in range(k):
                glob |= np.where(local_bits[:, i : i + 1], positions[None, lo:hi, i], np.uint64(0))
            prior = np.clip(value.v0 + bits_f @ beta_pos[lo:hi].T, 0.0, 1.0)
            v = value(glob.ravel(), prior.ravel()).reshape(glob.shape)
        diff = v[with_i] - v[without]  # (k, 2^(k-1), chunk)
        out[lo:hi] = np.einsum("ij,ijm->mi", w, diff)
    return out


def _exact_all(game: CoalitionValue) -> np.ndarray:
    """Shapley values of every sub-game at once, (n_channels, 2^n): row i, column J is φ_i(v|J).

    Through the Harsanyi dividends d (the Möbius transform of v): φ_i(J) = Σ_{i∈T⊆J} d(T)/|T|,
    a subset-sum (zeta) transform of d(T)/|T|·[i∈T] — n·2^n work per channel, for all J
    together, instead of enumerating 2^|J| subsets per journey. Needs the tabulated v.
    """
    assert game.table is not None
    n = game.n_channels
    d = game.table.astype(np.float64).copy()
    for i in range(n):  # Möbius transform: d(T) = Σ_{S⊆T} (−1)^{|T∖S|} v(S)
        view = d.reshape(-1, 2, 2**i)
        view[:, 1, :] -= view[:, 0, :]
    every = np.arange(2**n, dtype=np.int64)
    bits = (every[None, :] >> np.arange(n)[:, None]) & 1  # (n, 2^n)
    size = bits.sum(axis=0)
    h = np.where(size > 0, d / np.maximum(size, 1), 0.0)[None, :] * bits  # (n, 2^n)
    for j in range(n):  # zeta transform: g(J) = Σ_{T⊆J} h(T)
        view = h.reshape(n, -1, 2, 2**j)
        view[:, :, 1, :] += view[:, :, 0, :]
    return np.asarray(h, dtype=np.float64)


def _sampled(mask: np.uint64, value: CoalitionValue, permutations: int, rng: np.random.Generator
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Channel indices of a set, and their permutation-sampled Shapley values and standard errors."""
    chans = np.flatnonzero((int(mask) >> np.arange(value.n_channels)) & 1)
    k = chans.shape[0]
    order = rng.permuted(np.tile(np.arange(k), (permutations, 1)), axis=1)  # (P, k) local indices
    bits = np.left_shift(np.uint64(1), chans[order].astype(np.uint64))
    prefix = np.bitwise_or.accumulate(bits, axis=1)
    before = np.hstack([np.zeros((permutations, 1), np.uint64), prefix[:, :-1]])
    marg = value(prefix.ravel()).reshape(prefix.shape) - value(before.ravel()).reshape(before.shape)
    contrib = np.zeros((permutations, k))
    np.put_along_axis(contrib, order, marg, axis=1)
    return chans, contrib.mean(axis=0), contrib.std(axis=0, ddof=1) / np.sqrt(permutations)


def shapley(paths: Paths, exact_max: int, permutations: int, seed: int,
            prior_journeys: float = 5.0) -> tuple[np.ndarray, np.ndarray, dict[str, object]]:  # fmt: skip
    """Credits (conversions, value) and meta (standard errors, how many sets were sampled).
    Empty paths (no touchpoint) are no coalition's journeys: they are left out."""
    paths = paths.touched()
    n_ch = len(paths.channels)
    masks = channel_masks(paths)
    sets, inv = np.unique(masks, return_inverse=True)
    conv = np.bincount(inv, weights=paths.conversions, minlength=sets.shape[0])
    nulls = np.bincount(inv, weights=paths.nulls, minlength=sets.shape[0])
    value_sum = np.bincount(inv, weights=paths.value, minlength=sets.shape[0])
    game = CoalitionValue(sets, conv, nulls, n_ch, prior_journeys)
    size = np.zeros(sets.shape[0], dtype=np.int64)
    for c in range(n_ch):
        size += ((sets >> np.uint64(c)) & np.uint64(1)).astype(np.int64)
    credit = np.zeros(n_ch)
    value = np.zeros(n_ch)
    var = np.zeros(n_ch)
    rng = np.random.default_rng([seed, 11])
    sampled = 0
    converting = conv > 0
    dense = game.table is not None and bool(np.any(converting & (size <= exact_max)))
    phi_all = _exact_all(game) if dense else None
    for k in np.unique(size[converting]):
        idx = np.flatnonzero(converting & (size == k))
        if k <= exact_max and phi_all is not None:
            phi = phi_all[:, sets[idx].astype(np.int64)].T  # (m, n_channels), zero off the set
            member = ((sets[idx, None] >> np.arange(n_ch, dtype=np.uint64)) & np.uint64(1)).astype(float)
            share = _normalise(phi, member)
            credit += (share * conv[idx, None]).sum(axis=0)
            value += (share * value_sum[idx, None]).sum(axis=0)
        elif k <= exact_max:
            phi = _exact_group(sets[idx], int(k), game)  # (m, k), channels ascending
            chans = np.zeros((idx.shape[0], int(k)), dtype=np.int64)
            rest = sets[idx].copy()
            for i in range(int(k)):
                low = rest & (~rest + np.uint64(1))
                chans[:, i] = np.log2(low.astype(np.float64)).round().astype(np.int64)
                rest = rest ^ low
            share = _normalise(phi)
            np.add.at(credit, chans, share * conv[idx, None])
            np.add.at(value, chans, share * value_sum[idx, None])
        else:
            for j in idx:
                sampled += 1
                chans_j, phi_j, se_j = _sampled(sets[j], game, permutations, rng)
                share = _normalise(phi_j[None, :])[0]
                credit[chans_j] += share * conv[j]
                value[chans_j] += share * value_sum[j]
                pos = np.clip(phi_j, 0, None).sum()
                if pos > 0:
                    var[chans_j] += (conv[j] * se_j / pos) ** 2
    meta: dict[str, object] = {
        "v_empty": game.v0,
        "sampled_sets": sampled,
        "exact_max": exact_max,
        "se": [float(x) for x in np.sqrt(var)],
    }
    return credit, value, meta


def _normalise(phi: np.ndarray, member: np.ndarray | None = None) -> np.ndarray:
    """Rows of non-negative shares summing to 1 (equal split over the row's `member` columns,
    all by default, where no value is positive)."""
    pos = np.clip(phi, 0.0, None)
    total = pos.sum(axis=1, keepdims=True)
    if member is None:
        equal = np.full_like(pos, 1.0 / pos.shape[1])
    else:
        equal = member / member.sum(axis=1, keepdims=True)
    return np.asarray(np.where(total > 0, pos / np.where(total > 0, total, 1.0), equal), dtype=np.float64)
