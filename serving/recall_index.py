"""The recall index the settings name (`recall.index`: exact, ivf or usearch), built over the
catalog's matrix. It lives apart from the index kinds so that none of them imports another
(`serving.index` holds the protocol and exact search, `serving.ivf` and `serving.ann` the two
approximate ones)."""

from __future__ import annotations

import numpy as np

from schemas.settings import Settings
from serving.ann import UsearchIndex
from serving.index import ExactIndex
from serving.ivf import IvfIndex


def make_index(settings: Settings, vectors: np.ndarray, n: int) -> ExactIndex | IvfIndex | UsearchIndex:
    """The recall index `settings.recall.index` names, over the catalog's matrix."""
    if settings.recall.index == "exact":
        return ExactIndex(vectors, n)
    index: IvfIndex | UsearchIndex
    if settings.recall.index == "ivf":
        index = IvfIndex(
            vectors.shape[1],
            lists=settings.recall.ivf_lists,
            scan=settings.recall.ivf_scan,
            exact_below=settings.recall.ann_min_ads,
        )
        index.update(vectors, n)
        return index
    index = UsearchIndex(
        vectors.shape[1],
        connectivity=settings.recall.ann_connectivity,
        expansion_add=settings.recall.ann_expansion_add,
        expansion_search=settings.recall.ann_expansion_search,
        dtype=settings.recall.ann_dtype,
        oversample=settings.recall.ann_oversample,
        exact_below=settings.recall.ann_min_ads,
    )
    index.update(vectors, n)
    return index
