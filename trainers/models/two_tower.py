"""The two-tower recall model: user tower (state + context) · ad tower (ids + MiniLM title).

User tower input (`user_features`): the user state vector (`state_dim`), the default slots'
one-hot (3), the hour as sin/cos (2) and the hashed one-hot of other configured slots
(`slot_buckets`, `trainers.models.features.slot_index`; none in a checkpoint from before).
Ad tower input (`ad_features`): hashed category / advertiser / ad ids (int64 [B, 3]) and the
creative title's MiniLM embedding (float32 [B, 384]). During training the ad-id embedding is
dropped for a share of rows (`id_dropout`) so the tower also works from category, advertiser and
title alone: a brand-new ad gets a useful vector at once.

Both towers end in L2-normalised `out_dim` vectors; the click logit is `scale · <u, a> + bias`,
so recall is an inner-product search over `ad_vectors` (the ad index written by `adstream train`:
`ad_index.safetensors` with `vectors` [N, out_dim] and `ad_index.json` with the `ad_ids` order).
Checkpoints: `two_tower.safetensors` + `two_tower.json` (format, version, config); no pickles.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from schemas.errors import ConfigError, ModelError
from schemas.events import SLOTS, AdCreative, TrainingExample
from schemas.stats import auc
from trainers.models.features import slot_index, stable_bucket
from trainers.models.ranker import weights_version
from trainers.models.text import TEXT_DIM, TitleEncoder

FORMAT = "adstream-two-tower"


@dataclass(frozen=True)
class TwoTowerConfig:
    """Shape of the two-tower model; validated on construction."""

    state_dim: int = 32
    out_dim: int = 32
    hidden: int = 64
    emb_dim: int = 16
    category_buckets: int = 256
    advertiser_buckets: int = 1024
    ad_buckets: int = 1 << 14
    text_dim: int = TEXT_DIM
    # one-hot columns of slots beyond the three defaults (hashed), after the hour's; 0: a
    # checkpoint from before slots were configurable (other slots: no slot column set)
    slot_buckets: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            low = 0 if f.name == "slot_buckets" else 1
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ConfigError(f"TwoTowerConfig.{f.name} must be an int >= {low} (got {v!r})")

    @property
    def user_dim(self) -> int:
        """Width of the user tower's input (`user_features`)."""
        return self.state_dim + len(SLOTS) + 2 + self.slot_buckets


class TwoTower(nn.Module):
    """User and ad towers with a cosine-similarity click logit (see the module docstring)."""

    def __init__(self, config: TwoTowerConfig, id_dropout: float = 0.3) -> None:
        super().__init__()
        c = config
        self.config = c
        self.id_dropout = id_dropout
        self.user = nn.Sequential(
            nn.Linear(c.state_dim + len(SLOTS) + 2, c.hidden), nn.ReLU(), nn.Linear(c.hidden, c.out_dim)
        )
        if c.slot_buckets:  # the hashed slots' columns, drawn aside (the global RNG stream is kept)
            first = cast(nn.Linear, self.user[0])
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                wide = nn.Linear(c.user_dim, c.hidden)
                wide.weight[:, : first.in_features] = first.weight
                wide.bias.copy_(first.bias)
            self.user[0] = wide
        self.cat = nn.Embedding(c.category_buckets, c.emb_dim)
        self.adv = nn.Embedding(c.advertiser_buckets, c.emb_dim)
        self.ad = nn.Embedding(c.ad_buckets, c.emb_dim)
        nn.init.normal_(self.ad.weight, std=0.01)
        self.text = nn.Linear(c.text_dim, c.emb_dim)
        self.ad_mlp = nn.Sequential(
            nn.Linear(4 * c.emb_dim, c.hidden), nn.ReLU(), nn.Linear(c.hidden, c.out_dim)
        )
        self.scale = nn.Parameter(torch.tensor(5.0))
        self.bias = nn.Parameter(torch.tensor(-3.0))

    def user_vectors(self, user_x: torch.Tensor) -> torch.Tensor:
        """Unit user vectors [B, out_dim]."""
        return F.normalize(self.user(user_x), dim=1)

    def ad_vectors(self, ad_ids: torch.Tensor, ad_text: torch.Tensor) -> torch.Tensor:
        """Unit ad vectors [B, out_dim] from hashed ids [B, 3] and title embeddings [B, 384]."""
        ad_emb = self.ad(ad_ids[:, 2])
        if self.training and self.id_dropout > 0:
            keep = (torch.rand(ad_emb.shape[0], 1) >= self.id_dropout).float()
            ad_emb = ad_emb * keep
        x = torch.cat([self.cat(ad_ids[:, 0]), self.adv(ad_ids[:, 1]), ad_emb, self.text(ad_text)], dim=1)
        return F.normalize(self.ad_mlp(x), dim=1)

    def forward(self, user_x: torch.Tensor, ad_ids: torch.Tensor, ad_text: torch.Tensor) -> torch.Tensor:
        """Click logits [B]."""
        u, a = self.user_vectors(user_x), self.ad_vectors(ad_ids, ad_text)
        return self.scale * (u * a).sum(1) + self.bias


