"""A Megatron-core GPTModel built from a family's mapping, on the local (torch-only) layer spec
with Miles' core attention (packed sequences, FlashAttention on CUDA).

Megatron's parallel state must be initialised first (`parallel_state.initialize_model_parallel`,
and on CUDA its RNG streams, `tensor_parallel.model_parallel_cuda_manual_seed`); the model is this
rank's part of it. TransformerEngine's fusions stay off: they need TE or apex,
which the local spec does without.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from miles.core.contracts.family import MegatronMapping
from miles.megatron.attention import PackedCoreAttention
from miles.megatron.layout import ParallelLayout
from miles.megatron.rope import use_packed_rope

# Fused kernels that need TransformerEngine or apex; off on the local spec.
_NO_TE = {
    "bias_activation_fusion": False,
    "masked_softmax_fusion": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "persist_layer_norm": False,
    "moe_grouped_gemm": False,
}


class UnsupportedModel(ValueError):
    """The checkpoint asks for something this GPTModel cannot express."""


def transformer_config(
    mapping: MegatronMapping,
    layout: ParallelLayout,
    dtype: torch.dtype = torch.bfloat16,
    *,
    token_dispatcher: str = "alltoall",
    **overrides: Any,
) -> TransformerConfig:
    """The TransformerConfig of the mapping's model at this layout."""
    if mapping.unsupported:
        raise UnsupportedModel(
            "the megatron backend cannot build this model: "
            + "; ".join(mapping.unsupported)
            + " (train it with train.backend: fsdp)"
        )
    fields = dict(mapping.transformer)
    activation = fields.pop("activation", "gelu")
    moe = {"moe_token_dispatcher_type": token_dispatcher} if fields.get("num_moe_experts") else {}
    kind = MLATransformerConfig if fields.get("multi_latent_attention") else TransformerConfig
    return kind(
        **fields,
        **moe,
        **_NO_TE,
        activation_func=getattr(F, activation),
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        **overrides,
    )


def build_gpt_model(
    mapping: MegatronMapping, layout: ParallelLayout, config: TransformerConfig
) -> GPTModel:
    """This rank's GPTModel (its pipeline stage, its tensor and expert shards)."""
    use_packed_rope()
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    for layer in spec.layer_specs:
        attention = layer.submodules.self_attention.submodules
        attention.core_attention = PackedCoreAttention
        # MLA's down projections: column-parallel, gathered after (megatron-core 0.19's local
        # spec; 0.16's names a TransformerEngine-only class there).
        for name in ("linear_q_down_proj", "linear_kv_down_proj"):
            if hasattr(attention, name):
                setattr(attention, name, ColumnParallelLinear)
    model = mapping.model
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=layout.padded_vocab(int(model["vocab_size"])),
        max_sequence_length=int(model["max_sequence_length"]),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(model["share_embeddings_and_output_weights"]),
        position_embedding_type=str(model["position_embedding_type"]),
        rotary_base=int(model["rotary_base"]),
    )
    if torch.cuda.is_available():
        # Megatron makes its parallel layers on the GPU, but torch's own modules of the local
        # spec (the norms) on the host; Megatron-LM moves the model after building it too.
        gpt.cuda(torch.cuda.current_device())
    return gpt
