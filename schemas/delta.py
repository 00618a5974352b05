"""The sparse ΔW wire format of LoRA adapters, and the guarded way to apply it (hot swap).

Payload (`AdapterDelta.payload`): safetensors bytes, metadata `{"format": "adstream-delta-v1"}`.
For each target module `<m>` (e.g. `cross.0`) that has changed rank directions:

==================  =========  ============  =============================================
tensor              dtype      shape         meaning
==================  =========  ============  =============================================
`<m>.dirs`          int64      [k]           indices (0 … r-1, unique) of the directions
`<m>.lora_A`        float32    [k, in]       new rows `A[dirs, :]`
`<m>.lora_B`        float32    [out, k]      new columns `B[:, dirs]`
==================  =========  ============  =============================================

The listed directions' values **replace** the current ones; unlisted ones are kept. A full
snapshot (`AdapterDelta.snapshot=True`) lists every direction of every module.

Adapter state (`AdapterState.tensors`): `{"<m>.lora_A": [r, in], "<m>.lora_B": [out, r]}`,
the layout of `trainers.models.lora.AdapterBank.get_state`. A replica with no state starts from
`empty_state(...)` (all zeros: the same scores as the base model) at `seq = -1`.

`AdapterDelta.norm`: for an incremental delta, the L2 norm of the change it makes to A and B
(against the state at `seq - 1`); for a snapshot, the L2 norm of all its values.

Sequence: each adapter's messages carry `seq` 0, 1, 2, … An incremental delta applies only to
the state at `seq - 1` (`SeqGapError` otherwise: re-sync from the Redis snapshot); one at or
below the current seq is a duplicate (`StaleDeltaError`: ignore it). A snapshot applies to any
state with a lower or equal seq.

Epochs (`AdapterDelta.epoch`): seqs live in Redis (`trainers.snapshots`); a Redis that lost them
would make a restarted trainer count from 0 again, and every replica would take the new messages
for replays. So each seq lineage has an epoch, made when Redis holds no seq record of the adapter
and stored with its seqs, and covered by the signature. Within one epoch the seq rules above hold.
Across epochs (`apply_delta`): a message of an earlier epoch is `StaleEpochError` (ignored), a
*snapshot* of a later epoch resets the adapter to it whatever the seqs, and an incremental delta
of a later epoch is `EpochChangeError` (the replica re-syncs from the snapshot). An empty state
(`seq = -1`) takes the epoch of what it gets first. The legacy epoch None is the earliest.

An epoch is its start time in ms shifted left by 11 bits, plus 11 random bits (`new_epoch`), so
"later" is a number comparison that a replica can make without memory: a replica that never held
an old epoch (started after it ended) still refuses a replayed snapshot of it, which a replica
remembering "the epochs it left" could not. Two epochs of one adapter are made by its one trainer
at least a Redis loss apart, so a clock skew between trainer hosts matters only when larger than
that gap; `new_epoch(after=)` keeps a new epoch above every one the trainer still knows.

`apply_delta(state, delta, max_norm) -> new AdapterState` never mutates `state`; it checks, like
PEFT's `safe_merge`, adapter id, base version, rank, module names, shapes, dtypes, finiteness,
the declared norm and the norm bound, and raises `schemas.errors.AdapterError` (the message
names the tensor/field and the value) — the caller keeps serving the previous state. The
safetensors header (tensor count, names, dtypes, shapes, offsets) is checked before any tensor
is decoded (`check_header`).

Signatures: the trainer signs what it publishes (`make_delta(..., key=)`): `AdapterDelta.signature`
is HMAC-SHA256 over the fields that decide what a delta does (`delta_mac`). The key is shared by
trainers and replicas (`resolve_signing_key`: `settings.delta_signing_key`, or the key file
`<state_dir>/delta-signing.key` that the first process of a local stack creates); a replica with
a key applies only deltas that verify (`verify_delta`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import secrets
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, TensorSpec, serialize
from safetensors.torch import load

from schemas.errors import AdapterError
from schemas.events import MAX_DELTA_BYTES, AdapterDelta
from schemas.signing import resolve_key

if TYPE_CHECKING:
    from schemas.settings import Settings

FORMAT = "adstream-delta-v1"
_PARTS = ("dirs", "lora_A", "lora_B")
_DTYPES = {"dirs": ("I64", 8), "lora_A": ("F32", 4), "lora_B": ("F32", 4)}
MAX_MODULES = 64  # target modules of one adapter (a ranker has a handful)
MAX_HEADER_BYTES = 64 * 1024
KEY_FILE = "delta-signing.key"


def resolve_signing_key(settings: Settings, *, create: bool = True) -> bytes | None:
    """The HMAC key of deltas: `settings.delta_signing_key` when set (≥ 32 bytes), else the key
    file `<state_dir>/delta-signing.key`, created (random, mode 0600) when missing and `create`:
    every process of one stack (trainer, replicas, tests) shares the state dir and so the key.
    None only when there is no key and `create` is False (the rule: `schemas.signing.resolve_key`)."""
    return resolve_key(
        settings.delta_signing_key, settings.state_dir / KEY_FILE, "delta_signing_key", create=create
    )


def delta_mac(delta: AdapterDelta, key: bytes) -> str:
    """HMAC-SHA256 (hex) over what a delta does: adapter, base version, seq, rank, kind, norm,
    the payload's SHA-256 and the epoch (ids and timestamps change nothing a replica applies).
    The epoch is appended only when set, so legacy signatures stay valid; a list one element
    longer cannot collide with a legacy one, so an epoch can be neither added nor stripped."""
    return _mac(
        key,
        _signed_fields(
            delta.adapter_id,
            delta.base_version,
            delta.seq,
            delta.rank,
            delta.snapshot,
            delta.norm,
            delta.payload,
            delta.epoch,
        ),
    )


def _signed_fields(
    adapter_id: str,
    base_version: str,
    seq: int,
    rank: int,
    snapshot: bool,
    norm: float,
    payload: bytes,
    epoch: int | None,
) -> list[object]:
    """What `delta_mac` covers, for a delta with these fields (`make_delta` signs before it builds
    the message)."""
    fields: list[object] = [
        FORMAT,
        adapter_id,
        base_version,
        seq,
        rank,
        snapshot,
        float(norm).hex(),
        hashlib.sha256(payload).hexdigest(),
    ]
    if epoch is not None:
        fields.append(epoch)
    return fields


def _mac(key: bytes, fields: list[object]) -> str:
    return hmac.new(key, json.dumps(fields).encode(), hashlib.sha256).hexdigest()


def sign_delta(delta: AdapterDelta, key: bytes) -> AdapterDelta:
    """The same delta with its `signature`."""
    return delta.model_copy(update={"signature": delta_mac(delta, key)})


def verify_delta(delta: AdapterDelta, key: bytes) -> None:
    """AdapterError unless `delta.signature` is the HMAC of `delta` under `key`."""
    if delta.signature is None:
        raise AdapterError(f"field 'signature': delta seq {delta.seq} of {delta.adapter_id!r} is not signed")
    if not hmac.compare_digest(delta.signature, delta_mac(delta, key)):
        raise AdapterError(
            f"field 'signature': delta seq {delta.seq} of {delta.adapter_id!r} "
            "is not signed by the trainer's key"
        )


def check_header(payload: bytes, modules: Sequence[str] | None) -> None:
    """Check a payload's safetensors header before decoding a tensor: its length, at most
    3 tensors per module (of `modules` when given, else of `MAX_MODULES`), names
    `<module>.dirs/.lora_A/.lora_B`, dtypes, ranks, and offsets that match shapes and lie in
    the payload. AdapterError names the tensor and the value."""
    if len(payload) > MAX_DELTA_BYTES:
        raise AdapterError(f"payload is {len(payload)} bytes; at most {MAX_DELTA_BYTES} are allowed")
    if len(payload) < 8:
        raise AdapterError(f"payload of {len(payload)} bytes has no safetensors header")
    (n,) = struct.unpack("<Q", payload[:8])
    if not 2 <= n <= min(MAX_HEADER_BYTES, len(payload) - 8):
        raise AdapterError(
            f"payload header declares {n} bytes "
            f"(at most {MAX_HEADER_BYTES} within a {len(payload)}-byte payload)"
        )
    try:
        header = json.loads(payload[8 : 8 + n])
    except (UnicodeDecodeError, ValueError) as exc:
        raise AdapterError(f"payload header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise AdapterError("payload header is not a JSON object")
    header.pop("__metadata__", None)
    limit = 3 * (len(modules) if modules is not None else MAX_MODULES)
    if len(header) > limit:
        raise AdapterError(f"payload declares {len(header)} tensors; at most {limit} are allowed")
    known = set(modules) if modules is not None else None
    for name, info in header.items():
        _check_entry(str(name), info, known, len(payload) - 8 - n)


def _check_entry(name: str, info: object, known: set[str] | None, data_len: int) -> None:
    """One tensor of a safetensors header: name, dtype, rank, offsets within `data_len`."""
    module, _, part = name.rpartition(".")
    if part not in _PARTS or not module:
        raise AdapterError(f"payload tensor {name!r} is not one of <module>.dirs/.lora_A/.lora_B")
    if known is not None and module not in known:
        raise AdapterError(f"payload tensor {name!r}: module {module!r} is not a target ({sorted(known)})")
    if not isinstance(info, dict):
        raise AdapterError(f"payload tensor {name!r}: header entry is not an object")
    dtype, size = _DTYPES[part]
    if info.get("dtype") != dtype:
        raise AdapterError(f"payload tensor {name!r}: dtype {info.get('dtype')!r}, expected {dtype}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    dims = 1 if part == "dirs" else 2
    if (
        not isinstance(shape, list)
        or len(shape) != dims
        or not all(isinstance(d, int) and 0 <= d <= MAX_DELTA_BYTES for d in shape)
    ):
        raise AdapterError(f"payload tensor {name!r}: shape {shape!r} is not {dims}-d")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) for o in offsets)
        and 0 <= offsets[0] <= offsets[1] <= data_len
    ):
        raise AdapterError(f"payload tensor {name!r}: data_offsets {offsets!r} outside the payload")
    if math.prod(shape) * size != offsets[1] - offsets[0]:
        raise AdapterError(
            f"payload tensor {name!r}: shape {shape} needs {math.prod(shape) * size} bytes, "
            f"offsets give {offsets[1] - offsets[0]}"
        )


class SeqGapError(AdapterError):
    """A delta's seq is ahead of the next expected one: deltas were lost; re-sync from a snapshot."""


