"""The CTR ranker: a small DCN-v2 (cross network + deep tower) over user state and ad ids.

Inputs are a `trainers.models.features.RankerBatch` (see that module for the column spec); build one
with `featurize(examples, config)`. `Ranker.forward(dense, ids)` returns click logits [B];
`Ranker.score(batch)` returns probabilities.

Layers (names matter: LoRA adapters target them through `settings.lora.targets`):
- `emb.<column>`: one embedding table per id column (ad, advertiser, campaign, category, slot,
  position, hour), `emb_dim` wide each.
- `cross.<i>` (`Linear(D, D)`, i < `cross_layers`): DCN-v2 cross layers,
  `x_{l+1} = x0 * cross_l(x_l) + x_l`, with `x0` = dense features ‖ embeddings (D wide).
- `deep.<j>`: an MLP `Linear(D, H)`, ReLU, `Linear(H, H)`, ReLU (linear layers at 0 and 2).
- `head`: `Linear(D + H, 1)` on the cross output ‖ deep output (adapted by default, with the
  `wide.category`, `wide.slot` and `wide.position` bias tables).
- `wide.<column>` (`wide=True`): a scalar bias per id value added to the logit (the
  "LR on one-hot ids" part, which learns item/position effects from few clicks).
- `tower.*` (`user_tower="gru"` or `"pool"`, off by default): a sequence user tower
  (`trainers.models.user_tower`), once per request; its fused user vector (`state_dim` wide) joins x0
  after the dense features, and `forward` then needs the requests' `UserSequences`. Off, the
  model is the one above, parameter for parameter.

Checkpoints are a directory with `ranker.safetensors` (weights) and `ranker.json`
(`{"format": "adstream-ranker", "format_version": 1, "version": ..., "config": {...}}`);
never pickles. A checkpoint saved before a config field existed loads with the value that gives
the model it was trained as (`wide` False for format 1, `slot_buckets` 0, `query_features` False);
one whose config names a field this code does not know (saved by a newer release) is refused
with a ModelError naming the field.

>>> torch.manual_seed(0) and None
>>> model = Ranker(RankerConfig(state_dim=4))
>>> model(torch.zeros(2, 9), torch.zeros(2, 7, dtype=torch.int64)).shape
torch.Size([2])
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Final, cast

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from schemas.errors import ConfigError, ModelError
from schemas.events import SLOTS
from trainers.models.features import ID_COLUMNS, N_EXTRA_DENSE, N_QUERY_DENSE, RankerBatch
from trainers.models.user_tower import UserSequences, UserTower

FORMAT: Final = "adstream-ranker"
FORMAT_VERSION: Final = 2  # 2: `wide` part (version-1 checkpoints load with wide=False)
USER_TOWERS: Final = ("none", "gru", "pool")
WEIGHTS_FILE: Final = "ranker.safetensors"
CONFIG_FILE: Final = "ranker.json"
# hashed slot rows of a model trained while slots beyond the defaults are configured
EXTRA_SLOT_BUCKETS: Final = 8


def slot_buckets_for(slots: Collection[str]) -> int:
    """`slot_buckets` of a model trained for the configured `slots`: none while they are the
    defaults (the model is then the one of before, weight for weight), `EXTRA_SLOT_BUCKETS`
    hashed rows once others are configured.

    >>> slot_buckets_for(("feed", "search", "splash")), slot_buckets_for(("feed", "news"))
    (0, 8)
    """
    return EXTRA_SLOT_BUCKETS if set(slots) - set(SLOTS) else 0


def resolve_device(setting: str) -> torch.device:
    """`settings.device` as a torch device, the one rule of trainers and serving: `auto` → cuda
    when available, else cpu; `cuda` without a GPU is an error."""
    if setting == "cuda" and not torch.cuda.is_available():
        raise ModelError("ADSTREAM_DEVICE=cuda but torch sees no CUDA device")
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


@dataclass(frozen=True)
class RankerConfig:
    """Shape of a ranker; validated on construction (messages name the field and the value)."""

    state_dim: int = 32
    emb_dim: int = 8
    ad_buckets: int = 1 << 14
    advertiser_buckets: int = 1 << 10
    campaign_buckets: int = 1 << 12
    category_buckets: int = 256
    max_position: int = 16
    cross_layers: int = 2
    deep_hidden: int = 64
    wide: bool = True
    # the sequence user tower (trainers.models.user_tower): "none" (off), "gru" or "pool". Off by default
    # because it did not pay: at the simulator defaults, reporting seeds 0-2, +0.0003 (gru, K 16)
    # and +0.0004 (pool, K 128) holdout AUC over the decayed state alone, for 2-3x the rank time
    # (benchmarks/results/offline_quality_user_tower.json)
    user_tower: str = "none"
    tower_seq_len: int = 32
    tower_hidden: int = 32
    tower_gate_hidden: int = 128
    # hashed slot rows after the three default slots' fixed ones (`features.slot_index`): slots
    # configured beyond feed/search/splash (`slots.names`, `slot_buckets_for`). 0: the tables
    # hold the three defaults only (as every checkpoint from before); other slots share feed's row
    slot_buckets: int = 0
    # the query text columns (`features`: how well the request's query names the ad, and whether
    # it had one; `Impression.query_match`). A checkpoint saved before them loads with False: its
    # dense input is the three columns after the state vector, as it was trained
    query_features: bool = True

    def __post_init__(self) -> None:
        for flag in ("wide", "query_features"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"RankerConfig.{flag} must be a bool (got {getattr(self, flag)!r})")
        if self.user_tower not in USER_TOWERS:
            raise ConfigError(
                f"RankerConfig.user_tower must be one of {USER_TOWERS} (got {self.user_tower!r})"
            )
        for f in fields(self):
            if f.name in ("wide", "user_tower", "query_features"):
                continue
            value = getattr(self, f.name)
            low = 0 if f.name == "slot_buckets" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                kind = "a non-negative" if low == 0 else "a positive"
                raise ConfigError(f"RankerConfig.{f.name} must be {kind} int (got {value!r})")
        if self.state_dim > 1024:
            raise ConfigError(f"RankerConfig.state_dim must be <= 1024 (got {self.state_dim!r})")

    @property
    def table_sizes(self) -> dict[str, int]:
        """Rows of each id column's embedding table."""
        return {
            "ad": self.ad_buckets,
            "advertiser": self.advertiser_buckets,
            "campaign": self.campaign_buckets,
            "category": self.category_buckets,
            "slot": len(SLOTS) + self.slot_buckets,
            "position": self.max_position,
            "hour": 24,
        }

    @property
    def dense_dim(self) -> int:
        """Width of `RankerBatch.dense` (`features`: the state vector, intent, recall score and
        flag, and with `query_features` the query match and flag)."""
        return self.state_dim + N_EXTRA_DENSE + (N_QUERY_DENSE if self.query_features else 0)

    @property
    def input_dim(self) -> int:
        """Width D of the cross network's input (dense features ‖ fused user vector with the
        tower ‖ embeddings)."""
        tower = self.state_dim if self.user_tower != "none" else 0
        return self.dense_dim + tower + len(ID_COLUMNS) * self.emb_dim

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankerConfig:
        """Rebuild from `asdict`; unknown keys are a ModelError (a newer/other format)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ModelError(f"ranker config has unknown fields {unknown}")
        return cls(**data)


def additive_in_logit(module: str) -> bool:
    """Whether `module`'s output is added to the logit and feeds nothing else: the `head` (its
    output is the logit before the wide biases) and the `wide.*` bias tables. A LoRA change to
    such modules only shifts the logit by its own output, so the frozen base's logit is the
    adapted logit minus the LoRA terms (`AdapterBank.train_logits_and_base`).

    >>> additive_in_logit("head"), additive_in_logit("wide.category"), additive_in_logit("deep.0")
    (True, True, False)
    """
    return module == "head" or module.startswith("wide.")


class Ranker(nn.Module):
    """DCN-v2 CTR model; `forward(dense, ids) -> logits` (see the module docstring)."""

    def __init__(self, config: RankerConfig) -> None:
        super().__init__()
        self.config = config
        # the slot tables start with the default slots' rows only: the hashed rows are drawn last
        # (`_add_slot_rows`), so every other weight is drawn as by a ranker without them
        sizes = dict(config.table_sizes, slot=len(SLOTS))
        tables = {name: nn.Embedding(rows, config.emb_dim) for name, rows in sizes.items()}
        # unit-scale embeddings (PyTorch's default), like the layer-normed dense features: at
        # std 0.01 the ids (category, ad, slot…) reached the cross/deep layers ~20× weaker than
        # the user state, so online LoRA on those layers could barely learn an id-level shift
        # (a category trend: benchmarks/online_drift.py); offline AUC also improves
        for table in tables.values():
            nn.init.normal_(table.weight, std=1.0)
        self.emb = nn.ModuleDict(tables)
        d, h = config.input_dim, config.deep_hidden
        self.input_norm = nn.LayerNorm(config.dense_dim)
        cross = [nn.Linear(d, d) for _ in range(config.cross_layers)]
        for layer in cross:
            nn.init.normal_(layer.weight, std=0.01)
            nn.init.zeros_(layer.bias)
        self.cross = nn.ModuleList(cross)
        self.deep = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU())
        self.head = nn.Linear(d + h, 1)
        # wide part: one learned bias per id value (logistic regression on one-hot ids), which
        # learns item/position effects from few clicks where embeddings through the MLP cannot
        wide = {name: nn.Embedding(rows, 1) for name, rows in sizes.items()} if config.wide else {}
        for bias in wide.values():
            nn.init.zeros_(bias.weight)
        self.wide = nn.ModuleDict(wide)
        # created last, so a ranker without it draws the same initial weights as before
        self.tower = UserTower(config) if config.user_tower != "none" else None
        if config.slot_buckets:
            self._add_slot_rows(config.slot_buckets)

    def _add_slot_rows(self, extra: int) -> None:
        """Append `extra` hashed slot rows to the slot tables (embeddings drawn as the others,
        wide biases zero), drawn from a fork of the global RNG: the RNG stream after a ranker is
        built is the same with or without them (training that follows draws the same numbers)."""
        tables = [(self.emb, self.config.emb_dim)] + ([(self.wide, 1)] if "slot" in self.wide else [])
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for table, dim in tables:
                old = cast(nn.Embedding, table["slot"]).weight
                grown = nn.Embedding(old.shape[0] + extra, dim)
                if table is self.emb:
                    nn.init.normal_(grown.weight, std=1.0)
                else:
                    nn.init.zeros_(grown.weight)
                grown.weight[: old.shape[0]] = old
                table["slot"] = grown

    def user_vector(
        self, dense: torch.Tensor, ids: torch.Tensor, seq: UserSequences
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(fused user vector per request [R, state_dim], gate weights [R, 3]) of the tower.

        A request's decayed state and context are read from its first candidate row (every row
        of one request carries the same ones).
        """
        if self.tower is None:
            raise ModelError("this ranker has no user tower (RankerConfig.user_tower='none')")
        n = ids.shape[0]
        first = torch.full((seq.requests,), n, dtype=torch.int64, device=ids.device)
        first = first.scatter_reduce(0, seq.row, torch.arange(n, device=ids.device), reduce="amin")
        if bool((first >= n).any()):
            raise ModelError("UserSequences has a request no candidate row points at (use select())")
        rows_ids = ids[first]
        context = torch.cat([self.emb["slot"](rows_ids[:, 4]), self.emb["hour"](rows_ids[:, 6])], dim=1)
        fused, weights = self.tower(self.emb, dense[first, : self.config.state_dim], context, seq)
        return fused, weights

    def forward(
        self, dense: torch.Tensor, ids: torch.Tensor, seq: UserSequences | None = None
    ) -> torch.Tensor:
        """Click logits, shape [B], for dense features [B, dense_dim] and ids [B, 7] (and,
        with the user tower, the requests' sequences; `seq.row` [B] maps rows to requests)."""
        logit: torch.Tensor = self.head(self.head_input(dense, ids, seq)).squeeze(1)
        for i, name in enumerate(ID_COLUMNS):
            if name in self.wide:
                logit = logit + self.wide[name](ids[:, i]).squeeze(1)
        return logit

    def head_input(
        self, dense: torch.Tensor, ids: torch.Tensor, seq: UserSequences | None = None
    ) -> torch.Tensor:
        """What `head` reads, [B, input_dim + deep_hidden]: the cross and deep outputs side by
        side. The logit is `head` of it plus the `wide` biases (`forward`)."""
        parts = [self.input_norm(dense)]
        if self.tower is not None:
            if seq is None or len(seq) != ids.shape[0]:
                tower = self.config.user_tower
                raise ModelError(f"a ranker with user_tower={tower!r} needs `seq` with one row per candidate")
            fused, _ = self.user_vector(dense, ids, seq)
            parts.append(fused[seq.row])
        elif seq is not None:
            raise ModelError("`seq` given to a ranker without a user tower (user_tower='none')")
        parts += [self.emb[name](ids[:, i]) for i, name in enumerate(ID_COLUMNS)]
        x0 = torch.cat(parts, dim=1)
        x = x0
        for layer in self.cross:
            x = x0 * layer(x) + x
        return torch.cat([x, self.deep(x0)], dim=1)

    @torch.no_grad()
    def score(self, batch: RankerBatch, seq: UserSequences | None = None) -> torch.Tensor:
        """Click probabilities [B] (no gradient; `seq` for a ranker with the user tower)."""
        return torch.sigmoid(self(batch.dense, batch.ids, seq))