def user_features(
    vectors: Sequence[Sequence[float]],
    slots: Sequence[str],
    hours: Sequence[int],
    dim: int,
    slot_buckets: int = 0,
) -> torch.Tensor:
    """User tower inputs [B, dim + 5 + slot_buckets]: state vector (padded/cut), the default
    slots' one-hot, hour sin/cos, the other slots' hashed one-hot (`slot_index`; with no hashed
    columns, another slot sets no slot column)."""
    n_fixed = len(SLOTS)
    out = torch.zeros(len(vectors), dim + n_fixed + 2 + slot_buckets)
    for i, (vec, slot, hour) in enumerate(zip(vectors, slots, hours, strict=True)):
        v = list(vec)[:dim]
        out[i, : len(v)] = torch.tensor(v, dtype=torch.float32)
        if slot in SLOTS:
            out[i, dim + SLOTS.index(slot)] = 1.0
        elif slot_buckets:
            out[i, dim + 2 + slot_index(slot, slot_buckets)] = 1.0  # index 3 + b: after sin/cos
        angle = 2 * math.pi * hour / 24
        out[i, dim + len(SLOTS)] = math.sin(angle)
        out[i, dim + len(SLOTS) + 1] = math.cos(angle)
    return out


def ad_ids(
    categories: Sequence[str], advertisers: Sequence[str], ads: Sequence[str], c: TwoTowerConfig
) -> torch.Tensor:
    """Hashed [category, advertiser, ad] ids [B, 3]."""
    return torch.tensor(
        [
            [
                stable_bucket(cat, c.category_buckets, "category"),
                stable_bucket(adv, c.advertiser_buckets, "advertiser"),
                stable_bucket(ad, c.ad_buckets, "ad"),
            ]
            for cat, adv, ad in zip(categories, advertisers, ads, strict=True)
        ],
        dtype=torch.int64,
    ).reshape(-1, 3)


@dataclass(frozen=True)
class TowerBatch:
    """Tensors of labelled (user, ad) pairs for the two-tower model."""

    user_x: torch.Tensor
    ad_ids: torch.Tensor
    ad_text: torch.Tensor
    label: torch.Tensor

    def select(self, idx: torch.Tensor) -> TowerBatch:
        return TowerBatch(self.user_x[idx], self.ad_ids[idx], self.ad_text[idx], self.label[idx])


def tower_batch(
    examples: Sequence[TrainingExample],
    catalog: Mapping[str, AdCreative],
    encoder: TitleEncoder,
    c: TwoTowerConfig,
) -> TowerBatch:
    """Featurize examples; titles come from the catalog (a missing ad gets a zero title vector)."""
    titles = [catalog[e.ad_id].title if e.ad_id in catalog else "" for e in examples]
    known = [t for t in titles if t]
    vecs = dict(zip(known, encoder.encode(known), strict=True)) if known else {}
    text = (
        np.stack([vecs.get(t, np.zeros(c.text_dim, dtype=np.float32)) for t in titles])
        if titles
        else np.zeros((0, c.text_dim))
    )
    return TowerBatch(
        user_features(
            [e.user_vector for e in examples],
            [e.slot for e in examples],
            [e.hour for e in examples],
            c.state_dim,
            c.slot_buckets,
        ),
        ad_ids(
            [e.category for e in examples],
            [e.advertiser_id for e in examples],
            [e.ad_id for e in examples],
            c,
        ),
        torch.from_numpy(np.asarray(text, dtype=np.float32)),
        torch.tensor([float(e.click) for e in examples]),
    )