class StaleDeltaError(AdapterError):
    """A delta's seq was already applied (duplicate or replayed message): ignore it."""


class StaleEpochError(StaleDeltaError):
    """A message of an epoch earlier than the state's (an old lineage, replayed): ignore it."""


class EpochChangeError(AdapterError):
    """An incremental delta of a later epoch than the state's: the lineage was restarted; only a
    snapshot of that epoch can take the adapter into it (re-sync from the Redis snapshot)."""


EPOCH_RANDOM_BITS = 11


def new_epoch(now: datetime | None = None, after: int | None = None) -> int:
    """A fresh epoch: start time (ms since 1970) << 11 | 11 random bits; above `after` when given
    (a clock that went back must not make an epoch that replicas take for an old one). JSON-safe
    (< 2**53) until 2109."""
    ms = int((now or datetime.now(UTC)).timestamp() * 1000)
    epoch = (ms << EPOCH_RANDOM_BITS) | secrets.randbits(EPOCH_RANDOM_BITS)
    if after is not None and epoch <= after:
        epoch = after + 1
    return max(epoch, 1)


def epoch_order(epoch: int | None) -> int:
    """Sort key of epochs: the legacy epoch (None) comes first."""
    return 0 if epoch is None else epoch


def describe_epoch(epoch: int | None) -> str:
    """An epoch as people read it: its start time (UTC) and number, or `legacy`."""
    if epoch is None:
        return "legacy"
    start = datetime.fromtimestamp((epoch >> EPOCH_RANDOM_BITS) / 1000, UTC)
    return f"{epoch} (started {start.isoformat(timespec='milliseconds')})"


