"""Choosing a creative variant for each served ad: a contextual bandit over the ad's variants.

Policy — disjoint linear Thompson sampling with closed-form selection probabilities. Each
(ad, variant) keeps a Bayesian linear regression of the click on the context
x = [1, user state vector]: precision A = λI + Σ x xᵀ, b = Σ click·x, mean μ = A⁻¹b.
Thompson sampling would draw θ̃ ~ N(μ, σ²A⁻¹) per variant and show the argmax of x·θ̃. For one
context, variant v's drawn score is N(m_v = x·μ_v, s_v² = σ² xᵀA_v⁻¹x), independent across
variants, so the probability that v wins is a one-dimensional integral,

    P(v) = ∫ φ(z) Π_{u≠v} Φ((m_v + s_v·z − m_u) / s_u) dz,

computed by Gauss–Hermite quadrature (`nodes` points) and renormalised. The variant is then
drawn from (1 − ε)·P + ε/V (ε = `floor`: every variant keeps a chance, which off-policy
evaluation needs), so the propensity logged with it is exactly the probability the choice was
drawn with — not an estimate of it; the quadrature's error only makes the policy a slightly
different one from exact Thompson sampling, never the logged propensity wrong.

The core is pure numpy over a batch (rows of the state × contexts): `select` and `update` take
and return arrays; `VariantSelector` is the replica's thin stateful shell (ad id → row, a
seeded generator).

    >>> sel = VariantSelector(dim=2, policy=VariantPolicy(), seed=0)
    >>> sel.register("ad1", ["a", "b", "c"])
    >>> [(v, None if p is None else round(p, 6)) for v, p in sel.choose(["ad1", "none"], np.zeros((2, 2)))]
    [('b', 0.333333), (None, None)]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy.special import ndtr

from schemas.errors import SchemaError
from schemas.settings import Settings, VariantsSettings


@dataclass(frozen=True)
class VariantPolicy:
    """The bandit's knobs (`settings.variants`): ridge prior λ, posterior scale σ, uniform floor ε,
    quadrature nodes."""

    prior: float = 1.0
    noise: float = 0.1  # the scale benchmarks/creatives.py measured (--noise)
    floor: float = 0.05
    nodes: int = 24

    def __post_init__(self) -> None:
        if not (self.prior > 0 and self.noise > 0 and 0 <= self.floor <= 1 and self.nodes >= 2):
            raise ValueError(f"VariantPolicy: prior, noise > 0, floor in [0, 1], nodes >= 2 (got {self})")

    @classmethod
    def of(cls, settings: VariantsSettings) -> VariantPolicy:
        """The policy that `settings.variants` configures."""
        return cls(prior=settings.prior, noise=settings.noise, floor=settings.floor)


@dataclass(frozen=True)
class VariantState:
    """Every registered ad's per-variant posterior, padded to the widest ad (`mask`)."""

    variant_ids: tuple[tuple[str, ...], ...]
    mask: np.ndarray  # (R, V) bool: a real variant
    precision: np.ndarray  # (R, V, d, d): A
    target: np.ndarray  # (R, V, d): b
    cov: np.ndarray  # (R, V, d, d): A⁻¹
    mean: np.ndarray  # (R, V, d): A⁻¹b

    @property
    def dim(self) -> int:
        return int(self.mean.shape[2])


def empty_state(dim: int) -> VariantState:
    """A state without ads for contexts of `dim` features (the leading 1 included)."""
    z = np.zeros
    return VariantState(
        (), z((0, 1), dtype=bool), z((0, 1, dim, dim)), z((0, 1, dim)), z((0, 1, dim, dim)), z((0, 1, dim))
    )


def _widen(state: VariantState, width: int) -> VariantState:
    extra = width - state.mask.shape[1]
    if extra <= 0:
        return state

    def pad(a: np.ndarray) -> np.ndarray:
        return np.concatenate([a, np.zeros((a.shape[0], extra, *a.shape[2:]), dtype=a.dtype)], axis=1)

    return VariantState(
        state.variant_ids,
        pad(state.mask),
        pad(state.precision),
        pad(state.target),
        pad(state.cov),
        pad(state.mean),
    )


