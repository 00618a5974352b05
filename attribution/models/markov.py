"""Markov-chain attribution of order 1–3 by removal effect, solved exactly (no simulation).

States are the last k channels of a journey (shorter at its start); consecutive repeats of a
channel are merged first (a view then a click on the same channel is one step). Journeys
start in START and end in CONV (converting paths, weighted by their conversions) or NULL
(null paths). With Q the transient-to-transient and r the transient-to-CONV probabilities,
the conversion probability from every state solves (I − Q) x = r (absorbing chain; solved to
floating-point precision by its Neumann series, see `solve_absorbing`). A channel's removal
effect is 1 − p₋c / p, where p₋c is the conversion probability of the chain without c, in one
of two senses (`removal`):

- `"null"` (the textbook rule, Anderl et al. 2016; ChannelAttribution's): every state ending
  in c sends its journeys to NULL. A journey that merely passed through c is lost with it, so a
  channel that does nothing but is seen on many converting journeys gets a large effect;
- `"redistribute"` (the default): c is never entered — each state's transitions into c are
  dropped and its other transitions (to channels, CONV and NULL) renormalised, and START's
  likewise: the journey goes on as the journeys from the same state that did not meet c went
  on. A channel whose journeys convert no better than the others from the same state then has
  no effect. On the simulator's unconfounded truth market (`benchmarks/attribution.py`) it
  brings the order-chosen Markov's error below last-click's, where `"null"` stays above it;
  like every observational rule it credits a channel that targets likely converters (a
  retargeting campaign) for their conversions: holdouts calibrate that (`incrementality`).

Credits are the conversions (and value) split in proportion to the removal effects, so they sum
to the totals. The order is chosen by held-out log-likelihood of the transitions (an 80/20
split of each path's counts, seeded) unless given.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import breadth_first_order
from scipy.sparse.linalg import MatrixRankWarning, spsolve

from attribution.paths import AttributionInputError, Paths

START, CONV, NULL = -3, -1, -2
SMOOTHING = 0.1  # additive smoothing of held-out transition probabilities
SPARSE_DEGREE = 4  # chains with at most this many transitions per state fall back to LU early
# a removal effect below this is the solve's rounding, not evidence (p₋c read 2e-16 below p = 1
# when every journey converts without c too): zero, so it cannot take every credit
EFFECT_TOL = 1e-9
Removal = Literal["redistribute", "null"]
REMOVALS: tuple[str, ...] = ("redistribute", "null")


@dataclass(frozen=True)
class Transitions:
    """Aggregated (src, dst) transitions between dense state ids, with weights."""

    src: np.ndarray
    dst: np.ndarray
    weight: np.ndarray
    state_channels: np.ndarray  # (states, order): a state's channels, oldest first; -1 before the journey

    @property
    def last(self) -> np.ndarray:
        """The channel each state ends in (the one whose removal takes the state out)."""
        return np.asarray(self.state_channels[:, -1])


def _collapsed(paths: Paths) -> tuple[np.ndarray, np.ndarray]:
    """Per kept touch (consecutive repeats in a path merged): channel and path id."""
    pid = paths.path_of_touch
    ch = paths.channel.astype(np.int64)
    keep = np.ones(ch.shape[0], dtype=bool)
    if ch.shape[0] > 1:
        keep[1:] = (ch[1:] != ch[:-1]) | (pid[1:] != pid[:-1])
    return ch[keep], pid[keep]


@dataclass(frozen=True)
class Chain:
    """The transition structure of an order-k chain over fixed paths, for any counts on them.

    Each *slot* is one step of one distinct path (START → first state, state → next state, last
    state → CONV, last state → NULL); `inv` maps it to its distinct (src, dst) transition.
    """

    src: np.ndarray
    dst: np.ndarray
    inv: np.ndarray
    slot_path: np.ndarray
    slot_kind: np.ndarray  # 0: weighted by the path's journeys, 1: by its conversions, 2: by nulls
    src_state: np.ndarray  # per distinct transition: index of its source among the distinct sources
    state_channels: np.ndarray  # (states, order) per dense state id, oldest channel first, -1: none

    def weights(self, conversions: np.ndarray, nulls: np.ndarray) -> np.ndarray:
        """Weight of every distinct transition for per-path counts."""
        c, n = conversions[self.slot_path], nulls[self.slot_path]
        w = np.where(self.slot_kind == 0, c + n, np.where(self.slot_kind == 1, c, n))
        return np.bincount(self.inv, weights=w, minlength=self.src.shape[0])


def _dense(key: np.ndarray) -> tuple[np.ndarray, int, np.ndarray]:
    """Dense ids 0..n-1 of int64 keys (in key order), n, and where each id first occurs."""
    uniq, first, inv = np.unique(key, return_index=True, return_inverse=True)
    return inv.reshape(-1).astype(np.int64), int(uniq.shape[0]), first


def _pair(a: np.ndarray, n_a: int, b: np.ndarray, n_b: int, what: str) -> tuple[np.ndarray, int, np.ndarray]:
    """Dense ids of the pairs (a, b) with a < n_a, b < n_b: keys a·n_b + b, refused (never wrapped)
    when n_a·n_b does not fit in int64."""
    if n_a * n_b > np.iinfo(np.int64).max:  # Python ints: exact
        raise AttributionInputError(
            f"markov: {n_a:,} × {n_b:,} {what} do not fit a 64-bit key; use a lower order or fewer channels"
        )
    return _dense(a * np.int64(n_b) + b)


def state_ids(ch: np.ndarray, pos: np.ndarray, order: int) -> tuple[np.ndarray, np.ndarray]:
    """Each touch's order-`order` state as a dense id, and each id's channels (oldest first, −1
    before the journey's start).

    A state is a tuple of up to `order` channels, coded base (channels + 1) when that code fits
    in int64 (checked exactly), else numbered one channel at a time (the id of the tuple so far
    paired with the next channel, re-densified), so every key stays below touches × (channels +
    1) whatever the channel count and order; the ids are dense either way.
    """
    n_ch = int(ch.max()) + 2 if ch.shape[0] else 1  # channel + 1, 0 = before the journey
    cols = [ch]
    for m in range(1, order):
        prev = np.full(ch.shape[0], -1, dtype=np.int64)
        prev[m:] = ch[:-m]
        cols.append(np.where(pos >= m, prev, -1))
    if n_ch**order <= np.iinfo(np.int64).max:  # Python ints: the base-n_ch code fits, one pass
        code = np.zeros(ch.shape[0], dtype=np.int64)
        for col in cols:
            code = code * np.int64(n_ch) + (col + 1)
        ids, _, first = _dense(code)
    else:  # numbered a channel at a time: each key < touches × n_ch
        ids, n_ids, first = _dense(ch + 1)
        for col in cols[1:]:
            ids, n_ids, first = _pair(ids, n_ids, col + 1, n_ch, "states")
    table = np.stack(cols[::-1], axis=1)[first] if ch.shape[0] else np.zeros((0, order), np.int64)
    return ids, table


def chain(paths: Paths, order: int) -> Chain:
    """The structure of the order-`order` chain of `paths` (consecutive repeats merged)."""
    if order < 1:
        raise AttributionInputError(f"markov order {order} must be at least 1")
    ch, pid = _collapsed(paths)
    n = ch.shape[0]
    first = np.ones(n, dtype=bool)
    first[1:] = pid[1:] != pid[:-1]
    last = np.ones(n, dtype=bool)
    last[:-1] = pid[1:] != pid[:-1]
    pos = np.arange(n) - np.maximum.accumulate(np.where(first, np.arange(n), 0))
    code, table = state_ids(ch, pos, order)
    nxt = np.roll(code, -1)
    n_first, n_last = int(first.sum()), int(last.sum())
    src = np.concatenate([np.full(n_first, START), code[~last], code[last], code[last]])
    dst = np.concatenate([code[first], nxt[~last], np.full(n_last, CONV), np.full(n_last, NULL)])
    slot_path = np.concatenate([pid[first], pid[~last], pid[last], pid[last]])
    slot_kind = np.concatenate(
        [
            np.zeros(n_first + int((~last).sum()), np.int8),
            np.ones(n_last, np.int8),
            np.full(n_last, 2, np.int8),
        ]
    )
    # START, CONV, NULL are −3…−1: shifted by 3 every id is in [0, states + 3)
    span = table.shape[0] + 3
    inv, _, at = _pair(src + 3, span, dst + 3, span, "transitions")
    usrc, udst = src[at], dst[at]
    _, src_state = np.unique(usrc, return_inverse=True)
    return Chain(usrc, udst, inv, slot_path, slot_kind, src_state.reshape(-1), table)


def transitions(
    paths: Paths, order: int, conversions: np.ndarray, nulls: np.ndarray, structure: Chain | None = None
) -> Transitions:
    """The chain's transitions (with positive weight) for per-path counts on `paths`."""
    c = structure or chain(paths, order)
    w = c.weights(conversions, nulls)
    keep = w > 0
    return Transitions(c.src[keep], c.dst[keep], w[keep], c.state_channels)


@dataclass(frozen=True)
class Absorbing:
    """The absorbing chain of some transitions: Q over transient states, r into CONV, START."""

    states: np.ndarray
    q: sp.csr_matrix
    r: np.ndarray
    start_w: np.ndarray
    start_i: np.ndarray
    last: np.ndarray  # per state: the channel it ends in

    @classmethod
    def of(cls, t: Transitions) -> Absorbing:
        states = np.unique(np.concatenate([t.src[t.src >= 0], t.dst[t.dst >= 0]]))
        n = states.shape[0]
        from_state = t.src >= 0
        si_all = np.searchsorted(states, t.src[from_state])
        out = np.bincount(si_all, weights=t.weight[from_state], minlength=n)
        inner = from_state & (t.dst >= 0)
        si, di = np.searchsorted(states, t.src[inner]), np.searchsorted(states, t.dst[inner])
        q = sp.csr_matrix((t.weight[inner] / out[si], (si, di)), shape=(n, n))
        conv = from_state & (t.dst == CONV)
        ci = np.searchsorted(states, t.src[conv])
        r = np.bincount(ci, weights=t.weight[conv] / out[ci], minlength=n)
        st = t.src == START
        return cls(states, q, r, t.weight[st], np.searchsorted(states, t.dst[st]), t.last[states])

    def probability(
        self, removed: int | None = None, start: np.ndarray | None = None, removal: Removal = "null"
    ) -> tuple[float, np.ndarray]:
        """P(CONV | START) with channel `removed` taken out (in the `removal` sense, see the
        module docstring; none: the chain itself) and every state's conversion probability."""
        if removed is None:
            x = solve_absorbing(self.q, self.r, start=start)
            weights, firsts = self.start_w, self.start_i
        else:
            keep = self.last != removed
            if removal == "null":
                x = solve_absorbing(self.q, self.r, keep=keep, start=start)
                weights, firsts = self.start_w, self.start_i
            else:
                # each kept state's transitions into c dropped, the rest renormalised: as a
                # row scale on (r + Q x) with x = 0 on c's states (a state whose every
                # transition went into c has nowhere to go: NULL)
                into = self.q @ (~keep).astype(float)
                scale = np.where(keep & (into < 1 - 1e-12), 1.0 / np.maximum(1 - into, 1e-12), 0.0)
                scale[never_ends(self.q, keep, scale)] = 0.0
                x = solve_absorbing(self.q, self.r, keep=scale, start=start)
                entered = keep[self.start_i]
                weights, firsts = self.start_w[entered], self.start_i[entered]
        total = weights.sum()
        return (float((weights * x[firsts]).sum() / total) if total > 0 else 0.0), x


def never_ends(q: sp.csr_matrix, keep: np.ndarray, scale: np.ndarray, tol: float = 1e-12) -> np.ndarray:
    """The states of a renormalised chain (`scale` > 0 on its live rows, transitions only into
    `keep`) from which no journey ends: they only lead to each other (a closed class).

    Without c, journeys that went on only through c may loop among the other states for ever
    (feed ⇄ search when every journey ended after splash): such a class makes I − Q singular,
    and its journeys never convert, so they go to NULL (x = 0). Every other state reaches
    CONV or NULL, and the solve is well-posed.
    """
    live = scale > 0
    stay = (q @ (keep & live).astype(float)) * scale
    ends = live & (stay < 1 - tol)  # some of its mass leaves: to CONV, NULL, or a NULL row
    ends |= keep & ~live  # a state with nowhere else to go is itself NULL: an end
    if not np.any(live & ~ends):  # the common case, one product
        return np.zeros(q.shape[0], dtype=bool)
    # the states that reach an end: breadth-first from a sink over reversed transitions
    n = q.shape[0]
    coo = (sp.diags(live.astype(float)) @ q @ sp.diags((keep & live).astype(float))).tocoo()
    rows = np.concatenate([coo.col[coo.data > 0], np.full(int(ends.sum()), n)])
    cols = np.concatenate([coo.row[coo.data > 0], np.flatnonzero(ends)])
    graph = sp.csr_matrix((np.ones(rows.shape[0]), (rows, cols)), shape=(n + 1, n + 1))
    reached = np.zeros(n + 1, dtype=bool)
    reached[breadth_first_order(graph, n, directed=True, return_predecessors=False)] = True
    return np.asarray(live & ~reached[:n])


def conversion_probability(t: Transitions, removed: int | None = None, removal: Removal = "null") -> float:
    """P(CONV | START), optionally with channel index `removed` taken out (`removal` sense)."""
    return Absorbing.of(t).probability(removed, removal=removal)[0]


def solve_absorbing(
    q: sp.csr_matrix,
    r: np.ndarray,
    tol: float = 1e-13,
    max_iter: int = 20_000,
    keep: np.ndarray | None = None,
    start: np.ndarray | None = None,
) -> np.ndarray:
    """x = (I − DQ)⁻¹ Dr for a substochastic Q (D: the diagonal of `keep`, default all ones): the
    fixed point of x = D(r + Qx). A boolean `keep` absorbs the states outside it into NULL
    (x = 0); float weights also rescale each kept state's row (a renormalised chain).

    The iteration is the Neumann series of (I − DQ)⁻¹ and converges geometrically when every
    state reaches absorption (callers take closed classes out first: `never_ends`); it is
    iterated to a change below `tol`, i.e. to the exact solution in floating point, without LU
    fill-in (a direct sparse LU of an order-3 chain over 15 channels takes seconds). `start` is
    a first guess (e.g. the solution without removal). A direct solve is the fallback if it has
    not converged (after 50 iterations on a chain with at most `SPARSE_DEGREE` transitions per
    state, such as many channels seen on few paths: loops that journeys rarely leave mix slowly
    there, and the LU has little fill-in); a singular system is an `AttributionInputError`,
    never a warning and NaNs.
    """
    mask = np.ones(r.shape[0]) if keep is None else keep.astype(float)
    x = (r if start is None else start) * mask
    if q.nnz <= SPARSE_DEGREE * r.shape[0]:  # an LU without fill-in: do not wait on slow mixing
        max_iter = min(max_iter, 50)
    for _ in range(max_iter):
        nxt = mask * (r + q @ x)
        if np.max(np.abs(nxt - x)) <= tol * max(1.0, float(np.max(np.abs(nxt)))):
            return np.asarray(nxt)
        x = nxt
    n = q.shape[0]
    dq = sp.diags(mask) @ q
    with warnings.catch_warnings():
        warnings.simplefilter("error", MatrixRankWarning)
        try:
            x = np.atleast_1d(spsolve((sp.identity(n, format="csc") - dq).tocsc(), mask * r))
        except MatrixRankWarning:
            x = np.full(n, np.nan)
    if not np.all(np.isfinite(x)):
        raise AttributionInputError(
            f"markov: the absorbing chain over {n:,} states has no solution (some states never reach "
            f"CONV or NULL); not converged after {max_iter:,} iterations"
        )
    return np.asarray(x, dtype=np.float64)


def removal_effects(t: Transitions, n_channels: int, removal: Removal = "null") -> tuple[float, np.ndarray]:
    """Base conversion probability and each channel's removal effect 1 − p₋c / p (clipped at 0:
    a channel whose removal raises the conversion probability earns nothing; an effect below
    `EFFECT_TOL` is the solves' rounding and is 0)."""
    chain_ = Absorbing.of(t)
    p, x = chain_.probability()
    if p <= 0:
        return 0.0, np.zeros(n_channels)
    effects = np.array(
        [1.0 - chain_.probability(c, start=x, removal=removal)[0] / p for c in range(n_channels)]
    )
    return p, np.where(effects < EFFECT_TOL, 0.0, effects)


def heldout_loglik(
    paths: Paths, order: int, seed: int, test_share: float = 0.2, structure: Chain | None = None
) -> float:
    """Mean log-likelihood per held-out transition of an order-`order` chain fitted on the rest."""
    # the same split for every order: the generator does not depend on `order`
    rng = np.random.default_rng([seed, 7])
    conv_test = rng.binomial(paths.conversions.astype(np.int64), test_share).astype(float)
    null_test = rng.binomial(paths.nulls.astype(np.int64), test_share).astype(float)
    c = structure or chain(paths, order)
    train = c.weights(paths.conversions - conv_test, paths.nulls - null_test)
    test = c.weights(conv_test, null_test)
    if test.sum() <= 0:
        return float("nan")
    out = np.bincount(c.src_state, weights=train)[c.src_state]
    alphabet = len(paths.channels) + 2  # the next channel, CONV or NULL
    prob = np.where(out > 0, (train + SMOOTHING) / (out + SMOOTHING * alphabet), 1.0 / alphabet)
    used = test > 0
    return float((test[used] * np.log(prob[used])).sum() / test.sum())


def choose_order(
    paths: Paths, seed: int, orders: tuple[int, ...] = (1, 2, 3)
) -> tuple[int, dict[int, float]]:
    """The order with the best held-out log-likelihood, and every order's score."""
    best, scores, _ = _choose(paths, seed, orders)
    return best, scores


def _choose(paths: Paths, seed: int, orders: tuple[int, ...]) -> tuple[int, dict[int, float], Chain]:
    chains = {k: chain(paths, k) for k in orders}
    scores = {k: heldout_loglik(paths, k, seed, structure=chains[k]) for k in orders}
    finite = {k: v for k, v in scores.items() if np.isfinite(v)}
    best = max(finite, key=lambda k: finite[k]) if finite else orders[0]
    return best, scores, chains[best]


def markov(
    paths: Paths, order: int, structure: Chain | None = None, removal: Removal = "redistribute"
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Credits (conversions, value) of an order-`order` chain, with p and the rule used.

    When no channel's redistributed removal lowers p (every effect clips to 0: the chain holds
    no evidence that any channel raises conversions, e.g. when continuing a journey mostly
    leads to NULL), the credits follow the null rule's effects, so they still sum to the
    conversions; `removal_used` says which rule gave them.
    """
    t = transitions(paths, order, paths.conversions, paths.nulls, structure)
    p, effects = removal_effects(t, len(paths.channels), removal)
    used: str = removal
    if not effects.sum() > 0 and removal != "null":
        p, effects = removal_effects(t, len(paths.channels), "null")
        used = "null"
    total = effects.sum()
    share = effects / total if total > 0 else np.zeros_like(effects)
    meta = {"p_conversion": p, "removal_used": used}
    touched = paths.lengths > 0  # an empty path is no journey through the chain: not credited
    return share * paths.conversions[touched].sum(), share * paths.value[touched].sum(), meta
