"""A megatron-core optimizer's fp32 main weights and Adam moments, per model parameter, as whole
tensors of this rank's model-parallel shard (the shape of the parameter), and back.

The distributed optimizer holds a contiguous range of each flattened parameter on each
data-parallel rank: the ranges are put together with one all-reduce over the optimizer's data-
parallel group (every other rank adds zeros). The plain optimizers hold the whole tensor. Whole
shards are what `convert.gather` turns into Hugging Face names for a checkpoint, so a checkpoint
holds no layout and resumes at any other.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.optimizer import ChainedOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

MOMENTS = ("exp_avg", "exp_avg_sq")
# The keys of a parameter's state: its fp32 main weight, then Adam's two moments.
KEYS = ("main", *MOMENTS)


def optimizers(optimizer: Any) -> list[Any]:
    """The optimizers a chained one holds (dense and expert parameters apart), or itself."""
    if isinstance(optimizer, ChainedOptimizer):
        return list(optimizer.chained_optimizers)
    return [optimizer]


def adam_states(optimizer: Any, with_params: bool = False) -> Iterator[dict[str, Any]]:
    """Every Adam state dict of the optimizer (and, with_params, {"param": main weight})."""
    for opt in optimizers(optimizer):
        for group in opt.optimizer.param_groups:
            for main in group["params"]:
                if with_params:
                    yield {"param": main}
                if main in opt.optimizer.state:
                    yield opt.optimizer.state[main]


def _pairs(opt: Any) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor, range | None]]:
    """(model parameter, its main weight, the range of the flattened parameter it holds; None:
    the whole parameter)."""
    if isinstance(opt, DistributedOptimizer):
        groups = [
            *zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True),
            *zip(opt.model_fp32_groups, opt.shard_fp32_groups, strict=True),
        ]
        for model_group, main_group in groups:
            for param, main in zip(model_group, main_group, strict=True):
                r = opt._get_model_param_range_map(param)["param"]
                yield param, main, range(r.start, r.end)
    elif isinstance(opt, Float16OptimizerWithFloat16Params):
        for model_group, main_group in zip(
            opt.float16_groups, opt.fp32_from_float16_groups, strict=True
        ):
            for param, main in zip(model_group, main_group, strict=True):
                yield param, main, None
        for group in opt.fp32_from_fp32_groups:
            for param in group:
                yield param, param, None
    elif isinstance(opt, FP32Optimizer):
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                yield param, param, None
    else:
        raise TypeError(f"unsupported megatron-core optimizer {type(opt).__name__}")


def gather_state(optimizer: Any) -> dict[int, dict[str, torch.Tensor]]:
    """id(model parameter) -> {"main", "exp_avg", "exp_avg_sq"}: fp32 tensors shaped like the
    parameter (moments are zeros before the first step). Collective over data parallelism."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for opt in optimizers(optimizer):
        group = getattr(opt, "data_parallel_group", None)
        for param, main, where in _pairs(opt):
            state = opt.optimizer.state.get(main, {})
            values = {"main": main, **{k: state.get(k) for k in MOMENTS}}
            whole = {}
            for key, value in values.items():
                flat = torch.zeros(param.numel(), dtype=torch.float32, device=main.device)
                if value is not None:
                    span = slice(None) if where is None else slice(where.start, where.stop)
                    flat[span] = value.detach().reshape(-1).float()
                whole[key] = flat
            if where is not None and group is not None and dist.get_world_size(group) > 1:
                stacked = torch.stack([whole[k] for k in KEYS])
                dist.all_reduce(stacked, group=group)
                whole = dict(zip(KEYS, stacked.unbind(0), strict=True))
            out[id(param)] = {k: v.view(param.shape) for k, v in whole.items()}
    return out


@torch.no_grad()
def load_state(optimizer: Any, state: dict[int, dict[str, torch.Tensor]], step: int) -> None:
    """Sets every main weight and Adam moment from whole per-parameter tensors (`gather_state`'s
    layout), and Adam's step count to `step`. The model's own weights are the caller's."""
    for opt in optimizers(optimizer):
        for param, main, where in _pairs(opt):
            values = state[id(param)]
            span = slice(None) if where is None else slice(where.start, where.stop)

            def part(key: str, like: torch.Tensor) -> torch.Tensor:
                flat = values[key].reshape(-1)[span]  # noqa: B023 (used right away)
                return flat.to(like.device, like.dtype).view(like.shape)

            main.copy_(part("main", main))
            adam = opt.optimizer.state.setdefault(main, {})
            for key in MOMENTS:
                adam[key] = part(key, main).clone()
            adam["step"] = torch.tensor(float(step), dtype=torch.float32)