@dataclass(frozen=True)
class DeltaPart:
    """The new values of some rank directions of one module."""

    dirs: torch.Tensor  # int64 [k]
    lora_A: torch.Tensor  # float32 [k, in]
    lora_B: torch.Tensor  # float32 [out, k]


@dataclass(frozen=True)
class AdapterState:
    """One adapter's weights as a replica or the trainer holds them, with the last applied seq
    and the epoch (seq lineage) it belongs to (None: legacy)."""

    adapter_id: str
    base_version: str
    rank: int
    seq: int = -1
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    epoch: int | None = None

    @property
    def modules(self) -> list[str]:
        """Target module names, sorted."""
        return sorted({k.rsplit(".", 1)[0] for k in self.tensors})


def empty_state(
    adapter_id: str, base_version: str, shapes: Mapping[str, tuple[int, int]], rank: int
) -> AdapterState:
    """An all-zero state (ΔW = 0) for modules of `(in_features, out_features)`, at seq -1."""
    tensors: dict[str, torch.Tensor] = {}
    for m, (fan_in, fan_out) in shapes.items():
        tensors[f"{m}.lora_A"] = torch.zeros(rank, fan_in)
        tensors[f"{m}.lora_B"] = torch.zeros(fan_out, rank)
    return AdapterState(adapter_id, base_version, rank, -1, tensors)


