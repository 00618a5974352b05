"""The shared content-vector space of ads: user state vectors are combinations of these.

Every room that needs an ad's vector before a learned one exists (streams for user state,
trainers for features, serving for cold recall) uses this one deterministic function, so the
`user_vector` of a TrainingExample means the same thing everywhere.
"""

from __future__ import annotations

import hashlib
import math
import re

_TOKEN = re.compile(r"[a-z0-9]+")


def _bucket(token: str, dim: int) -> tuple[int, float]:
    digest = hashlib.blake2b(token.encode(), digest_size=8).digest()
    value = int.from_bytes(digest, "little")
    return value % dim, (1.0 if (value >> 63) & 1 else -1.0)


def content_vector(category: str, title: str, dim: int, category_weight: float = 3.0) -> list[float]:
    """A unit vector of an ad from its category and title tokens (signed feature hashing).

    The category dominates (weight 3 against 1 per title token) so ads of one category lie close.

    >>> v = content_vector("shoes", "Red running shoes", 16)
    >>> round(sum(x * x for x in v), 6)
    1.0
    >>> content_vector("shoes", "x", 16) == content_vector("shoes", "x", 16)
    True
    """
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    vec = [0.0] * dim
    idx, sign = _bucket(f"cat:{category.lower()}", dim)
    vec[idx] += sign * category_weight
    for token in _TOKEN.findall(title.lower()):
        idx, sign = _bucket(f"tok:{token}", dim)
        vec[idx] += sign
    norm = math.sqrt(sum(x * x for x in vec))
    return [x / norm for x in vec] if norm > 0 else vec


_WORD = re.compile(r"[^\W_]+")


def text_vector(text: str, dim: int) -> list[float]:
    """A unit vector of a text's words (signed feature hashing of lower-cased letter/digit runs,
    any script): ads' text (`serving.catalog`: category and title) and a request's `query` are
    put in this one space, so their inner product is how well the query names the ad. A bag of
    words costs microseconds where a sentence encoder costs milliseconds per query.

    >>> ad = text_vector("shoes Red running shoes", 64)
    >>> sum(a * b for a, b in zip(text_vector("running", 64), ad)) > 0.3
    True
    >>> text_vector("", 8) == [0.0] * 8
    True
    """
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    vec = [0.0] * dim
    for word in _WORD.findall(text.lower()):
        idx, sign = _bucket(f"word:{word}", dim)
        vec[idx] += sign
    norm = math.sqrt(sum(x * x for x in vec))
    return [x / norm for x in vec] if norm > 0 else vec
