"""The KV cache: one tensor for every layer's pages, allocated once and sized up front.

On a GPU its size follows SGLang's `mem_fraction_static`: the engine's weights plus its cache may
take `mem_fraction` of the device's memory, counted from what the device has free when the cache
is made (a colocated trainer's share stays out of it), and never more than `max_batch_size` rows
of `max_context` tokens need. `kv_cache_tokens` sets the size instead.
"""

from __future__ import annotations

import torch

from miles.torch.engine.paged.model import PagedModel


def page_bytes(model: PagedModel, page_size: int) -> int:
    itemsize = int(torch.empty(0, dtype=model.dtype).element_size())
    return int(2 * model.num_layers * page_size * model.num_kv_heads * model.head_dim * itemsize)


def plan_pages(
    model: PagedModel,
    device: torch.device,
    page_size: int,
    mem_fraction: float,
    kv_cache_tokens: int | None,
    fallback_tokens: int,
) -> int:
    """How many pages to allocate (page 0, the scratch page, included)."""
    if kv_cache_tokens is not None:
        return -(-kv_cache_tokens // page_size) + 1
    enough = -(-fallback_tokens // page_size) + 1  # every row at its longest: no need for more
    if device.type != "cuda":
        return enough
    free, total = torch.cuda.mem_get_info(device)
    weights = sum(p.numel() * p.element_size() for p in model.hf.parameters())
    budget = min(free, int(total * mem_fraction) - weights)
    # Leave room for activations, logits and graphs: a tenth of the budget.
    pages = int(budget * 0.9) // page_bytes(model, page_size)
    if pages < 2:
        raise RuntimeError(
            f"no room for a KV cache: {free / 2**30:.1f} GiB free on {device}, the weights take "
            f"{weights / 2**30:.1f} GiB and mem_fraction is {mem_fraction}: raise "
            "rollout.mem_fraction or free the device"
        )
    return min(pages, enough)


def allocate(
    model: PagedModel, num_pages: int, page_size: int, device: torch.device
) -> torch.Tensor:
    """[layers, 2 (K, V), pages, page_size, kv_heads, head_dim], zeroed: a masked slot must
    never hold a NaN (0 x NaN is NaN in attention's weighted sum)."""
    shape = (model.num_layers, 2, num_pages, page_size, model.num_kv_heads, model.head_dim)
    return torch.zeros(shape, dtype=model.dtype, device=device)