def set_row(state: VariantState, row: int, variant_ids: Sequence[str], prior: float) -> VariantState:
    """The state with `row` (== number of rows: a new one) holding a fresh prior over `variant_ids`."""
    if not variant_ids or len(set(variant_ids)) != len(variant_ids):
        raise SchemaError(f"variant ids {list(variant_ids)!r}: need at least one, all distinct")
    state = _widen(state, len(variant_ids))
    v, d = state.mask.shape[1], state.dim
    mask = np.arange(v) < len(variant_ids)
    eye = np.broadcast_to(np.eye(d), (v, d, d))
    fresh = (mask, prior * eye, np.zeros((v, d)), eye / prior, np.zeros((v, d)))
    arrays = [state.mask, state.precision, state.target, state.cov, state.mean]
    if row == len(state.variant_ids):
        arrays = [np.concatenate([a, f[None]], axis=0) for a, f in zip(arrays, fresh, strict=True)]
        ids = (*state.variant_ids, tuple(variant_ids))
    else:
        arrays = [a.copy() for a in arrays]
        for a, f in zip(arrays, fresh, strict=True):
            a[row] = f
        ids = tuple(tuple(variant_ids) if i == row else t for i, t in enumerate(state.variant_ids))
    return VariantState(ids, *arrays)


def context(vectors: np.ndarray, dim: int) -> np.ndarray:
    """Contexts (n, dim): a leading 1, then each user state vector cut or zero-padded to dim − 1."""
    vectors = np.atleast_2d(np.asarray(vectors, dtype=np.float64))
    out = np.zeros((vectors.shape[0], dim))
    out[:, 0] = 1.0
    k = min(dim - 1, vectors.shape[1])
    out[:, 1 : 1 + k] = vectors[:, :k]
    return out


def score_moments(
    state: VariantState, rows: np.ndarray, x: np.ndarray, noise: float
) -> tuple[np.ndarray, np.ndarray]:
    """Mean and sd (n, V) of each variant's Thompson score x·θ̃ for each (row, context)."""
    xs = x[:, None, :, None]  # (n, 1, d, 1): matmuls, not a three-operand einsum (10× slower)
    mean = (state.mean[rows][:, :, None, :] @ xs)[:, :, 0, 0]
    var = (xs.transpose(0, 1, 3, 2) @ (state.cov[rows] @ xs))[:, :, 0, 0]
    return mean, noise * np.sqrt(np.maximum(var, 1e-12))