def select_parts(
    tensors: Mapping[str, torch.Tensor], dirs: Mapping[str, torch.Tensor]
) -> dict[str, DeltaPart]:
    """The `DeltaPart`s holding the current values of `dirs[m]` for each module (empty ones skipped)."""
    out: dict[str, DeltaPart] = {}
    for m, idx in dirs.items():
        idx = torch.as_tensor(idx, dtype=torch.int64).flatten()
        if idx.numel() == 0:
            continue
        a, b = tensors[f"{m}.lora_A"].detach(), tensors[f"{m}.lora_B"].detach()
        # indexing with an index tensor copies: the parts never alias `tensors`
        out[m] = DeltaPart(idx.clone(), a[idx], b[:, idx])
    return out


def full_parts(tensors: Mapping[str, torch.Tensor], rank: int) -> dict[str, DeltaPart]:
    """Every direction of every module: the parts of a snapshot."""
    modules = sorted({k.rsplit(".", 1)[0] for k in tensors})
    return select_parts(tensors, {m: torch.arange(rank) for m in modules})


_TORCH_DTYPES = {
    "dirs": (torch.int64, "int64"),
    "lora_A": (torch.float32, "float32"),
    "lora_B": (torch.float32, "float32"),
}


def encode_delta(parts: Mapping[str, DeltaPart]) -> bytes:
    """Safetensors bytes of the parts (tensor names as in the module docstring).

    Straight to the library's serializer (`safetensors.serialize` over `TensorSpec`s of the
    contiguous CPU tensors): the same bytes as `safetensors.torch.save` at a fraction of its
    cost (its storage-sharing checks are for model weights, not a dozen fresh tensors; the
    numpy path pays a `ctypes` object per tensor for its data pointer)."""
    if not parts:
        raise AdapterError("a delta must change at least one rank direction (got no parts)")
    alive: list[torch.Tensor] = []  # the buffers the specs point into, held until serialized
    specs: dict[str, TensorSpec] = {}
    for m, part in parts.items():
        for name, tensor in (("dirs", part.dirs), ("lora_A", part.lora_A), ("lora_B", part.lora_B)):
            dtype, dtype_name = _TORCH_DTYPES[name]
            t = tensor.detach().to("cpu", dtype).contiguous()
            alive.append(t)
            specs[f"{m}.{name}"] = TensorSpec(
                dtype=dtype_name, shape=tuple(t.shape), data_ptr=t.data_ptr(), data_len=t.nbytes
            )
    payload: bytes = serialize(specs, metadata={"format": FORMAT})
    del alive
    return payload


def decode_delta(payload: bytes, modules: Sequence[str] | None = None) -> dict[str, DeltaPart]:
    """Parse and structurally check a payload (its header first: `check_header`, against the
    adapter's `modules` when given); raises AdapterError naming the tensor."""
    check_header(payload, modules)
    try:
        flat = load(payload)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"payload is not valid safetensors: {exc}") from exc
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in flat.items():
        module, _, part = key.rpartition(".")
        if part not in _PARTS or not module:
            raise AdapterError(f"payload tensor {key!r} is not one of <module>.dirs/.lora_A/.lora_B")
        groups.setdefault(module, {})[part] = tensor
    if not groups:
        raise AdapterError("payload holds no tensors")
    return {m: _module_part(m, g) for m, g in sorted(groups.items())}


