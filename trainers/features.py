"""The ranker's batch feature spec: what one candidate looks like to the model, as tensors.

`featurize(examples, config)` is a pure function from `TrainingExample`-like objects (anything
with the attributes of `RankerInput`) to a `RankerBatch`. Serving builds the same inputs for the
candidates of a request; training reads them from `ad.training-examples`.

Columns of `RankerBatch.dense` (float32, shape [B, state_dim + 3]):

====================  =====================================================================
columns               meaning
====================  =====================================================================
0 … state_dim-1       the user state vector (`user_vector`; zero-padded/truncated to dim)
state_dim             `intent_score` of the ad's category for this user
state_dim + 1         `recall_score` (0 when absent)
state_dim + 2         1.0 when `recall_score` is present, else 0.0
====================  =====================================================================

Columns of `RankerBatch.ids` (int64, shape [B, 7]), each indexing its own embedding table:

=====  ============  ===================================================================
col    name          value
=====  ============  ===================================================================
0      ad            `stable_bucket(ad_id, ad_buckets, "ad")`
1      advertiser    `stable_bucket(advertiser_id, advertiser_buckets, "advertiser")`
2      campaign      `stable_bucket(campaign_id, campaign_buckets, "campaign")`
3      category      `stable_bucket(category, category_buckets, "category")`
4      slot          index in `schemas.events.SLOTS` (feed=0, search=1, splash=2)
5      position      `min(position, max_position - 1)`
6      hour          hour of day 0 … 23 (UTC, from the impression)
=====  ============  ===================================================================

`RankerBatch.label` is the click label (float32 0/1, shape [B]) when every input has `click`,
else None.

>>> from trainers.ranker import RankerConfig
>>> cfg = RankerConfig(state_dim=4)
>>> class Ex:
...     user_vector = [0.5, 0.5, 0.0, 0.0]; intent_score = 1.5; recall_score = None
...     ad_id = "a1"; advertiser_id = "v1"; campaign_id = "c1"; category = "shoes"
...     slot = "search"; position = 40; hour = 13; click = True
>>> b = featurize([Ex()], cfg)
>>> b.dense.shape, b.ids.shape, b.ids[0, 4:].tolist(), b.label.tolist()
(torch.Size([1, 7]), torch.Size([1, 7]), [1, 15, 13], [1.0])
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Protocol

import torch

from schemas.errors import SchemaError
from schemas.events import SLOTS

if TYPE_CHECKING:
    from trainers.ranker import RankerConfig

N_EXTRA_DENSE = 3
ID_COLUMNS = ("ad", "advertiser", "campaign", "category", "slot", "position", "hour")
_SLOT_INDEX: dict[str, int] = {s: i for i, s in enumerate(SLOTS)}


class RankerInput(Protocol):
    """What the ranker needs to know about one (user, ad) candidate; TrainingExample has it all."""

    @property
    def user_vector(self) -> Sequence[float]: ...
    @property
    def intent_score(self) -> float: ...
    @property
    def recall_score(self) -> float | None: ...
    @property
    def ad_id(self) -> str: ...
    @property
    def advertiser_id(self) -> str: ...
    @property
    def campaign_id(self) -> str: ...
    @property
    def category(self) -> str: ...
    @property
    def slot(self) -> str: ...
    @property
    def position(self) -> int: ...
    @property
    def hour(self) -> int: ...


@dataclass(frozen=True)
class RankerBatch:
    """A batch of ranker inputs as tensors (see the module docstring for the columns)."""

    dense: torch.Tensor
    ids: torch.Tensor
    label: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.dense.shape[0])

    def select(self, index: torch.Tensor) -> RankerBatch:
        """The rows at `index` (a bool mask or int64 indices) as a new batch."""
        return RankerBatch(
            self.dense[index], self.ids[index], None if self.label is None else self.label[index]
        )

    def to(self, device: torch.device | str) -> RankerBatch:
        """The same batch on another device."""
        return RankerBatch(
            self.dense.to(device),
            self.ids.to(device),
            None if self.label is None else self.label.to(device),
        )


@lru_cache(maxsize=1 << 18)
def stable_bucket(value: str, buckets: int, salt: str) -> int:
    """A process-independent hash bucket of `value` (Python's `hash` is salted per process)."""
    digest = hashlib.blake2b(f"{salt}:{value}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % buckets


def _row_ids(ex: RankerInput, cfg: RankerConfig) -> list[int]:
    slot = _SLOT_INDEX.get(ex.slot)
    if slot is None:
        raise SchemaError(f"field 'slot': unknown slot {ex.slot!r} (known: {', '.join(SLOTS)})")
    if not 0 <= ex.hour <= 23:
        raise SchemaError(f"field 'hour': must be 0 … 23 (got {ex.hour!r})")
    if ex.position < 0:
        raise SchemaError(f"field 'position': must be >= 0 (got {ex.position!r})")
    return [
        stable_bucket(ex.ad_id, cfg.ad_buckets, "ad"),
        stable_bucket(ex.advertiser_id, cfg.advertiser_buckets, "advertiser"),
        stable_bucket(ex.campaign_id, cfg.campaign_buckets, "campaign"),
        stable_bucket(ex.category, cfg.category_buckets, "category"),
        slot,
        min(int(ex.position), cfg.max_position - 1),
        int(ex.hour),
    ]


def featurize(examples: Sequence[RankerInput], cfg: RankerConfig) -> RankerBatch:
    """Tensors for a list of candidates; pure (inputs are only read), deterministic.

    Raises SchemaError naming the field for an unknown slot or an out-of-range hour/position.
    """
    n, dim = len(examples), cfg.state_dim
    dense = torch.zeros((n, dim + N_EXTRA_DENSE), dtype=torch.float32)
    ids = torch.empty((n, len(ID_COLUMNS)), dtype=torch.int64)
    labels: list[float] = []
    id_rows: list[list[int]] = []
    vec_rows: list[list[float]] = []
    extra_rows: list[list[float]] = []
    for ex in examples:
        vec = list(ex.user_vector)[:dim]
        vec_rows.append(vec + [0.0] * (dim - len(vec)))
        rs = ex.recall_score
        extra_rows.append([float(ex.intent_score), 0.0 if rs is None else float(rs), float(rs is not None)])
        id_rows.append(_row_ids(ex, cfg))
        click = getattr(ex, "click", None)
        if click is not None:
            labels.append(1.0 if click else 0.0)
    if n:
        dense[:, :dim] = torch.tensor(vec_rows, dtype=torch.float32)
        dense[:, dim:] = torch.tensor(extra_rows, dtype=torch.float32)
        ids[:] = torch.tensor(id_rows, dtype=torch.int64)
    if not torch.isfinite(dense).all():
        raise SchemaError("field 'intent_score'/'recall_score': every value must be finite")
    label = torch.tensor(labels, dtype=torch.float32) if n and len(labels) == n else None
    return RankerBatch(dense=dense, ids=ids, label=label)