@functools.cache
def _nodes(nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Gauss–Hermite nodes and weights for the standard normal (weights sum to 1)."""
    z, w = np.polynomial.hermite_e.hermegauss(nodes)
    return z, w / math.sqrt(2 * math.pi)


def win_probabilities(mean: np.ndarray, sd: np.ndarray, mask: np.ndarray, nodes: int) -> np.ndarray:
    """P(variant v has the highest score) for independent normal scores, (n, V), by Gauss–Hermite
    quadrature of ∫ φ(z) Π_{u≠v} Φ((m_v + s_v z − m_u)/s_u) dz; 0 where `mask` is False.

    >>> win_probabilities(np.array([[0.0, 0.0, 1.0]]), np.ones((1, 3)), np.ones((1, 3), bool), 24).round(3)
    array([[0.183, 0.183, 0.634]])
    """
    z, w = _nodes(nodes)
    m = np.where(mask, mean, 0.0)
    s = np.where(mask, sd, 1.0)
    t = m[:, :, None] + s[:, :, None] * z  # (n, V, G): v's score at each node
    cdf = ndtr((t[:, :, :, None] - m[:, None, None, :]) / s[:, None, None, :])  # (n, V, G, U)
    others = mask[:, None, None, :] & ~np.eye(m.shape[1], dtype=bool)[None, :, None, :]
    p = (w * np.where(others, cdf, 1.0).prod(axis=-1)).sum(axis=-1)
    p = np.where(mask, np.maximum(p, 0.0), 0.0)
    total = p.sum(axis=1, keepdims=True)
    out: np.ndarray = np.where(
        total > 0, p / np.where(total > 0, total, 1.0), mask / mask.sum(axis=1, keepdims=True)
    )
    return out


def probabilities(state: VariantState, rows: np.ndarray, x: np.ndarray, policy: VariantPolicy) -> np.ndarray:
    """The selection distribution (n, V) of each (row, context): (1 − ε)·P(win) + ε/V over the
    row's variants (0 on padding)."""
    rows = np.asarray(rows, dtype=np.int64)
    mask = state.mask[rows]
    mean, sd = score_moments(state, rows, x, policy.noise)
    p = win_probabilities(mean, sd, mask, policy.nodes)
    uniform = mask / mask.sum(axis=1, keepdims=True)
    out: np.ndarray = (1.0 - policy.floor) * p + policy.floor * uniform
    return out


def select(
    state: VariantState, rows: np.ndarray, x: np.ndarray, policy: VariantPolicy, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(chosen variant index, its probability) per (row, context), drawn from `probabilities`."""
    p = probabilities(state, rows, x, policy)
    cdf = np.cumsum(p, axis=1)
    u = rng.random(p.shape[0]) * cdf[:, -1]
    chosen = np.minimum((cdf <= u[:, None]).sum(axis=1), p.shape[1] - 1)
    chosen = np.where(p[np.arange(p.shape[0]), chosen] > 0, chosen, np.argmax(p, axis=1))
    return chosen, p[np.arange(p.shape[0]), chosen]


def update(
    state: VariantState,
    rows: np.ndarray,
    x: np.ndarray,
    chosen: np.ndarray,
    clicks: np.ndarray,
    new: np.ndarray | None = None,
    *,
    inplace: bool = False,
) -> VariantState:
    """The posterior after a batch of labelled impressions (row, context, variant shown, clicked):
    a new state (the input is not changed; with `inplace`, the input's arrays are written, which
    costs the touched variants only instead of a copy of every ad's); only the touched variants
    are re-solved.

    `new` (bool per impression, default all True) False marks a label correction of an impression
    already learned as a non-click (a delayed click after its fake negative): the regression's
    target moves by the click (b += x) and its precision stays, as if it had been a click at once.
    """
    rows = np.asarray(rows, dtype=np.int64)
    chosen = np.asarray(chosen, dtype=np.int64)
    clicks = np.asarray(clicks, dtype=np.float64)
    x = np.asarray(x, dtype=np.float64)
    n = rows.shape[0]
    fresh = np.ones(n, dtype=bool) if new is None else np.asarray(new, dtype=bool)
    if not (x.shape == (n, state.dim) and chosen.shape == (n,) and clicks.shape == (n,) == fresh.shape):
        raise SchemaError(f"update: {n} rows need contexts ({n}, {state.dim}), {n} variants and {n} labels")
    if n == 0:
        return state
    in_range = 0 <= rows.min() and rows.max() < len(state.variant_ids)
    in_range = in_range and 0 <= chosen.min() and chosen.max() < state.mask.shape[1]
    if not in_range or not state.mask[rows, chosen].all():
        raise SchemaError("update: a row or variant index that the state does not hold")
    if not (np.isfinite(x).all() and np.isin(clicks, (0.0, 1.0)).all()):
        raise SchemaError("update: contexts must be finite and labels 0 or 1")

    def keep(a: np.ndarray) -> np.ndarray:
        return a if inplace else a.copy()

    precision, target = keep(state.precision), keep(state.target)
    np.add.at(precision, (rows[fresh], chosen[fresh]), x[fresh, :, None] * x[fresh, None, :])
    np.add.at(target, (rows, chosen), clicks[:, None] * x)
    pairs = np.unique(np.stack([rows, chosen], axis=1), axis=0)
    r, v = pairs[:, 0], pairs[:, 1]
    cov, mean = keep(state.cov), keep(state.mean)
    cov[r, v] = np.linalg.inv(precision[r, v])
    mean[r, v] = np.einsum("pde,pe->pd", cov[r, v], target[r, v])
    return replace(state, precision=precision, target=target, cov=cov, mean=mean)


class VariantSelector:
    """A replica's variant bandit: the state, which row each ad id has, and a seeded generator."""

    def __init__(
        self, dim: int, policy: VariantPolicy | None = None, seed: int | None = None, enabled: bool = True
    ) -> None:
        self.policy = policy or VariantPolicy()
        self.state = empty_state(dim + 1)
        self.row_of: dict[str, int] = {}
        self.rng = np.random.default_rng(seed)
        self.enabled = enabled  # off: no ad is registered, so none is given a variant

    @classmethod
    def from_settings(cls, settings: Settings, seed: int | None = None) -> VariantSelector:
        """A replica's selector as `settings.variants` configures it, for `settings.state_dim` vectors."""
        v = settings.variants
        return cls(settings.state_dim, VariantPolicy.of(v), seed, enabled=v.enabled)

    def register(self, ad_id: str, variant_ids: Sequence[str]) -> None:
        """An ad with variants enters (or changes them: its posterior starts over)."""
        if not self.enabled:
            return
        row = self.row_of.get(ad_id, len(self.state.variant_ids))
        if row < len(self.state.variant_ids) and self.state.variant_ids[row] == tuple(variant_ids):
            return
        self.state = set_row(self.state, row, variant_ids, self.policy.prior)
        self.row_of[ad_id] = row

    def choose(self, ad_ids: Sequence[str], vectors: np.ndarray) -> list[tuple[str | None, float | None]]:
        """(variant id, propensity) per served ad, for the user state vector of each (one batch
        call); (None, None) for ads without variants."""
        out: list[tuple[str | None, float | None]] = [(None, None)] * len(ad_ids)
        at = [(i, self.row_of[a]) for i, a in enumerate(ad_ids) if a in self.row_of]
        if not at:
            return out
        idx = np.array([i for i, _ in at])
        rows = np.array([r for _, r in at])
        x = context(
            np.asarray(vectors)[idx] if np.ndim(vectors) == 2 else np.asarray(vectors), self.state.dim
        )
        if x.shape[0] == 1 and len(at) > 1:
            x = np.repeat(x, len(at), axis=0)  # one user's vector for every ad of the request
        chosen, prop = select(self.state, rows, x, self.policy, self.rng)
        for (i, r), c, p in zip(at, chosen.tolist(), prop.tolist(), strict=True):
            out[i] = (self.state.variant_ids[r][c], p)
        return out

    def shares(self, ad_id: str, vector: np.ndarray) -> dict[str, float]:
        """The probability each variant of `ad_id` is chosen for one user state vector (the
        distribution `choose` draws from); empty for an ad without variants here."""
        row = self.row_of.get(ad_id)
        if row is None:
            return {}
        x = context(np.asarray(vector), self.state.dim)
        p = probabilities(self.state, np.array([row]), x, self.policy)[0]
        return dict(zip(self.state.variant_ids[row], p.tolist(), strict=False))

    def learn(
        self,
        ad_ids: Sequence[str],
        vectors: np.ndarray,
        variant_ids: Sequence[str],
        clicks: Sequence[bool],
        new: Sequence[bool] | None = None,
    ) -> int:
        """Learn from labelled impressions (ads unknown here, or variants they no longer have,
        are skipped; `new` as in `update`: False for a click correcting a learned non-click);
        returns how many were learned."""
        keep = [
            (i, self.row_of[a], self.state.variant_ids[self.row_of[a]].index(v))
            for i, (a, v) in enumerate(zip(ad_ids, variant_ids, strict=True))
            if a in self.row_of and v in self.state.variant_ids[self.row_of[a]]
        ]
        if not keep:
            return 0
        idx = np.array([i for i, _, _ in keep])
        x = context(np.asarray(vectors)[idx], self.state.dim)
        y = np.asarray(clicks, dtype=np.float64)[idx]
        fresh = None if new is None else np.asarray(new, dtype=bool)[idx]
        # in place: a replica's choices and its learning run on one event loop, never interleaved
        self.state = update(
            self.state, np.array([r for _, r, _ in keep]), x, np.array([c for _, _, c in keep]), y, fresh,
            inplace=True,
        )  # fmt: skip
        return len(keep)
