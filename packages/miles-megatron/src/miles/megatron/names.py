"""Parameter names under Megatron-core's two layer specs.

Mappings name parameters as the local spec does (plain torch modules). The TransformerEngine spec
fuses the norm before a linear into it (`linear_qkv.layer_norm_weight`, and in dense layers
`linear_fc1.layer_norm_weight`; an MoE layer keeps its own pre-MLP norm, which the router reads)
and, with grouped GEMM, holds a layer's experts in one module (`experts.linear_fc1.weight{e}`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

Spec = Literal["local", "te"]

_LAYER = re.compile(r"^(decoder\.layers\.\d+\.)(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def spec_names(local: Iterable[str], spec: Spec) -> dict[str, str]:
    """Local-spec name -> the name under `spec`, for one rank's parameters (all of them: whether
    a layer is MoE is read from its router)."""
    names = list(local)
    if spec == "local":
        return {n: n for n in names}
    moe_layers = {
        m.group(1) for n in names if (m := _LAYER.match(n)) and m.group(2) == "mlp.router.weight"
    }
    return {n: _te_name(n, moe_layers) for n in names}


def _te_name(name: str, moe_layers: set[str]) -> str:
    m = _LAYER.match(name)
    if not m:
        return name
    layer, rest = m.groups()
    if rest == "input_layernorm.weight":
        return layer + "self_attention.linear_qkv.layer_norm_weight"
    if rest == "pre_mlp_layernorm.weight" and layer not in moe_layers:
        return layer + "mlp.linear_fc1.layer_norm_weight"
    if e := _EXPERT.match(rest):
        return f"{layer}mlp.experts.{e.group(2)}.weight{e.group(1)}"
    return name
