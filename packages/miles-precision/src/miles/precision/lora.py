"""LoRA in plain torch: low-rank adapters on chosen linears, and the two ways to sync them.

Training wraps each target linear in `LoRALinear` (frozen base + trainable `lora_B @ lora_A`).
Rollout engines get either:
- `merged`: the full model under its original names with `B @ A` folded into each weight, so an
  engine without LoRA support loads it as a plain HF checkpoint (`merged_named_weights`);
- `adapters`: only the small `lora_A`/`lora_B` tensors, which the engine folds into its own copy of
  the base weights (`AdapterApplier`).

The base may be any module with a 2-D `.weight` [out, in] that maps x -> base(x): a plain
`nn.Linear`, or a quantised training linear (fake-quant INT4 and the like: QLoRA-style). The
config is the run's `lora` section (`miles.core.config.LoRAConfig`); every merge, on the trainer
and on an engine, goes through `merged_weight`, so both sides compute the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import Tensor, nn

from miles.core.config import LoRAConfig

_A_SUFFIX = ".lora_A.weight"
_B_SUFFIX = ".lora_B.weight"


class LoRALinear(nn.Module):
    """base(x) + scaling * lora_B(lora_A(dropout(x))), with the base frozen."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        weight = _weight_2d(base)
        if weight is None or not weight.is_floating_point():
            raise TypeError(f"LoRA needs a base with a 2-D float .weight parameter, got {base}")
        out_features, in_features = weight.shape
        # Adapters live next to the base weight, in its dtype. (A quantised base keeps a float
        # master weight and quantises in forward, so this is still a float dtype.)
        dtype = weight.dtype
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Linear(in_features, rank, bias=False, device=weight.device, dtype=dtype)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device=weight.device, dtype=dtype)
        # As in the LoRA paper / peft: A random (nn.Linear's Kaiming-uniform), B zero, so the
        # wrapped model starts out exactly equal to the base model.
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.rank = rank
        self.scaling = alpha / rank

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.base(x)
        x_lora = self.dropout(x.to(self.lora_A.weight.dtype))
        delta: Tensor = self.scaling * self.lora_B(self.lora_A(x_lora))
        return out + delta.to(out.dtype)

    @torch.no_grad()
    def merged_weight(self) -> Tensor:
        """base.weight + scaling * B @ A (see `merged_weight`)."""
        weight = _weight_2d(self.base)
        assert weight is not None  # checked when the adapter was made
        return merged_weight(weight, self.lora_A.weight, self.lora_B.weight, self.scaling)


def merged_weight(weight: Tensor, a: Tensor, b: Tensor, scaling: float) -> Tensor:
    """weight + scaling * B @ A, summed in fp32 on the weight's device and cast back to the
    weight's dtype: the one LoRA merge, for training checkpoints, syncs and engines alike."""
    delta = scaling * (b.to(weight.device).float() @ a.to(weight.device).float())
    return (weight.float() + delta).to(weight.dtype)


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Wrap every target linear in `LoRALinear` and freeze everything but the adapters.

    All targets are checked before anything is replaced, so a bad config leaves the model intact.
    Returns the qualified names of the wrapped modules.
    """
    if lora_modules(model):
        raise ValueError(f"{type(model).__name__} already has LoRA adapters")
    candidates = {name: m for name, m in model.named_modules() if _is_linear_like(m)}
    chosen = [name for name in candidates if name.rsplit(".", 1)[-1] in cfg.targets]
    hit = {name.rsplit(".", 1)[-1] for name in chosen}
    unknown = [t for t in cfg.targets if t not in hit]
    if unknown:
        available = sorted({name.rsplit(".", 1)[-1] for name in candidates})
        verb = "matches" if len(unknown) == 1 else "match"
        raise ValueError(
            f"lora.targets: {', '.join(map(repr, unknown))} {verb} no module of "
            f"{type(model).__name__}; available: {', '.join(available)}"
        )
    _check_not_tied(model, {name: candidates[name] for name in chosen})

    model.requires_grad_(False)
    for name in chosen:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child_name, LoRALinear(candidates[name], cfg.rank, cfg.alpha, cfg.dropout))
    return chosen


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


@torch.no_grad()
def merged_named_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The model's state dict under its original (pre-LoRA) names, adapters folded in."""
    loras = lora_modules(model)
    scaling = next(iter(loras.values())).scaling if loras else 1.0
    yield from merge_named(model.state_dict().items(), scaling)


