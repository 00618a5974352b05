"""PEFT LoRA adapters on the ranker: one frozen base, many named adapters, mixed in one batch.

An `AdapterBank` owns a private copy of a `Ranker` wrapped by PEFT (`get_peft_model` with a
`LoraConfig` whose `target_modules` are the `nn.Linear` layers under `settings.lora.targets`,
e.g. `cross.0`, `cross.1`, `deep.0`, `deep.2`). Base weights never get gradients.

Targets may also name id tables (`nn.Embedding`: `emb.category`, `wide.category`, …), adapted
the PEFT way: A [r, num_embeddings] (init zeros), B [dim, r] (init normal), the lookup of id i
gains `(alpha / r) · B @ A[:, i]`. A shift shared by everyone (a category trend) is one column
of such a table; through the cross/deep layers it needs many steps. A published rank
direction of a table carries a whole row of A (`num_embeddings` floats), so small tables suit
(`wide.category`: 256; `wide.ad` would be 64 KiB per direction). Serving applies both
(`serving.adapters`: small tables and the head from their ΔW); `bank.embedding_modules` lists
the embedding targets.

- `bank.ensure(adapter_id)` adds an adapter (A: PEFT's Kaiming init seeded by the adapter id,
  B: zeros — embeddings the other way round — so a new adapter starts equal to the base model).
- `bank.logits(batch, adapter_ids)` scores a **mixed** batch: row i uses adapter
  `adapter_ids[i]` (None = base model), through PEFT's per-sample `adapter_names=`.
- `bank.train_logits(batch, adapter_id)` is the differentiable forward with only that adapter
  active (PEFT forbids mixed batches in training mode; the trainer groups a micro-batch by
  adapter).
- `bank.get_state(id)` / `bank.set_state(id, tensors)` move an adapter's weights as a plain
  dict `{"<module>.lora_A": [r, in], "<module>.lora_B": [out, r]}` (float32) — the layout
  `schemas.delta` encodes; the effective weight of a module is `W + (alpha / r) · B @ A`
  (for an embedding, in = num_embeddings, out = dim and the table is `W + (alpha / r) · (B @ A)ᵀ`).

Adapter ids are `schemas.ids.adapter_id_for` (what streams writes into TrainingExamples):
`<slot>`, `adv:<advertiser_id>` or `<slot>/adv:<advertiser_id>` for `settings.adapter_scheme`
slot / advertiser / slot+advertiser.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.nn import functional as F

from schemas.errors import AdapterError, ConfigError
from schemas.settings import LoraSettings
from trainers.models.features import ID_COLUMNS, RankerBatch
from trainers.models.ranker import Ranker, additive_in_logit

BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" in a mixed batch
_PLACEHOLDER = "placeholder"  # PEFT needs one adapter at construction; it stays at B = 0
M = TypeVar("M", bound=nn.Module)


def target_modules(model: nn.Module, targets: Sequence[str]) -> list[str]:
    """Full names of the `nn.Linear` and `nn.Embedding` layers at or under each target prefix
    (e.g. `cross.0`, `emb.category`)."""
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear | nn.Embedding)
        and any(name == t or name.startswith(t + ".") for t in targets)
    ]
    if not names:
        raise ConfigError(f"lora.targets {tuple(targets)!r} match no Linear or Embedding layer of the model")
    return names


def target_shapes(model: nn.Module, targets: Sequence[str]) -> dict[str, tuple[int, int]]:
    """`{module: (in, out)}` of every LoRA target of `model` (what `empty_state` needs)."""
    return {m: module_shape(model.get_submodule(m)) for m in target_modules(model, targets)}


def module_shape(module: nn.Module) -> tuple[int, int]:
    """(in, out) of a target: (in_features, out_features) or (num_embeddings, embedding_dim).

    >>> module_shape(nn.Embedding(256, 1)), module_shape(nn.Linear(3, 5))
    ((256, 1), (3, 5))
    """
    if isinstance(module, nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    assert isinstance(module, nn.Linear)
    return module.in_features, module.out_features


def _peft_name(adapter_id: str) -> str:
    # PEFT adapter names become ModuleDict keys, which may not contain "."; ids may.
    return "a" + hashlib.blake2b(adapter_id.encode(), digest_size=8).hexdigest()


def _seed_of(adapter_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(adapter_id.encode(), digest_size=8).digest(), "little") >> 1


class AdapterBank:
    """A frozen base ranker plus named PEFT LoRA adapters (see the module docstring)."""

    def __init__(self, base: Ranker, spec: LoraSettings, base_version: str) -> None:
        self.spec = spec
        self.base_version = base_version
        self.config = base.config
        model = copy.deepcopy(base)
        self.modules = target_modules(model, spec.targets)
        self._lora_config = LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,  # type: ignore[arg-type]  # PEFT takes floats; its hint says int
            target_modules=self.modules,
            lora_dropout=0.0,
            bias="none",
        )
        # a private frozen copy scores the base: cheaper than toggling PEFT's adapters off per call
        self._base = copy.deepcopy(base).eval()
        for p in self._base.parameters():
            p.requires_grad_(False)
        self.model: Any = get_peft_model(model, self._lora_config, adapter_name=_PLACEHOLDER)
        self._layers: dict[str, Any] = {m: self.model.get_base_model().get_submodule(m) for m in self.modules}
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.model.eval()
        self._ids: dict[str, str] = {}
        # PEFT name → [(module, A, B)]: the live parameters, found once per adapter (each lookup
        # walks nn.Module attribute chains; the trainer reads them several times a step)
        self._pairs: dict[str, list[tuple[str, nn.Parameter, nn.Parameter]]] = {}
        self.a_init: dict[str, torch.Tensor] = {}  # module → lora_A of new adapters (init_from_inputs)
        self._training: str | None = None  # the adapter set up by the last train_logits
        kinds = dict(base.named_modules())
        self.shapes: dict[str, tuple[int, int]] = {m: module_shape(kinds[m]) for m in self.modules}
        self.embedding_modules: list[str] = [m for m in self.modules if isinstance(kinds[m], nn.Embedding)]
        # when every target only adds to the logit (the head, the wide tables), training runs
        # the frozen trunk once and adds each target's LoRA term itself (`_additive_logits`):
        # the adapted and the base logit from one pass, without PEFT's wrappers
        self.base_from_lora_forward = all(additive_in_logit(m) for m in self.modules)
        self._inner: Ranker = model  # PEFT wraps its target layers in place
        self._wide_columns: dict[str, int] = {f"wide.{c}": i for i, c in enumerate(ID_COLUMNS)}
        # the frozen layers the base logit adds up (a target's own layer under its LoRA wrapper),
        # found once: PEFT wrapped them above and adapters come and go inside the wrappers
        self._base_head: nn.Module = getattr(model.head, "base_layer", model.head)
        self._base_wide: list[tuple[int, nn.Module]] = [
            (i, getattr(model.wide[c], "base_layer", model.wide[c]))
            for i, c in enumerate(ID_COLUMNS)
            if c in model.wide
        ]

    @property
    def adapters(self) -> list[str]:
        """Ids of the adapters in the bank, in insertion order."""
        return list(self._ids)

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self._ids

    def ensure(self, adapter_id: str) -> None:
        """Add `adapter_id` if missing (deterministic init from its id; equal to the base)."""
        if adapter_id in self._ids:
            return
        name = _peft_name(adapter_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_seed_of(adapter_id))
            self.model.add_adapter(name, self._lora_config)
        self._ids[adapter_id] = name
        self._fix_embedding_norms(name)
        if self.a_init:
            with torch.no_grad():
                for module, a in self.a_init.items():
                    self._pair(module, name)[0].copy_(a)
        for p in self._params(name):
            p.requires_grad_(False)
        self._training = None

    def _fix_embedding_norms(self, name: str) -> None:
        """Each embedding target's B (PEFT: normal, A zeros) scaled to the Frobenius norm
        sqrt(out · r), its expected one; the direction stays the seeded random one.

        Why: while A is zero, SGD's step on a table row is `embedding_lr · scaling² · B Bᵀ` times
        the row's gradient, so with PEFT's draw a one-column table (`wide.*`) learned at a rate
        set by its |B|², a chi-square of r degrees of freedom: with the default ids and r = 8 the
        `feed` adapter's category biases moved 2.6 times as fast as `search`'s (|B|² 12.8 against
        4.9) for nothing but the draw. Fixed, every adapter's tables start at the same rate."""
        with torch.no_grad():
            for module in self.embedding_modules:
                b = self._pair(module, name)[1]
                norm = float(torch.linalg.vector_norm(b))
                if norm > 0:
                    b.mul_(math.sqrt(b.numel()) / norm)

    def init_from_inputs(self, batch: RankerBatch) -> dict[str, torch.Tensor]:
        """Start every new adapter's `lora_A` of each Linear target from the principal directions
        of that layer's input under the base model (the top-`r` eigenvectors of the input
        covariance over `batch`, scaled to the norm of PEFT's default rows), B = 0 as before:
        the first steps of B then move the output along the directions the inputs vary most in,
        instead of along random ones. Embedding targets keep PEFT's init. Returns the rows.

        Applies to adapters added from now on (and to resets); compared with PEFT's random init
        in `benchmarks/cold_start.py` (`adapter_init`)."""
        linear = [m for m in self.modules if m not in self.embedding_modules]
        inputs: dict[str, torch.Tensor] = {}
        hooks = [
            self._base.get_submodule(m).register_forward_hook(
                lambda _mod, args, _out, m=m: inputs.__setitem__(m, args[0].detach())
            )
            for m in linear
        ]
        try:
            self.base_logits(batch)
        finally:
            for h in hooks:
                h.remove()
        rank = self.spec.rank
        rows: dict[str, torch.Tensor] = {}
        for m, x in inputs.items():
            x = x.double() - x.double().mean(0)
            _vals, vecs = torch.linalg.eigh(x.T @ x / max(1, len(x) - 1))  # ascending
            top = vecs[:, -rank:].flip(1).T  # [r, in], unit rows, largest variance first
            if top.shape[0] < rank:  # fewer inputs than the rank: pad with zero rows
                top = torch.cat([top, torch.zeros(rank - top.shape[0], top.shape[1], dtype=top.dtype)])
            rows[m] = (top / math.sqrt(3)).float()  # PEFT's kaiming_uniform(a=√5) row norm ≈ 1/√3
        self.a_init = rows
        return rows

    def remove(self, adapter_id: str) -> None:
        """Delete an adapter (its PEFT layers and tensors)."""
        self._require(adapter_id)
        name = self._ids.pop(adapter_id)
        self._pairs.pop(name, None)
        self.model.base_model.set_adapter(_PLACEHOLDER)
        self._training = None
        self.model.delete_adapter(name)

    def reset(self, adapter_id: str) -> None:
        """Put an adapter back to its initial state (B = 0: scores equal the base model's)."""
        self._require(adapter_id)
        name = self._ids.pop(adapter_id)
        self._pairs.pop(name, None)
        self.model.base_model.set_adapter(_PLACEHOLDER)
        self._training = None
        self.model.delete_adapter(name)
        self.ensure(adapter_id)

    def _require(self, adapter_id: str) -> str:
        try:
            return self._ids[adapter_id]
        except KeyError:
            raise AdapterError(f"adapter {adapter_id!r} is not in the bank") from None

    def _params(self, name: str) -> list[nn.Parameter]:
        # Linear: `….lora_A.<name>.weight`; Embedding: `….lora_embedding_A.<name>`
        return [p for n, p in self.model.named_parameters() if f".{name}." in n or n.endswith(f".{name}")]

    def parameters_of(self, adapter_id: str) -> list[nn.Parameter]:
        """The trainable tensors (every lora_A and lora_B) of one adapter."""
        return self._params(self._require(adapter_id))

    def lora_params(self, adapter_id: str) -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
        """`{module: (A [r, in], B [out, r])}`: the live parameters of one adapter."""
        return {module: (a, b) for module, a, b in self._pairs_of(self._require(adapter_id))}

    def _pairs_of(self, name: str) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
        pairs = self._pairs.get(name)
        if pairs is None:
            pairs = self._pairs[name] = [(m, *self._pair(m, name)) for m in self.modules]
        return pairs

    def _pair(self, module: str, name: str) -> tuple[nn.Parameter, nn.Parameter]:
        layer = self._layers[module]
        if module in self.embedding_modules:
            return layer.lora_embedding_A[name], layer.lora_embedding_B[name]
        return layer.lora_A[name].weight, layer.lora_B[name].weight

    def get_state(self, adapter_id: str) -> dict[str, torch.Tensor]:
        """A detached copy of the adapter's weights as `{<module>.lora_A, <module>.lora_B}`."""
        out: dict[str, torch.Tensor] = {}
        for module, a, b in self._pairs_of(self._require(adapter_id)):
            out[f"{module}.lora_A"] = a.detach().clone()
            out[f"{module}.lora_B"] = b.detach().clone()
        return out

    def state_views(self, adapter_id: str) -> dict[str, torch.Tensor]:
        """`get_state` without the copies: the live weights, detached (they change with the next
        optimiser step or `set_state`; read them, keep a copy)."""
        out: dict[str, torch.Tensor] = {}
        for module, a, b in self._pairs_of(self._require(adapter_id)):
            out[f"{module}.lora_A"] = a.detach()
            out[f"{module}.lora_B"] = b.detach()
        return out

    def set_state(self, adapter_id: str, tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite an adapter's weights (adding it first if needed); shapes must match."""
        self.ensure(adapter_id)
        name = self._ids[adapter_id]
        with torch.no_grad():
            for module in self.modules:
                for part, dest in zip(("lora_A", "lora_B"), self._pair(module, name), strict=True):
                    key = f"{module}.{part}"
                    if key not in tensors:
                        raise AdapterError(f"adapter state for {adapter_id!r} lacks tensor {key!r}")
                    got, want = tuple(tensors[key].shape), tuple(dest.shape)
                    if got != want:
                        raise AdapterError(f"tensor {key!r} has shape {got}, expected {want}")
                    dest.copy_(tensors[key])

    def logits(self, batch: RankerBatch, adapter_ids: Sequence[str | None]) -> torch.Tensor:
        """Logits [B] of a mixed batch: row i through adapter `adapter_ids[i]` (None = base)."""
        if len(adapter_ids) != len(batch):
            raise AdapterError(f"adapter_ids has {len(adapter_ids)} entries for a batch of {len(batch)}")
        names = [BASE_ADAPTER if a is None or a not in self._ids else self._ids[a] for a in adapter_ids]
        self.model.eval()
        with torch.no_grad():
            if all(n == BASE_ADAPTER for n in names):
                return self.base_logits(batch)
            out: torch.Tensor = self.model(batch.dense, batch.ids, adapter_names=names)
            return out

    def base_logits(self, batch: RankerBatch) -> torch.Tensor:
        """Logits of the frozen base model (every adapter disabled)."""
        with torch.no_grad():
            out: torch.Tensor = self._base(batch.dense, batch.ids)
            return out

    def train_logits(self, batch: RankerBatch, adapter_id: str) -> torch.Tensor:
        """Differentiable logits with only `adapter_id` active; gradients reach only its LoRA tensors."""
        name = self._train(adapter_id)
        if self.base_from_lora_forward:
            return self._additive_logits(batch, name)[0]
        out: torch.Tensor = self.model(batch.dense, batch.ids)
        return out

    def train_logits_and_base(self, batch: RankerBatch, adapter_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """`train_logits(batch, adapter_id)` and the frozen base's logits of the same batch.

        When every target is additive in the logit (`ranker.additive_in_logit`: the head and the
        wide tables, the default targets) both come from one pass (`_additive_logits`; the base
        equal to `base_logits` up to float rounding); otherwise the base runs its own forward."""
        if not self.base_from_lora_forward:
            return self.train_logits(batch, adapter_id), self.base_logits(batch)
        return self._additive_logits(batch, self._train(adapter_id))

    def _train(self, adapter_id: str) -> str:
        """The PEFT name of `adapter_id`, made the one adapter with gradients (once per switch)."""
        name = self._require(adapter_id)
        if self._training != name:
            self.model.base_model.set_adapter(name)
            for p in self.model.parameters():
                p.requires_grad_(False)
            for p in self._params(name):
                p.requires_grad_(True)
            self._training = name
        return name

    def _additive_logits(self, batch: RankerBatch, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(adapted logits, base logits) when every target adds to the logit: the frozen trunk
        once (`Ranker.head_input`), the base head and wide biases, then each target's LoRA term
        as PEFT computes it — `scaling · B(A(x))` for the head, `scaling · B·A[:, id]` for a
        wide table (`lora_dropout` is 0) — on the adapter's own parameters, so gradients reach
        them as through PEFT's forward (`tests/unit/trainers/test_trainers_lora.py` compares the
        two). Through PEFT's wrappers the training forward cost half as much again (830 against
        560 µs at 256 rows)."""
        ids = batch.ids
        h = self._inner.head_input(batch.dense, ids)
        base = self._base_head(h)  # [n, 1] until the end
        for column, table in self._base_wide:
            base = base + table(ids[:, column])
        # the terms summed per scaling before it is applied (one LoraConfig: one scaling), so
        # the graph has one multiply and one add for all of them (~8 % of forward + backward)
        terms: dict[float, torch.Tensor] = {}
        for module, a, b in self._pairs_of(name):
            if module == "head":
                term = F.linear(F.linear(h, a), b)
            else:
                term = F.embedding(ids[:, self._wide_columns[module]], a.T) @ b.T
            scale = self._layers[module].scaling[name]
            terms[scale] = term if scale not in terms else terms[scale] + term
        base = base.squeeze(1)
        logits = base
        for scale, term in terms.items():
            logits = logits + term.squeeze(1) * scale
        return logits, base.detach()


def fold_lora(base: M, tensors: Mapping[str, torch.Tensor], scale: float) -> M:
    """A copy of `base` with one adapter's ΔW folded into its weights: every adapted module's
    weight becomes `W + scale · B @ A` (an id table: `W + scale · (B @ A)ᵀ`), so the copy's plain
    forward equals base + adapter (serving's banked path, PEFT's forward) to float rounding and
    costs what the base model costs. Pure: `base` and `tensors` are left untouched.

    - `base`: the plain ranker (its `nn.Linear` / `nn.Embedding` targets, as before
      `serving.banked.install` wraps them); the copy keeps its device, dtypes and train/eval mode;
    - `tensors`: the adapter in the `schemas.delta` layout, `{"<module>.lora_A": [r, in],
      "<module>.lora_B": [out, r]}` (`AdapterState.tensors`, `AdapterBank.get_state`); modules
      not named keep the base weights;
    - `scale`: `alpha / r` (`settings.lora.scaling`, `AdapterStack.scale`).

    The sum is formed in float64 and rounded once to the weight's dtype. AdapterError naming the
    tensor for an unpaired factor, a module `base` lacks or that is not Linear/Embedding, shapes
    that do not fit, or non-finite values; nothing is copied then.
    """
    deltas: dict[str, torch.Tensor] = {}
    for module in sorted({k.rsplit(".", 1)[0] for k in tensors}):
        deltas[module] = _fold_delta(base, module, tensors, scale)
    folded = copy.deepcopy(base)
    with torch.no_grad():
        for module, delta in deltas.items():
            layer = folded.get_submodule(module)
            assert isinstance(layer, nn.Linear | nn.Embedding)  # checked on `base` above
            weight = layer.weight
            weight.copy_((weight.double() + delta.to(weight.device)).to(weight.dtype))
    return folded


def _fold_delta(
    base: nn.Module, module: str, tensors: Mapping[str, torch.Tensor], scale: float
) -> torch.Tensor:
    """`scale · B @ A` of one module in the layout of its weight (float64, CPU), checked."""
    key_a, key_b = f"{module}.lora_A", f"{module}.lora_B"
    missing = [k for k in (key_a, key_b) if k not in tensors]
    if missing:
        raise AdapterError(f"adapter tensors name module {module!r} but lack {missing}")
    try:
        layer = base.get_submodule(module)
    except AttributeError:
        raise AdapterError(f"tensor {key_a!r}: the model has no module {module!r}") from None
    if not isinstance(layer, nn.Linear | nn.Embedding):
        raise AdapterError(
            f"tensor {key_a!r}: module {module!r} is {type(layer).__name__}, not Linear or Embedding "
            "(fold into the plain ranker, before serving wraps its layers)"
        )
    fan_in, fan_out = module_shape(layer)
    a, b = tensors[key_a].detach(), tensors[key_b].detach()
    fits = a.dim() == 2 and b.dim() == 2 and a.shape[0] == b.shape[1]
    if not fits or a.shape[1] != fan_in or b.shape[0] != fan_out:
        raise AdapterError(
            f"module {module!r}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit "
            f"A [r, {fan_in}] / B [{fan_out}, r]"
        )
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise AdapterError(f"module {module!r}: non-finite values in lora_A or lora_B")
    delta = float(scale) * (b.cpu().double() @ a.cpu().double())  # [out, in]
    return delta.T if isinstance(layer, nn.Embedding) else delta