def _module_part(m: str, g: Mapping[str, torch.Tensor]) -> DeltaPart:
    """One module's (dirs, lora_A, lora_B) of a payload, checked: dtypes, shapes, finite values,
    distinct directions; AdapterError naming the tensor otherwise."""
    missing = [p for p in _PARTS if p not in g]
    if missing:
        raise AdapterError(f"payload module {m!r} lacks tensor(s) {missing}")
    dirs, a, b = g["dirs"], g["lora_A"], g["lora_B"]
    if dirs.dtype != torch.int64 or dirs.dim() != 1:
        raise AdapterError(f"tensor '{m}.dirs' must be int64 [k] (got {dirs.dtype} {list(dirs.shape)})")
    for name, t in (("lora_A", a), ("lora_B", b)):
        if t.dtype != torch.float32 or t.dim() != 2:
            raise AdapterError(f"tensor '{m}.{name}' must be float32 2-d (got {t.dtype} {list(t.shape)})")
        if not torch.isfinite(t).all():
            raise AdapterError(f"tensor '{m}.{name}' has non-finite values; the delta seems to be broken")
    k = dirs.numel()
    if k == 0:
        raise AdapterError(f"tensor '{m}.dirs' is empty; a module in a delta must change a direction")
    if a.shape[0] != k or b.shape[1] != k:
        raise AdapterError(
            f"module {m!r}: {k} dirs but lora_A has {a.shape[0]} rows and lora_B {b.shape[1]} columns"
        )
    if torch.unique(dirs).numel() != k:
        raise AdapterError(f"tensor '{m}.dirs' has repeated directions {dirs.tolist()}")
    return DeltaPart(dirs, a, b)


def _check_parts(state: AdapterState, parts: Mapping[str, DeltaPart]) -> None:
    for m, part in parts.items():
        key_a, key_b = f"{m}.lora_A", f"{m}.lora_B"
        if key_a not in state.tensors:
            raise AdapterError(f"module {m!r} is not a target of adapter {state.adapter_id!r}")
        cur_a, cur_b = state.tensors[key_a], state.tensors[key_b]
        if int(part.dirs.min()) < 0 or int(part.dirs.max()) >= state.rank:
            raise AdapterError(f"tensor '{m}.dirs' = {part.dirs.tolist()} outside 0 … {state.rank - 1}")
        if part.lora_A.shape[1] != cur_a.shape[1] or part.lora_B.shape[0] != cur_b.shape[0]:
            raise AdapterError(
                f"module {m!r}: lora_A {list(part.lora_A.shape)} / lora_B {list(part.lora_B.shape)} "
                f"do not fit A {list(cur_a.shape)} / B {list(cur_b.shape)}"
            )


def change_norm(tensors: Mapping[str, torch.Tensor], parts: Mapping[str, DeltaPart]) -> float:
    """L2 norm of the change `parts` make to `tensors` (the `norm` of an incremental delta)."""
    if not parts:
        return 0.0
    diffs: list[torch.Tensor] = []
    for m, p in parts.items():
        diffs.append(p.lora_A - tensors[f"{m}.lora_A"][p.dirs])
        diffs.append(p.lora_B - tensors[f"{m}.lora_B"][:, p.dirs])
    # one fused pass and one host read instead of two per module
    return float(torch.stack(torch._foreach_norm(diffs)).double().norm())


def values_norm(parts: Mapping[str, DeltaPart]) -> float:
    """L2 norm of all values in `parts` (the `norm` of a snapshot)."""
    return math.sqrt(sum(float(p.lora_A.pow(2).sum() + p.lora_B.pow(2).sum()) for p in parts.values()))


def merge_parts(
    tensors: Mapping[str, torch.Tensor], parts: Mapping[str, DeltaPart]
) -> dict[str, torch.Tensor]:
    """New tensors with the listed directions replaced (inputs untouched). The tensors of modules
    without parts are shared with `tensors`, not copied: states are never written in place (each
    change goes through here, into copies), and the online trainer merges every step."""
    out = dict(tensors)
    for m, p in parts.items():
        key_a, key_b = f"{m}.lora_A", f"{m}.lora_B"
        a, b = out[key_a].clone(), out[key_b].clone()
        a[p.dirs] = p.lora_A
        b[:, p.dirs] = p.lora_B
        out[key_a], out[key_b] = a, b
    return out