def merge_named(
    named: Iterable[tuple[str, Tensor]], scaling: float
) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) pairs of a LoRA model (e.g. full tensors gathered from shards) under the
    base model's names: `n.base.weight` + scaling * `n.lora_B.weight` @ `n.lora_A.weight`
    becomes `n.weight`, the base's other tensors `n.<name>`; everything else passes through.
    A module's base and adapters come one after another (registration order), so at most one
    weight waits at a time."""
    base: dict[str, Tensor] = {}
    a: dict[str, Tensor] = {}
    for name, tensor in named:
        if ".base." in name:
            module, _, leaf = name.partition(".base.")
            if leaf == "weight":
                base[module] = tensor
            else:
                yield f"{module}.{leaf}", tensor
        elif name.endswith(_A_SUFFIX):
            a[name.removesuffix(_A_SUFFIX)] = tensor
        elif name.endswith(_B_SUFFIX):
            module = name.removesuffix(_B_SUFFIX)
            yield (
                f"{module}.weight",
                merged_weight(base.pop(module), a.pop(module), tensor, scaling),
            )
        else:
            yield name, tensor
    if base or a:
        raise RuntimeError(f"LoRA merge: modules without their adapters: {sorted(base | a)}")


def fold_adapters(
    named_base: Iterable[tuple[str, Tensor]], adapters: Mapping[str, Tensor], scaling: float
) -> Iterator[tuple[str, Tensor]]:
    """A plain model's (name, tensor) pairs with `adapters` (`n.lora_A.weight`,
    `n.lora_B.weight`) merged into each adapted `n.weight`: what an engine holds after
    `AdapterApplier.apply` on that base."""
    for name, tensor in named_base:
        module = name.removesuffix(".weight")
        a, b = adapters.get(f"{module}{_A_SUFFIX}"), adapters.get(f"{module}{_B_SUFFIX}")
        yield name, tensor if a is None or b is None else merged_weight(tensor, a, b, scaling)


def adapter_named_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Only the adapters, as `{n}.lora_A.weight` and `{n}.lora_B.weight` (live, detached views)."""
    for name, m in lora_modules(model).items():
        yield f"{name}{_A_SUFFIX}", m.lora_A.weight.detach()
        yield f"{name}{_B_SUFFIX}", m.lora_B.weight.detach()


class AdapterApplier:
    """Engine side of `sync: adapters`: sets weight = base + scaling * B @ A on a plain model.

    Engines receive a fresh adapter every sync, so folding each one into the current weight would
    accumulate all past adapters. Instead the first `apply` that touches a module keeps a copy of
    its base weight, and every `apply` recomputes the weight from that copy. (Subtracting the
    previous delta instead would save the copy but drift with rounding in bf16.)

    Memory cost: one extra copy of each targeted base weight, on its device and in its dtype
    (for q/k/v/o of a dense model: roughly the attention share of the weights).
    """

    def __init__(self, model: nn.Module, scaling: float) -> None:
        self.model = model
        self.scaling = scaling
        self._base: dict[str, Tensor] = {}

    @torch.no_grad()
    def apply(self, adapters: Iterable[tuple[str, Tensor]]) -> list[str]:
        """Make the model equal base + these adapters exactly; returns the module names set.

        Modules adapted by an earlier call but absent from `adapters` go back to their base.
        """
        pairs = _pair_adapters(adapters)
        for name, (a, b) in pairs.items():
            weight = self._weight(name)
            if (b.shape[0], a.shape[1]) != tuple(weight.shape) or a.shape[0] != b.shape[1]:
                raise ValueError(
                    f"adapter {name}: B {tuple(b.shape)} @ A {tuple(a.shape)} does not fit "
                    f"weight {tuple(weight.shape)}"
                )
        for name in self._base.keys() - pairs.keys():
            self._weight(name).copy_(self._base[name])
        for name, (a, b) in pairs.items():
            weight = self._weight(name)
            if name not in self._base:
                self._base[name] = weight.detach().clone()
            weight.copy_(merged_weight(self._base[name], a, b, self.scaling))
        return list(pairs)

    @torch.no_grad()
    def reset(self) -> None:
        """Restore every base weight and drop the copies."""
        for name, base in self._base.items():
            self._weight(name).copy_(base)
        self._base.clear()

    def _weight(self, name: str) -> Tensor:
        try:
            module = self.model.get_submodule(name)
        except AttributeError as e:
            raise ValueError(f"adapter {name}: no such module in the rollout model") from e
        weight = _weight_2d(module)
        if weight is None:
            raise ValueError(f"adapter {name}: module has no 2-D weight")
        return weight


