"""Rule-based models: each gives every touch of a path a weight, the path's weights summing to 1.

A path's conversions and value are then split by those weights, so credits sum exactly to the
converting paths' conversions and value (efficiency). All work on the flat `Paths` arrays at
once (one numpy pass over the touches), not path by path.
"""

from __future__ import annotations

import numpy as np

from attribution.paths import CLICK, Paths


def credit_from_weights(paths: Paths, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split each path's conversions and value over its touches by per-path-normalised weights."""
    pid = paths.path_of_touch
    total = np.bincount(pid, weights=weights, minlength=paths.n)
    # a path whose weights are all zero falls back to equal weights (never drops its conversions)
    zero = total[pid] <= 0
    w = np.where(zero, 1.0, weights)
    total = np.bincount(pid, weights=w, minlength=paths.n)
    w = w / total[pid]
    k = len(paths.channels)
    conv = np.bincount(paths.channel, weights=w * paths.conversions[pid], minlength=k)
    value = np.bincount(paths.channel, weights=w * paths.value[pid], minlength=k)
    return conv, value


def _position(paths: Paths) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per touch: index within its path, path length, path id."""
    pid = paths.path_of_touch
    idx = np.arange(paths.channel.shape[0]) - paths.offsets[:-1][pid]
    return idx, paths.lengths[pid], pid


def first_click(paths: Paths) -> np.ndarray:
    """All credit to the first touch."""
    idx, _, _ = _position(paths)
    return np.asarray(idx == 0, dtype=np.float64)


def last_click(paths: Paths) -> np.ndarray:
    """All credit to the last touch (of any kind: the classic 'last click' report)."""
    idx, length, _ = _position(paths)
    return np.asarray(idx == length - 1, dtype=np.float64)


def last_non_view(paths: Paths) -> np.ndarray:
    """All credit to the last click; a path of views only credits its last view."""
    idx, length, pid = _position(paths)
    is_click = paths.kind == CLICK
    # position of the last click per path (-1 where none)
    last = np.full(paths.n, -1)
    np.maximum.at(last, pid[is_click], idx[is_click])
    target = np.where(last[pid] >= 0, last[pid], length - 1)
    return np.asarray(idx == target, dtype=np.float64)


def linear(paths: Paths) -> np.ndarray:
    """Equal credit to every touch."""
    return np.ones(paths.channel.shape[0])


def position_based(paths: Paths, first: float = 0.4, last: float = 0.4) -> np.ndarray:
    """40 % to the first touch, 40 % to the last, 20 % shared by the middle (U-shaped).

    One touch takes all; two touches split first : last. Middle-less paths renormalise.
    """
    idx, length, _ = _position(paths)
    middle = 1.0 - first - last
    w = np.where(idx == 0, first, 0.0) + np.where(idx == length - 1, last, 0.0)
    inner = (idx > 0) & (idx < length - 1)
    w = np.where(inner, middle / np.maximum(length - 2, 1), w)
    return np.where(length == 1, 1.0, w)


def time_decay(paths: Paths, half_life_s: float, view_weight: float, click_weight: float) -> np.ndarray:
    """Weight 2^(−age / half-life) on the touch's real age, times its kind's weight (view/click)."""
    kind_w = np.where(paths.kind == CLICK, click_weight, view_weight)
    return kind_w * np.exp2(-paths.age_s / half_life_s)


def distinct_linear(paths: Paths) -> np.ndarray:
    """Google Ads Data Hub's "simplified Shapley": equal credit to each distinct channel of a path.

    This is *not* a Shapley value of any coalition game over the data: it is linear credit over
    the distinct channels (arXiv 1804.05327 shows the two coincide only for its simplified
    game, where a coalition is worth the conversions of journeys touching exactly it).
    """
    pid = paths.path_of_touch
    key = pid.astype(np.int64) * (len(paths.channels) + 1) + paths.channel
    _, first_idx = np.unique(key, return_index=True)
    w = np.zeros(paths.channel.shape[0])
    w[first_idx] = 1.0
    return w
