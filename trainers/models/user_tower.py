"""A sequence user tower for the ranker: a GRU over the user's recent events, gated with the
decayed user state and the request context (`RankerConfig(user_tower="gru")`; `"pool"` swaps
the GRU for an order-free sum of a per-event MLP, log-compressed: cheap for long histories).

The decayed state (`streams.state`) summarises a user's whole history in one vector whose old
evidence fades (half-life and a 0.85 discount per session); the tower reads the user's last
`tower_seq_len` impressions before the request as a sequence instead. Per event (oldest first):

==================  ================================================================
input               value
==================  ================================================================
ad, category        the ranker's own `emb.ad` / `emb.category` rows (shared tables)
click               1.0 when the event's click arrived before the request, else 0.0
dwell bucket        one-hot of 5: unknown / < 2 s / < 10 s / < 30 s / ≥ 30 s (known dwell only)
age                 log(1 + seconds from the event to the request)
==================  ================================================================

The sequence summary, the layer-normed decayed state and the context (`emb.slot` ‖
`emb.hour`) are each projected to `state_dim` and mixed by a gate: a two-layer MLP (hidden
`tower_gate_hidden`) over the three inputs with softmax weights over the modalities. The fused
vector joins the ranker's input beside the dense features (the decayed state stays there too).

Everything here is per request, not per candidate: `UserSequences` holds one row per request and
`row` maps each candidate to its request, so serving 500 candidates runs the GRU once.

`build_sequences(events, examples, config)` makes the sequences offline from a time-ordered
contract event stream with no leakage: only impressions strictly before the request, a click or
dwell only once its own event has arrived (never the request's own outcome).

>>> from trainers.models.ranker import RankerConfig
>>> cfg = RankerConfig(state_dim=4, user_tower="gru", tower_seq_len=3, tower_hidden=5)
>>> seqs = UserSequences.empty(2, cfg.tower_seq_len)
>>> seqs.ad.shape, int(seqs.length.sum())
(torch.Size([2, 3]), 0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Final, Protocol

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from schemas.errors import SchemaError
from schemas.events import AdCreative, Click, Dwell, Impression, Message
from trainers.models.features import stable_bucket

if TYPE_CHECKING:
    from trainers.models.ranker import RankerConfig

DWELL_EDGES_MS: Final = (2_000, 10_000, 30_000)  # bucket 1 … 4 (0: no dwell known yet)
N_DWELL: Final = len(DWELL_EDGES_MS) + 2
MODALITIES: Final = ("decayed", "sequence", "context")
UNKNOWN_CATEGORY: Final = "unknown"  # what the streams worker calls an ad missing from the catalog


class RequestKey(Protocol):
    """What the builder needs of one candidate row (a TrainingExample has it)."""

    @property
    def user_id(self) -> str: ...
    @property
    def impression_ts(self) -> datetime: ...


@dataclass(frozen=True)
class UserSequences:
    """Each request's last K events (right-padded, oldest first) and each row's request."""

    ad: torch.Tensor  # int64 [R, K] ad bucket
    category: torch.Tensor  # int64 [R, K] category bucket
    click: torch.Tensor  # float32 [R, K]
    dwell: torch.Tensor  # int64 [R, K] dwell bucket 0 … N_DWELL-1
    age: torch.Tensor  # float32 [R, K] log1p(seconds before the request)
    length: torch.Tensor  # int64 [R] valid events per request (0 … K)
    row: torch.Tensor  # int64 [B] request index of each candidate row

    def __len__(self) -> int:
        return int(self.row.shape[0])

    @property
    def requests(self) -> int:
        return int(self.length.shape[0])

    @classmethod
    def empty(cls, rows: int, k: int) -> UserSequences:
        """Every row its own request with no history (a cold user)."""
        zeros = torch.zeros((rows, k), dtype=torch.int64)
        return cls(
            zeros, zeros.clone(), torch.zeros((rows, k)), zeros.clone(), torch.zeros((rows, k)),
            torch.zeros(rows, dtype=torch.int64), torch.arange(rows),
        )  # fmt: skip

    @classmethod
    def one_full_request(cls, candidates: int, k: int) -> UserSequences:
        """One request whose user has a full history of `k` events, all `candidates` rows on it
        (the shape one request's rank time is measured on; the values do not change the cost).

        >>> s = UserSequences.one_full_request(500, 16)
        >>> len(s), s.requests, int(s.length[0])
        (500, 1, 16)
        """
        seq = cls.empty(1, k)
        return dataclasses.replace(
            seq, length=torch.full((1,), k, dtype=torch.int64), row=torch.zeros(candidates, dtype=torch.int64)
        )

    def select(self, index: torch.Tensor) -> UserSequences:
        """The candidate rows at `index` with only the requests they use (renumbered)."""
        used, row = torch.unique(self.row[index], return_inverse=True)
        return UserSequences(
            self.ad[used], self.category[used], self.click[used], self.dwell[used], self.age[used],
            self.length[used], row,
        )  # fmt: skip

    def to(self, device: torch.device | str) -> UserSequences:
        return UserSequences(*(t.to(device) for t in self._tensors()))

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.ad, self.category, self.click, self.dwell, self.age, self.length, self.row)


def dwell_bucket(dwell_ms: int) -> int:
    """The dwell bucket 1 … 4 of a known dwell (0 is kept for "none known").

    >>> [dwell_bucket(ms) for ms in (500, 5_000, 20_000, 60_000)]
    [1, 2, 3, 4]
    """
    return 1 + int(np.searchsorted(DWELL_EDGES_MS, dwell_ms, side="right"))


@dataclass
class _UserLog:
    ts: list[float]
    ad: list[int]
    category: list[int]
    impression: list[str]


def build_sequences(
    events: Iterable[Message], examples: Sequence[RequestKey], config: RankerConfig
) -> UserSequences:
    """The sequence inputs of `examples` (candidate rows, in batch order) from the event stream.

    `events` is the contract stream the examples were joined from, in time order (catalog
    entries give each ad's category). A request is a (user, impression time) pair: the rows of one
    served list share it. Its sequence is the user's last `config.tower_seq_len` impressions with
    a timestamp strictly before the request's, each with its click (dwell) flag set only when the
    click (dwell) event's own timestamp is before the request too.
    """
    k = config.tower_seq_len
    categories: dict[str, str] = {}
    logs: dict[str, _UserLog] = {}
    click_ts: dict[str, float] = {}
    dwell: dict[str, tuple[float, int]] = {}
    for ev in events:
        if isinstance(ev, AdCreative):
            categories[ev.ad_id] = ev.category
        elif isinstance(ev, Impression):
            log = logs.get(ev.user_id)
            if log is None:
                log = logs[ev.user_id] = _UserLog([], [], [], [])
            log.ts.append(ev.ts.timestamp())
            log.ad.append(stable_bucket(ev.ad_id, config.ad_buckets, "ad"))
            cat = categories.get(ev.ad_id, UNKNOWN_CATEGORY)
            log.category.append(stable_bucket(cat, config.category_buckets, "category"))
            log.impression.append(ev.event_id)
        elif isinstance(ev, Click):
            t = ev.ts.timestamp()
            click_ts[ev.impression_id] = min(t, click_ts.get(ev.impression_id, math.inf))
        elif isinstance(ev, Dwell) and ev.impression_id not in dwell:
            dwell[ev.impression_id] = (ev.ts.timestamp(), ev.dwell_ms)
    keys = [(ex.user_id, ex.impression_ts.timestamp()) for ex in examples]
    req_of: dict[tuple[str, float], int] = {}
    row = np.array([req_of.setdefault(key, len(req_of)) for key in keys], dtype=np.int64)
    n_req = len(req_of)
    out: dict[str, np.ndarray] = {
        "ad": np.zeros((n_req, k), np.int64),
        "category": np.zeros((n_req, k), np.int64),
        "click": np.zeros((n_req, k), np.float32),
        "dwell": np.zeros((n_req, k), np.int64),
        "age": np.zeros((n_req, k), np.float32),
    }
    length = np.zeros(n_req, np.int64)
    by_user: dict[str, list[tuple[int, float]]] = {}
    for (user, t), r in req_of.items():
        by_user.setdefault(user, []).append((r, t))
    steps = np.arange(k)
    for user, reqs in by_user.items():
        log = logs.get(user)
        if log is None:
            continue
        ts = np.asarray(log.ts)
        if np.any(np.diff(ts) < 0):
            raise SchemaError(f"field 'ts': impressions of user {user!r} are not in time order")
        ads, cats = np.asarray(log.ad), np.asarray(log.category)
        clk = np.array([click_ts.get(i, math.inf) for i in log.impression])
        dw = [dwell.get(i) for i in log.impression]
        dw_ts = np.array([math.inf if d is None else d[0] for d in dw])
        dw_b = np.array([0 if d is None else dwell_bucket(d[1]) for d in dw], dtype=np.int64)
        r_idx = np.array([r for r, _ in reqs], dtype=np.int64)
        t_req = np.array([t for _, t in reqs])
        end = np.searchsorted(ts, t_req, side="left")  # events strictly before the request
        start = np.maximum(end - k, 0)
        idx = start[:, None] + steps[None, :]
        valid = idx < end[:, None]
        idx = np.where(valid, idx, 0)
        t_col = t_req[:, None]
        out["ad"][r_idx] = np.where(valid, ads[idx], 0)
        out["category"][r_idx] = np.where(valid, cats[idx], 0)
        out["click"][r_idx] = valid & (clk[idx] < t_col)
        out["dwell"][r_idx] = np.where(valid & (dw_ts[idx] < t_col), dw_b[idx], 0)
        out["age"][r_idx] = np.where(valid, np.log1p(np.maximum(t_col - ts[idx], 0.0)), 0.0)
        length[r_idx] = end - start
    return UserSequences(
        torch.from_numpy(out["ad"]), torch.from_numpy(out["category"]), torch.from_numpy(out["click"]),
        torch.from_numpy(out["dwell"]), torch.from_numpy(out["age"]), torch.from_numpy(length),
        torch.from_numpy(row),
    )  # fmt: skip


class UserTower(nn.Module):
    """GRU over a request's events + gated fusion with the decayed state and the context."""

    def __init__(self, config: RankerConfig) -> None:
        super().__init__()
        e, d, h = config.emb_dim, config.state_dim, config.tower_hidden
        self.hidden = h
        step = 2 * e + 1 + N_DWELL + 1
        self.gru = nn.GRU(step, h, batch_first=True) if config.user_tower == "gru" else None
        self.pool = (
            nn.Sequential(nn.Linear(step, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU())
            if config.user_tower == "pool"
            else None
        )
        self.user_norm = nn.LayerNorm(d)
        widths = {"decayed": d, "sequence": h, "context": 2 * e}
        self.proj = nn.ModuleDict({m: nn.Linear(widths[m], d) for m in MODALITIES})
        self.gate = nn.Sequential(
            nn.Linear(sum(widths.values()) + 1, config.tower_gate_hidden),
            nn.ReLU(),
            nn.Linear(config.tower_gate_hidden, len(MODALITIES)),
        )

    def encode(self, emb: nn.ModuleDict, seq: UserSequences) -> torch.Tensor:
        """The sequence summary per request [R, tower_hidden]; zeros without history: the GRU's
        last hidden state, or (`pool`) log(1 + Σ over events of a per-event ReLU MLP)."""
        steps = torch.cat(
            [
                emb["ad"](seq.ad),
                emb["category"](seq.category),
                seq.click.unsqueeze(-1),
                nn.functional.one_hot(seq.dwell, N_DWELL).to(seq.click.dtype),
                seq.age.unsqueeze(-1),
            ],
            dim=-1,
        )
        if self.pool is not None:
            valid = torch.arange(steps.shape[1], device=steps.device)[None, :] < seq.length[:, None]
            return torch.log1p((self.pool(steps) * valid.unsqueeze(-1).to(steps.dtype)).sum(1))
        assert self.gru is not None
        has = seq.length > 0
        hidden = torch.zeros(seq.requests, self.hidden, device=steps.device, dtype=steps.dtype)
        if bool(has.any()):
            lengths = seq.length[has].cpu()
            packed = pack_padded_sequence(steps[has], lengths, batch_first=True, enforce_sorted=False)
            _, last = self.gru(packed)
            hidden = hidden.index_put((has.nonzero().squeeze(1),), last[0])
        return hidden

    def forward(
        self, emb: nn.ModuleDict, user: torch.Tensor, context: torch.Tensor, seq: UserSequences
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(fused user vector [R, state_dim], gate weights [R, 3] in `MODALITIES` order).

        `user` is the raw decayed state [R, state_dim], `context` the slot ‖ hour rows [R, 2·emb].
        """
        inputs = {"decayed": self.user_norm(user), "sequence": self.encode(emb, seq), "context": context}
        has = (seq.length > 0).to(user.dtype).unsqueeze(1)
        gate_in = torch.cat([inputs[m] for m in MODALITIES] + [has], dim=1)
        weights = torch.softmax(self.gate(gate_in), dim=1)
        fused = sum(weights[:, i : i + 1] * self.proj[m](inputs[m]) for i, m in enumerate(MODALITIES))
        assert isinstance(fused, torch.Tensor)
        return fused, weights