def adapter_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """A snapshot (cloned) of the adapters, for a safetensors checkpoint."""
    return {name: t.clone() for name, t in adapter_named_weights(model)}


@torch.no_grad()
def load_adapter_state_dict(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Load adapters saved by `adapter_state_dict`; names and shapes must match exactly."""
    own = dict(adapter_named_weights(model))
    missing = sorted(own.keys() - state.keys())
    unexpected = sorted(state.keys() - own.keys())
    mismatched = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in sorted(own.keys() & state.keys())
        if state[k].shape != own[k].shape
    ]
    if missing or unexpected or mismatched:
        problems = [f"missing: {', '.join(missing)}"] if missing else []
        problems += [f"unexpected: {', '.join(unexpected)}"] if unexpected else []
        problems += [f"shape mismatch: {'; '.join(mismatched)}"] if mismatched else []
        raise ValueError("adapter state does not match the model: " + " | ".join(problems))
    for k, t in own.items():
        t.copy_(state[k])


def _weight_2d(module: nn.Module) -> Tensor | None:
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, nn.Parameter) and weight.dim() == 2 else None


def _is_linear_like(module: nn.Module) -> bool:
    # An embedding has a 2-D weight too, but takes token ids, not activations.
    return _weight_2d(module) is not None and not isinstance(module, nn.Embedding | LoRALinear)


def _check_not_tied(model: nn.Module, targets: dict[str, nn.Module]) -> None:
    # A tied weight (lm_head <-> embed_tokens) would be merged under one name only, and the
    # rollout model would silently re-tie it to the unmerged copy.
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    for name, m in targets.items():
        shared = owners.get(id(m.weight), [])
        if len(shared) > 1:
            raise ValueError(f"lora target {name} has a tied weight ({', '.join(shared)})")


def _split_lora_key(key: str, loras: dict[str, LoRALinear]) -> tuple[str | None, str]:
    """'a.b.q_proj.base.weight' -> ('a.b.q_proj', 'base.weight') when a.b.q_proj is LoRA."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        owner = ".".join(parts[:i])
        if owner in loras:
            return owner, ".".join(parts[i:])
    return None, key


def _pair_adapters(adapters: Iterable[tuple[str, Tensor]]) -> dict[str, tuple[Tensor, Tensor]]:
    a_of: dict[str, Tensor] = {}
    b_of: dict[str, Tensor] = {}
    for key, t in adapters:
        if key.endswith(_A_SUFFIX):
            a_of[key.removesuffix(_A_SUFFIX)] = t
        elif key.endswith(_B_SUFFIX):
            b_of[key.removesuffix(_B_SUFFIX)] = t
        else:
            raise ValueError(f"not an adapter tensor: {key}")
    unpaired = sorted(a_of.keys() ^ b_of.keys())
    if unpaired:
        raise ValueError(f"adapters without both lora_A and lora_B: {', '.join(unpaired)}")
    return {name: (a_of[name], b_of[name]) for name in a_of}
