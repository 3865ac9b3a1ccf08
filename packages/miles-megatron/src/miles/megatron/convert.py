"""Hugging Face weights <-> Megatron-core shards, as pure functions over tensors.

`shard` builds one rank's parameters from a source of Hugging Face weights (a checkpoint's
safetensors files, a state dict), reading only the slices that rank holds; `gather` puts every
rank's shards back together under Hugging Face names.
Both follow a family's `MegatronMapping`, so the round trip is exact for any layout; the backend
runs the same functions on what it reads from disk and on what it gathers for weight sync.

Per parameter: its Hugging Face parts are cut for the rank first (rows for "column" and "vocab",
columns for "row"), then joined (fused QKV per query group, gate and up stacked). Megatron's
fused tensors are laid out per tensor rank, so cutting first is what makes a TP shard of
`linear_fc1` its rank's gate rows followed by its rank's up rows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from miles.core.contracts.family import MegatronMapping, MegatronWeight
from miles.megatron.layout import ParallelLayout, Rank
from miles.megatron.names import Spec, spec_names

Index = tuple[int | slice, ...]


class WeightSource(Protocol):
    """Hugging Face weights by name, readable a slice at a time."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, index: Index) -> torch.Tensor: ...


class TensorSource:
    """A state dict (or any name -> tensor mapping) as a weight source."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, index: Index) -> torch.Tensor:
        return self.tensors[name][index]


_EXPERT = "{expert}"
_OUTPUT = "output_layer.weight"
_EMBEDDING = "embedding.word_embeddings.weight"


@dataclass(frozen=True)
class _Placed:
    """One concrete parameter of one rank: its local-spec name and where its parts come from."""

    weight: MegatronWeight
    name: str  # local-spec name, local layer and expert indices
    hf: tuple[str, ...]  # Hugging Face names, global indices
    expert: int | None  # global expert index when the HF tensors stack experts on dim 0


def _stacked(weight: MegatronWeight) -> bool:
    return _EXPERT in weight.megatron and _EXPERT not in weight.hf[0]


def _placed(mapping: MegatronMapping, layout: ParallelLayout, rank: Rank) -> Iterator[_Placed]:
    num_layers = int(mapping.transformer["num_layers"])
    stage = layout.stage_layers(num_layers, rank.pp)
    last = rank.pp == layout.pp - 1
    experts = mapping.num_experts
    if experts % layout.ep:
        raise ValueError(
            f"expert parallel size {layout.ep} does not divide the model's {experts} experts"
        )
    per_rank = experts // layout.ep if experts else 0
    for w in mapping.weights:
        if "{layer}" not in w.megatron:
            on_stage = rank.pp == 0 if w.megatron.startswith("embedding.") else last
            if on_stage:
                yield _Placed(w, w.megatron, w.hf, None)
            continue
        for layer in w.layers:
            if layer not in stage:
                continue
            local = w.megatron.replace("{layer}", str(layer - stage.start))
            hf = tuple(n.replace("{layer}", str(layer)) for n in w.hf)
            if _EXPERT not in w.megatron:
                yield _Placed(w, local, hf, None)
                continue
            for j in range(per_rank):
                e = rank.ep * per_rank + j
                name = local.replace(_EXPERT, str(j))
                parts = tuple(n.replace(_EXPERT, str(e)) for n in hf)
                yield _Placed(w, name, parts, e if _stacked(w) else None)


def _tp_of(p: _Placed, layout: ParallelLayout, rank: Rank) -> tuple[int, int]:
    """(size, index) of the tensor-parallel cut this parameter gets on this rank."""
    if _EXPERT in p.weight.megatron:
        return layout.expert_tp, rank.etp
    return layout.tp, rank.tp


def _dim(split: str) -> int:
    return 1 if split == "row" else 0


@dataclass(frozen=True)
class _Part:
    """One Hugging Face tensor's contribution to a parameter: a name, the expert it is indexed
    by (stacked experts), and the rows it covers (gate or up half of a stacked gate_up)."""

    name: str
    expert: int | None
    rows: range
    shape: tuple[int, ...]  # of the part, after the expert index and the row range


def _parts(source: WeightSource, p: _Placed) -> list[_Part]:
    out = []
    for name in p.hf:
        shape = source.shape(name)
        if p.expert is not None:
            shape = shape[1:]
        halves = p.weight.join == "gate_up" and len(p.hf) == 1
        n = shape[0] // 2 if halves else shape[0]
        for start in (0, n) if halves else (0,):
            out.append(_Part(name, p.expert, range(start, start + n), (n, *shape[1:])))
    return out


def _read_cut(
    source: WeightSource, part: _Part, p: _Placed, size: int, index: int, vocab: int
) -> torch.Tensor:
    """The part's slice for tensor rank `index` of `size`, read as that slice alone."""
    split = p.weight.split
    rows, cols = part.rows, None
    if split is not None:
        dim = _dim(split)
        length = vocab if split == "vocab" else part.shape[dim]
        if length % size:
            raise ValueError(
                f"{p.name}: tensor parallel size {size} does not divide dimension {dim} "
                f"({length}) of {part.name}"
            )
        step = length // size
        if dim == 0:
            rows = range(rows.start + index * step, rows.start + (index + 1) * step)
        else:
            cols = slice(index * step, (index + 1) * step)
    # Padded vocabulary rows past the checkpoint's are zeros.
    real = range(rows.start, min(rows.stop, part.rows.stop))
    prefix: Index = () if part.expert is None else (part.expert,)
    key: Index = (*prefix, slice(real.start, max(real.start, real.stop)))
    if cols is not None:
        key = (*key, cols)
    t = source.read(part.name, key)
    if len(real) < len(rows):
        t = torch.cat([t, t.new_zeros(len(rows) - max(len(real), 0), *t.shape[1:])])
    return t


