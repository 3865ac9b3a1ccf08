"""Building the trainer's models: a Hugging Face checkpoint loaded in fp32, converted for the
precision, with LoRA adapters, fused norms or compiled layers, and sharded with FSDP2.

Every model the trainer holds (the policy, a "copy" reference, the critic) is built here, on
the same mesh and mixed-precision policy.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from miles.core.contracts.backends import TrainSetup
from miles.precision.lora import apply_lora
from miles.torch.models import load_causal_lm
from miles.torch.train.config import FSDPConfig
from miles.torch.train.layers import compile_layer, decoder_layers, recompute_in_backward
from miles.torch.train.rms_norm import fuse_rms_norms
from miles.torch.train.values import load_critic


def build_model(
    path: str,
    cfg: FSDPConfig,
    setup: TrainSetup,
    mesh: DeviceMesh,
    *,
    attn: str,
    compiled: bool,
    rms_norms: tuple[str, ...],
    device: torch.device,
    trainable: bool,
    critic: bool = False,
    seed: int = 0,
) -> tuple[torch.nn.Module, list[str]]:
    """The sharded model and its decoder layers' name prefixes (the groups in which a
    checkpoint gathers its weights). `critic`: the value model (`load_critic`, head from
    `seed`); `compiled`: each decoder layer goes through torch.compile."""
    model = (load_critic(path, attn, seed) if critic else load_hf_model(path, attn)).eval()
    if not critic:  # a precision's own layers (e.g. fp8 / int4 training linears)
        check_converted(setup, setup.precision.convert_model(model))
    if not compiled:  # Inductor fuses the norms of a compiled layer itself
        fuse_rms_norms(model, rms_norms, device)
    if trainable and not critic and setup.lora is not None:
        apply_lora(model, setup.lora)  # base frozen; adapters train
        if cfg.dtype == "bfloat16":
            # Nothing updates the frozen base, so it needs no fp32 master: held in bf16 it
            # computes the same numbers (FSDP casts it to bf16 anyway) at half the memory.
            for p in model.parameters():
                if not p.requires_grad and p.dtype == torch.float32:
                    p.data = p.data.to(torch.bfloat16)
    layers = decoder_layers(model)
    ids = {id(layer) for layer in layers}
    prefixes = [f"{n}." for n, m in model.named_modules() if id(m) in ids]
    if not trainable:
        model.requires_grad_(False)
    elif cfg.activation_checkpointing:
        for layer in layers:
            recompute_in_backward(layer)
    _shard(model, layers, mesh, cfg, compiled)
    return model, prefixes


def _shard(
    model: torch.nn.Module,
    layers: list[torch.nn.Module],
    mesh: DeviceMesh,
    cfg: FSDPConfig,
    compiled: bool,
) -> None:
    """FSDP2 over each decoder layer and the root, in place; then compile the layers."""
    compute = None if cfg.dtype == "float32" else torch.bfloat16
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=policy,
            reshard_after_forward=cfg.reshard_after_forward,
        )
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for layer in layers if compiled else ():  # after sharding: measured faster than before
        compile_layer(layer, fallback=cfg.compile == "auto")
    for module in (*layers, model):
        assert isinstance(module, FSDPModule)
        # Sum gradients over ranks (see `fsdp`'s module docstring) instead of averaging.
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)


def load_hf_model(path: str, attn_implementation: str) -> torch.nn.Module:
    # fp32 master weights on CPU; fully_shard moves each rank's shard to the mesh's device.
    model: torch.nn.Module = load_causal_lm(
        path, dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model


def check_converted(setup: TrainSetup, converted: int) -> None:
    """A quantized precision (one with a weight format of its own) that converted no layer
    would train in full precision while the engines get its format: refuse, rather than run
    silently without the numerics it promises."""
    if converted == 0 and setup.quantized:
        precision = setup.precision
        raise ValueError(
            f"precision {getattr(precision, 'name', type(precision).__name__)!r} converted no "
            "layer of the training model: "
            "training would not run in its format while engines receive it"
        )