def weights_version(model: nn.Module) -> str:
    """A content hash of the weights: equal weights, equal version (used as `base_version`)."""
    h = hashlib.blake2b(digest_size=8)
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return f"ranker-{h.hexdigest()}"


def save_checkpoint(model: Ranker, directory: Path | str, version: str | None = None) -> str:
    """Write `ranker.safetensors` + `ranker.json` into `directory`; returns the version written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    version = version or weights_version(model)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": FORMAT, "version": version})
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "version": version,
        "config": asdict(model.config),
    }
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return version


def read_checkpoint_meta(directory: Path | str) -> dict[str, Any]:
    """The JSON config of a checkpoint, validated (format, format_version, version, config)."""
    path = Path(directory) / CONFIG_FILE
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"no ranker checkpoint at {directory} (missing {CONFIG_FILE})") from None
    except ValueError as exc:
        raise ModelError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ModelError(f"{path}: field 'format' must be {FORMAT!r} (got {meta.get('format')!r})")
    if meta.get("format_version") not in (1, FORMAT_VERSION):
        raise ModelError(
            f"{path}: field 'format_version' must be {FORMAT_VERSION} (got {meta.get('format_version')!r})"
        )
    if not isinstance(meta.get("version"), str) or not isinstance(meta.get("config"), dict):
        raise ModelError(f"{path}: fields 'version' (str) and 'config' (object) are required")
    return meta


def load_checkpoint(directory: Path | str, device: str | torch.device = "cpu") -> tuple[Ranker, str]:
    """Load a ranker and its version from a checkpoint directory (safetensors only)."""
    meta = read_checkpoint_meta(directory)
    config = dict(meta["config"])
    if meta["format_version"] == 1:
        config.setdefault("wide", False)
    config.setdefault("slot_buckets", 0)  # saved before slots were configurable: 3 slot rows
    config.setdefault("query_features", False)  # saved before the query columns: 3 extra columns
    model = Ranker(RankerConfig.from_dict(config))
    weights = Path(directory) / WEIGHTS_FILE
    try:
        state = load_file(str(weights), device=str(device))
    except FileNotFoundError:
        raise ModelError(f"no ranker weights at {weights}") from None
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ModelError(f"{weights} does not match its config: {exc}") from exc
    model.to(device)
    model.eval()
    return model, str(meta["version"])
