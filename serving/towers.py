"""Recall in the trainers' two-tower space, when `adstream train` wrote one under `model_dir/two_tower`:
ad vectors from the written ad index (new ads: the ad tower on ids + MiniLM title), queries from
the user tower on the user's state, slot and hour. Without it, recall uses `schemas.vectors`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from schemas.events import AdCreative
from trainers.models.text import TitleEncoder
from trainers.models.two_tower import TwoTower, ad_ids, load_ad_index, load_two_tower, user_features

log = logging.getLogger(__name__)


class TowerSpace:
    """The two-tower model and its ad index, as recall needs them."""

    def __init__(
        self, model: TwoTower, version: str, index: dict[str, np.ndarray], encoder: TitleEncoder
    ) -> None:
        self.model = model.eval()
        self.version = version
        self.index = index
        self.encoder = encoder
        self.dim = model.config.out_dim

    @classmethod
    def load(cls, model_dir: Path, title_cache_size: int = 100_000) -> TowerSpace | None:
        """The two-tower space under `model_dir/two_tower`, or None when there is none (new ads'
        title embeddings are cached, up to `title_cache_size` titles)."""
        path = model_dir / "two_tower"
        if not (path / "two_tower.json").exists():
            return None
        model, version = load_two_tower(path)
        index: dict[str, np.ndarray] = {}
        if (path / "ad_index.json").exists():
            ids, vecs, index_version = load_ad_index(path)
            if index_version == version:
                index = {a: v for a, v in zip(ids, vecs.astype(np.float32), strict=True)}
            else:
                log.warning(
                    "ad index %s was built by another two-tower (%s): ignored", index_version, version
                )
        log.info("two-tower recall %s with %d indexed ads", version, len(index))
        return cls(model, version, index, TitleEncoder(cache_size=title_cache_size))

    def knows(self, ad: AdCreative) -> bool:
        return ad.ad_id in self.index

    @torch.inference_mode()
    def ad_vector(self, ad: AdCreative) -> np.ndarray:
        """The indexed vector of a known ad; the ad tower's vector of a new one (MiniLM title)."""
        vec = self.index.get(ad.ad_id)
        if vec is not None:
            return vec
        ids = ad_ids([ad.category], [ad.advertiser_id], [ad.ad_id], self.model.config)
        text = torch.from_numpy(self.encoder.encode([ad.title]))
        out: np.ndarray = self.model.ad_vectors(ids, text)[0].numpy().astype(np.float32)
        self.index[ad.ad_id] = out
        return out

    @torch.inference_mode()
    def ad_vectors(self, ads: list[AdCreative]) -> list[np.ndarray]:
        """`ad_vector` for many ads, the new ones' titles encoded in one batch (start-up)."""
        new = [a for a in ads if a.ad_id not in self.index]
        if new:
            ids = ad_ids(
                [a.category for a in new],
                [a.advertiser_id for a in new],
                [a.ad_id for a in new],
                self.model.config,
            )
            text = torch.from_numpy(self.encoder.encode([a.title for a in new]))
            for a, v in zip(new, self.model.ad_vectors(ids, text).numpy().astype(np.float32), strict=True):
                self.index[a.ad_id] = v
        return [self.index[a.ad_id] for a in ads]

    @torch.inference_mode()
    def query(self, state_vector: np.ndarray, slot: str, hour: int) -> np.ndarray:
        """The user tower's unit vector for this user (zeros for a cold one) in this slot and hour."""
        x = user_features(
            [np.asarray(state_vector, dtype=np.float32).tolist()],
            [slot],
            [hour],
            self.model.config.state_dim,
            self.model.config.slot_buckets,
        )
        out: np.ndarray = self.model.user_vectors(x)[0].numpy().astype(np.float32)
        return out