def make_delta(
    state: AdapterState,
    parts: Mapping[str, DeltaPart],
    seq: int,
    *,
    snapshot: bool = False,
    event_id: str | None = None,
    now: datetime | None = None,
    key: bytes | None = None,
    norm: float | None = None,
) -> AdapterDelta:
    """The AdapterDelta message carrying `parts` (norm computed against `state`, unless the
    caller has it already: `norm`), in the state's epoch, signed with `key` when given."""
    now = now or datetime.now(UTC)
    if norm is None:
        norm = values_norm(parts) if snapshot else change_norm(state.tensors, parts)
    payload = encode_delta(parts)
    signature = (
        None
        if key is None
        else _mac(
            key,
            _signed_fields(
                state.adapter_id, state.base_version, seq, state.rank, snapshot, norm, payload, state.epoch
            ),
        )
    )
    return AdapterDelta(
        event_id=event_id or f"{state.adapter_id[:40]}:{seq}:{'s' if snapshot else 'd'}",
        ts=now,
        adapter_id=state.adapter_id,
        base_version=state.base_version,
        seq=seq,
        rank=state.rank,
        payload=payload,
        norm=norm,
        created_at=now,
        snapshot=snapshot,
        epoch=state.epoch,
        signature=signature,
    )


def _check_order(state: AdapterState, delta: AdapterDelta) -> None:
    """The epoch and seq rules of the module docstring: StaleEpochError, EpochChangeError,
    StaleDeltaError or SeqGapError when `delta` does not come next after `state`."""
    if state.seq >= 0 and delta.epoch != state.epoch:
        if epoch_order(delta.epoch) < epoch_order(state.epoch):
            raise StaleEpochError(
                f"field 'epoch': seq {delta.seq} of epoch {describe_epoch(delta.epoch)} is older than "
                f"the applied epoch {describe_epoch(state.epoch)}"
            )
        if not delta.snapshot:
            raise EpochChangeError(
                f"field 'epoch': delta seq {delta.seq} of a new epoch {describe_epoch(delta.epoch)} "
                f"(state is at seq {state.seq} of {describe_epoch(state.epoch)}); re-sync from its snapshot"
            )
    elif delta.snapshot:
        if delta.seq < state.seq:
            raise StaleDeltaError(f"field 'seq': snapshot {delta.seq} is older than applied seq {state.seq}")
    elif delta.seq <= state.seq:
        raise StaleDeltaError(f"field 'seq': {delta.seq} already applied (state is at {state.seq})")
    elif delta.seq != state.seq + 1:
        raise SeqGapError(
            f"field 'seq': expected {state.seq + 1}, got {delta.seq} (gap; re-sync from snapshot)"
        )


def apply_delta(
    state: AdapterState, delta: AdapterDelta, max_norm: float, *, norm_rtol: float = 1e-3
) -> AdapterState:
    """The state after `delta`, or AdapterError (state untouched). See the module docstring.

    `max_norm` bounds incremental deltas (`settings.online.delta_max_norm`); snapshots are checked for
    structure, finiteness and their declared norm only. Epochs: see the module docstring.
    """
    if delta.adapter_id != state.adapter_id:
        raise AdapterError(
            f"field 'adapter_id': delta is for {delta.adapter_id!r}, state is {state.adapter_id!r}"
        )
    if delta.base_version != state.base_version:
        raise AdapterError(
            f"field 'base_version': delta is for {delta.base_version!r}, replica runs {state.base_version!r}"
        )
    if delta.rank != state.rank:
        raise AdapterError(f"field 'rank': delta has rank {delta.rank}, adapter has {state.rank}")
    _check_order(state, delta)
    parts = decode_delta(delta.payload, state.modules)
    _check_parts(state, parts)
    if delta.snapshot:
        missing = [m for m in state.modules if m not in parts or parts[m].dirs.numel() != state.rank]
        if missing:
            raise AdapterError(f"snapshot lacks full directions of module(s) {missing}")
        norm = values_norm(parts)
    else:
        norm = change_norm(state.tensors, parts)
        if norm > max_norm:
            raise AdapterError(f"field 'norm': delta changes the adapter by {norm:.4g} > max_norm {max_norm}")
    if not math.isclose(norm, delta.norm, rel_tol=norm_rtol, abs_tol=1e-5):
        raise AdapterError(f"field 'norm': declared {delta.norm:.6g} but the payload gives {norm:.6g}")
    return AdapterState(
        state.adapter_id,
        state.base_version,
        state.rank,
        delta.seq,
        merge_parts(state.tensors, parts),
        delta.epoch,
    )
