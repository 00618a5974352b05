"""Query text in recall and rank: how well a request's `query` names each ad.

An ad's words (category and title) are kept per catalog row as a hashed bag of words
(`schemas.vectors.text_vector`, `Catalog.text`); the query is put in the same space, and their
inner product (a cosine) times `recall.text_weight` is added to the ad's recall score. The exact
index scores every row so; an approximate one (ivf, usearch) is searched for the query vector as
before and its candidates are joined by the best text matches, then re-scored together.

The ranker reads the same cosine, unweighted, as a feature of its own (`text_match`: the query
columns of `trainers.models.features`), and every served impression logs it
(`Impression.query_match`), so training sees what serving ranked with.
"""

from __future__ import annotations

import numpy as np

from schemas.vectors import text_vector
from serving.index import top_k


def query_match(
    text: np.ndarray, n: int, query: str | None, weight: float, rows: np.ndarray | None = None
) -> np.ndarray | None:
    """The weighted match of `query` with each of the first `n` rows of `text` ([n] float32; or
    with `rows` only, in their order), or None when there is nothing to add (no query, no words
    in it, no text kept, weight 0)."""
    if rows is None:
        return query_matches(text, n, [query], weight)[0]
    out = query_matches(text[rows], rows.shape[0], [query], weight)[0]
    return out


def query_matches(
    text: np.ndarray, n: int, queries: list[str | None], weight: float
) -> list[np.ndarray | None]:
    """`query_match` of a batch's queries: only the buckets some query's words fall in are read
    (a query of a few words touches a few of `text`'s columns: a gather and a small product,
    where the whole [n, dim] product cost ~dim / words times more), one product for the batch."""
    dim = text.shape[1]
    out: list[np.ndarray | None] = [None] * len(queries)
    if not dim or weight <= 0:
        return out
    vecs = {i: np.asarray(text_vector(q, dim), dtype=np.float32) for i, q in enumerate(queries) if q}
    vecs = {i: v for i, v in vecs.items() if v.any()}
    if vecs:
        q = np.stack(list(vecs.values()))  # [queries, dim]
        used = np.flatnonzero(q.any(axis=0))
        scores = (text[:n, used] @ q[:, used].T) * np.float32(weight)  # [n, queries]
        for j, i in enumerate(vecs):
            out[i] = np.ascontiguousarray(scores[:, j])
    return out


def text_match(text: np.ndarray, query: str | None, rows: np.ndarray) -> np.ndarray | None:
    """The ranker's query feature of `rows`: the cosine of `query`'s bag of words with each row's
    ([len(rows)] float32 within [-1, 1]), not weighted (the recall weight is a recall setting,
    the ranker learns its own). None without a query or without kept text (`recall.text_dim` 0);
    a query without words names nothing: zeros (it is still a search, which the flag says).

    >>> text = np.eye(4, dtype=np.float32)
    >>> text_match(text, None, np.arange(4)) is None, text_match(text, "?!", np.arange(2)).tolist()
    (True, [0.0, 0.0])
    """
    dim = text.shape[1]
    if query is None or not dim:
        return None
    q = np.asarray(text_vector(query, dim), dtype=np.float32)
    used = np.flatnonzero(q)
    if not used.shape[0] or not rows.shape[0]:
        return np.zeros(rows.shape[0], dtype=np.float32)
    # a few words touch a few columns: a gather of rows x words, as `query_matches` does
    out: np.ndarray = np.clip(text[np.ix_(rows, used)] @ q[used], -1.0, 1.0).astype(np.float32, copy=False)
    return out


def join_matches(
    found: tuple[np.ndarray, np.ndarray],
    match: np.ndarray,
    vectors: np.ndarray,
    query: np.ndarray,
    k: int,
    allowed: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """An approximate index's top `k` (`found`) joined by the `k` best text matches among
    `allowed` rows, all re-scored as query vector · ad vector + match; the best `k` of them."""
    rows = found[0]
    positive = match > 0
    if allowed is not None:
        positive &= allowed[: match.shape[0]]
    hits, _ = top_k(np.where(positive, match, -np.inf), k, positive)
    both = np.union1d(rows, hits).astype(np.int64)
    scores = vectors[both] @ np.asarray(query, dtype=np.float32) + match[both]
    top, best = top_k(scores, k, None)
    return both[top], best