def _join(parts: list[torch.Tensor], join: str, head_dim: int) -> torch.Tensor:
    """One parameter from its (cut) parts; `head_dim` matters to "qkv" only."""
    if join == "copy":
        (only,) = parts
        return only
    if join == "gate_up":
        return torch.cat(parts, dim=0)
    q, k, v = parts
    groups = k.shape[0] // head_dim
    rest = q.shape[1:]
    fused = torch.cat([t.reshape(groups, -1, *rest) for t in (q, k, v)], dim=1)
    return fused.reshape(-1, *rest)


def _unjoin(t: torch.Tensor, join: str, head_dim: int, query_per_group: int) -> list[torch.Tensor]:
    if join == "copy":
        return [t]
    if join == "gate_up":
        return list(t.chunk(2, dim=0))
    rest = t.shape[1:]
    per_group = (query_per_group + 2) * head_dim
    g = t.reshape(t.shape[0] // per_group, per_group, *rest)
    q_rows = query_per_group * head_dim
    q, k, v = g[:, :q_rows], g[:, q_rows : q_rows + head_dim], g[:, q_rows + head_dim :]
    return [x.reshape(-1, *rest) for x in (q, k, v)]


def _heads(mapping: MegatronMapping) -> tuple[int, int]:
    """(head_dim, query heads per query group) of a grouped-query attention's fused QKV; (0, 0)
    for models without one (multi-latent attention)."""
    t = mapping.transformer
    if not any(w.join == "qkv" for w in mapping.weights):
        return 0, 0
    heads = int(t["num_attention_heads"])
    groups = int(t.get("num_query_groups") or heads)
    return int(t["kv_channels"]), heads // groups


def shard(
    source: WeightSource | Mapping[str, torch.Tensor],
    mapping: MegatronMapping,
    layout: ParallelLayout,
    rank: Rank,
    spec: Spec = "local",
) -> dict[str, torch.Tensor]:
    """One rank's parameters, under `spec`'s names, from Hugging Face weights; only the slices
    this rank holds are read."""
    if isinstance(source, Mapping):
        source = TensorSource(source)
    head_dim, _ = _heads(mapping)
    vocab = layout.padded_vocab(int(mapping.model["vocab_size"]))
    out: dict[str, torch.Tensor] = {}
    for p in _placed(mapping, layout, rank):
        size, index = _tp_of(p, layout, rank)
        whole = _parts(source, p)
        if p.weight.join == "qkv" and (groups := whole[1].shape[0] // head_dim) % size:
            raise ValueError(
                f"{p.name}: tensor parallel size {size} does not divide the model's {groups} "
                "query groups (num_key_value_heads)"
            )
        parts = [_read_cut(source, part, p, size, index, vocab) for part in whole]
        out[p.name] = _join(parts, p.weight.join, head_dim).contiguous()
    tied = bool(mapping.model.get("share_embeddings_and_output_weights"))
    if tied and layout.pp > 1 and rank.pp == layout.pp - 1:
        # Megatron keeps a copy of the tied embedding on the last stage, as its output layer.
        first = shard(
            source, _only(mapping, _EMBEDDING), layout, Rank(0, rank.tp, rank.ep, rank.etp)
        )
        out[_OUTPUT] = first[_EMBEDDING]
    renamed = spec_names(out, spec)
    return {renamed[n]: t for n, t in out.items()}


def _only(mapping: MegatronMapping, name: str) -> MegatronMapping:
    weights = tuple(w for w in mapping.weights if w.megatron == name)
    return MegatronMapping(weights, mapping.transformer, mapping.model, mapping.num_experts)


def gather(
    shards: Mapping[Rank, Mapping[str, torch.Tensor]],
    mapping: MegatronMapping,
    layout: ParallelLayout,
    spec: Spec = "local",
) -> dict[str, torch.Tensor]:
    """Every Hugging Face weight of the mapping, put together from ranks' shards (named as
    `spec` names them). Any set of ranks that covers every place of the layout will do: copies
    (data-parallel ones, dense weights on other expert ranks, experts on other tensor ranks) are
    read once."""
    head_dim, q_per_group = _heads(mapping)
    vocab = int(mapping.model["vocab_size"])
    places: dict[tuple[tuple[str, ...], int | None], _Placed] = {}
    # -> {tensor-parallel index: the Hugging Face parts of that rank's shard}
    pieces: dict[tuple[tuple[str, ...], int | None], dict[int, list[torch.Tensor]]] = defaultdict(
        dict
    )
    for rank in sorted(shards):
        placed = list(_placed(mapping, layout, rank))
        named = spec_names([p.name for p in placed], spec)
        for p in placed:
            size, index = _tp_of(p, layout, rank)
            key = (p.hf, p.expert)
            if index in pieces[key]:
                continue  # a copy
            places[key] = p
            tensor = _take(shards, rank, named[p.name])
            pieces[key][index] = _unjoin(tensor, p.weight.join, head_dim, q_per_group)
    for rank in layout.ranks():  # every place covered?
        for p in _placed(mapping, layout, rank):
            size, index = _tp_of(p, layout, rank)
            if index not in pieces.get((p.hf, p.expert), {}):
                raise KeyError(
                    f"no rank's shards hold {p.name!r} at tensor-parallel index {index} of "
                    f"{size} ({rank}): gather needs every place of the layout"
                )
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    for key, by_index in pieces.items():
        p = places[key]
        ordered = [by_index[i] for i in sorted(by_index)]
        parts = [
            _uncut([rank_parts[j] for rank_parts in ordered], p.weight.split, vocab)
            for j in range(len(ordered[0]))
        ]
        if p.weight.join == "gate_up" and len(p.hf) == 1:
            parts = [torch.cat(parts, dim=0)]
        for name, t in zip(p.hf, parts, strict=True):
            if p.expert is None:
                out[name] = t
            else:
                stacks[name][p.expert] = t
    for name, by_expert in stacks.items():
        out[name] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def _take(shards: Mapping[Rank, Mapping[str, torch.Tensor]], rank: Rank, name: str) -> torch.Tensor:
    try:
        return shards[rank][name]
    except KeyError:
        raise KeyError(f"the shards of {rank} have no {name!r}") from None


def _uncut(pieces: list[torch.Tensor], split: str | None, vocab: int) -> torch.Tensor:
    if split is None:
        return pieces[0]
    whole = torch.cat(pieces, dim=_dim(split)) if len(pieces) > 1 else pieces[0]
    return whole[:vocab] if split == "vocab" else whole


def hf_names(mapping: MegatronMapping) -> set[str]:
    """Every Hugging Face weight name the mapping reads (what a complete mapping must cover)."""
    names: set[str] = set()
    for w in mapping.weights:
        layers = w.layers if "{layer}" in w.megatron else (None,)
        experts = range(mapping.num_experts) if _EXPERT in w.hf[0] else (None,)
        for layer in layers:
            for e in experts:
                for n in w.hf:
                    n = n if layer is None else n.replace("{layer}", str(layer))
                    names.add(n if e is None else n.replace(_EXPERT, str(e)))
    return names


def local_names(mapping: MegatronMapping, layout: ParallelLayout, rank: Rank) -> list[str]:
    """The local-spec names of the parameters `rank` holds of the mapping's weights."""
    return [p.name for p in _placed(mapping, layout, rank)]


def is_expert(name: str) -> bool:
    """Whether a local-spec parameter is a routed expert's (cut by expert parallelism)."""
    return ".experts.local_experts." in name


def split_by_layer(mapping: MegatronMapping) -> list[MegatronMapping]:
    """The mapping as units of weight sync and checkpointing, in Hugging Face order: the
    embedding, then each decoder layer's dense weights, the final norm and head, and last each
    layer's routed experts (gathered over other groups of ranks than the rest)."""
    num_layers = int(mapping.transformer["num_layers"])

    def unit(weights: list[MegatronWeight]) -> MegatronMapping:
        return MegatronMapping(
            tuple(weights), mapping.transformer, mapping.model, mapping.num_experts
        )

    flat = [w for w in mapping.weights if "{layer}" not in w.megatron]
    first = [w for w in flat if w.megatron.startswith("embedding.")]
    last = [w for w in flat if not w.megatron.startswith("embedding.")]
    dense, experts = [], []
    for layer in range(num_layers):
        here = [replace(w, layers=(layer,)) for w in mapping.weights if layer in w.layers]
        dense.append([w for w in here if _EXPERT not in w.megatron])
        experts.append([w for w in here if _EXPERT in w.megatron])
    groups = [first, *dense, last, *experts]
    return [unit(g) for g in groups if g]