def train_two_tower(
    batch: TowerBatch,
    c: TwoTowerConfig,
    epochs: int = 4,
    lr: float = 3e-3,
    seed: int = 0,
    batch_size: int = 512,
) -> TwoTower:
    """Fit a two-tower model on labelled pairs (pointwise log loss)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = TwoTower(c)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    n = len(batch.label)
    for _ in range(epochs):
        model.train()
        order = torch.randperm(n, generator=gen)
        for i in range(0, n, batch_size):
            b = batch.select(order[i : i + batch_size])
            opt.zero_grad()
            F.binary_cross_entropy_with_logits(model(b.user_x, b.ad_ids, b.ad_text), b.label).backward()  # type: ignore[no-untyped-call]
            opt.step()
    model.eval()
    return model


def evaluate_two_tower(model: TwoTower, batch: TowerBatch) -> float:
    """AUC of the two-tower click logit on labelled pairs."""
    model.eval()
    with torch.no_grad():
        scores = model(batch.user_x, batch.ad_ids, batch.ad_text).numpy()
    return auc(scores, batch.label.numpy())


def build_ad_index(
    model: TwoTower, ads: Sequence[AdCreative], encoder: TitleEncoder
) -> tuple[list[str], np.ndarray]:
    """(ad_ids, unit vectors [N, out_dim]) of the catalog, for inner-product recall."""
    c = model.config
    ids = ad_ids([a.category for a in ads], [a.advertiser_id for a in ads], [a.ad_id for a in ads], c)
    text = torch.from_numpy(encoder.encode([a.title for a in ads]))
    model.eval()
    with torch.no_grad():
        vecs = model.ad_vectors(ids, text).numpy() if ads else np.zeros((0, c.out_dim), dtype=np.float32)
    return [a.ad_id for a in ads], vecs.astype(np.float32)


def save_two_tower(model: TwoTower, directory: Path | str) -> str:
    """Write `two_tower.safetensors` + `two_tower.json`; returns the version."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    version = weights_version(model).replace("ranker-", "two-tower-")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "two_tower.safetensors"))
    meta = {"format": FORMAT, "format_version": 1, "version": version, "config": asdict(model.config)}
    (out / "two_tower.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return version


def load_two_tower(directory: Path | str) -> tuple[TwoTower, str]:
    """Load a two-tower checkpoint (safetensors only)."""
    path = Path(directory)
    try:
        meta: dict[str, Any] = json.loads((path / "two_tower.json").read_text())
    except FileNotFoundError:
        raise ModelError(f"no two-tower checkpoint at {path}") from None
    if meta.get("format") != FORMAT:
        raise ModelError(f"{path}: field 'format' must be {FORMAT!r} (got {meta.get('format')!r})")
    # saved before slots were configurable: the three default slots' columns only
    model = TwoTower(TwoTowerConfig(**{"slot_buckets": 0, **meta["config"]}))
    try:
        model.load_state_dict(load_file(str(path / "two_tower.safetensors")))
    except (FileNotFoundError, RuntimeError) as exc:
        raise ModelError(f"{path}: two-tower weights missing or mismatched: {exc}") from exc
    model.eval()
    return model, str(meta["version"])


def save_ad_index(ad_ids_: Sequence[str], vectors: np.ndarray, directory: Path | str, version: str) -> None:
    """Write `ad_index.safetensors` (`vectors`) and `ad_index.json` (`ad_ids`, `version`, `dim`)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {"vectors": torch.from_numpy(np.ascontiguousarray(vectors, dtype=np.float32))},
        str(out / "ad_index.safetensors"),
    )
    meta = {
        "format": "adstream-ad-index",
        "version": version,
        "dim": int(vectors.shape[1]),
        "ad_ids": list(ad_ids_),
    }
    (out / "ad_index.json").write_text(json.dumps(meta) + "\n")


def load_ad_index(directory: Path | str) -> tuple[list[str], np.ndarray, str]:
    """(ad_ids, vectors, two-tower version) of a written ad index."""
    path = Path(directory)
    try:
        meta = json.loads((path / "ad_index.json").read_text())
        vectors = load_file(str(path / "ad_index.safetensors"))["vectors"].numpy()
    except (FileNotFoundError, KeyError) as exc:
        raise ModelError(f"no ad index at {path}: {exc}") from exc
    if len(meta["ad_ids"]) != vectors.shape[0]:
        raise ModelError(f"{path}: {len(meta['ad_ids'])} ad ids but {vectors.shape[0]} vectors")
    return list(meta["ad_ids"]), vectors, str(meta["version"])
