"""Runs Megatron-core's GPTModel, built and filled by miles.megatron, on CPU ranks (gloo) or
GPUs (NCCL, `MILES_MEGATRON_DEVICE=cuda`) and compares its logits with transformers' forward of
the same weights.

    python megatron_cpu_forward.py FAMILY[@HUB_ID] TP EP PP [key=value config overrides...]
        [+ FAMILY TP EP PP [...] ...]

Cases joined by `+` (each with the same TP x EP x PP) run one after another in the same ranks:
one process start-up (torch, megatron-core, transformers) for all of them.

FAMILY alone is its tiny twin; FAMILY@HUB_ID is that checkpoint's stored config.json with random
weights (e.g. qwen3@Qwen/Qwen3-0.6B). `MILES_MEGATRON_DTYPE` (default float32) sets both models'
dtype.

prints one JSON line per rank, `{"cases": [...]}`: per case, names/shapes agreement and, without
pipeline stages (PP 1), the max abs logit difference.
Logits are compared unpacked (two rows) and packed (three sequences in one THD row, through
miles.megatron's core attention) with transformers' forward of each sequence.
megatron-core is written for CUDA; `miles.megatron.testing.run_megatron_on_cpu` patches it so
its forward and backward run on CPU, for checks like this one.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from cpu_ranks import report, spawn_and_print
from megatron.core.packed_seq_params import PackedSeqParams

from miles.megatron.testing import run_megatron_on_cpu

SEQ = 12


def _config(family: str, overrides: list[str]) -> dict:
    from miles.core.registry.families import family_named

    name, _, hub_id = family.partition("@")
    found = family_named(name)
    if hub_id:
        assert found.config_for is not None
        config = found.config_for(hub_id)
        assert config is not None, f"no stored config.json for {hub_id}"
    else:
        assert found.tiny is not None
        config = found.tiny()
        config["vocab_size"] = 300  # not a multiple of 128: the padded vocabulary is exercised
    for item in overrides:
        key, value = item.split("=", 1)
        config[key] = json.loads(value)
    return config


Case = tuple[str, int, int, int, list[str]]  # family, tp, ep, pp, config overrides


def _run(rank: int, world: int, cases: list[Case], port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = os.environ.get("MILES_MEGATRON_DEVICE") == "cuda"
    dtype = getattr(torch, os.environ.get("MILES_MEGATRON_DTYPE", "float32"))
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state

    results = []
    for index, (family, tp, ep, pp, overrides) in enumerate(cases):
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
        )
        if cuda:  # the dropout RNG streams Megatron's layers fork at construction
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(0)
        elif index == 0:
            run_megatron_on_cpu()
        results.append(_case(family, tp, ep, pp, overrides, device, dtype, cuda))
        parallel_state.destroy_model_parallel()
    report(rank, {"cases": results})
    dist.destroy_process_group()


def _case(
    family: str,
    tp: int,
    ep: int,
    pp: int,
    overrides: list[str],
    device: torch.device,
    dtype: torch.dtype,
    cuda: bool,
) -> dict[str, Any]:
    from megatron.core import parallel_state
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles.core.registry.families import family_named
    from miles.megatron.convert import shard
    from miles.megatron.layout import ParallelLayout, Rank
    from miles.megatron.model import build_gpt_model, transformer_config

    config = _config(family, overrides)
    mapping = family_named(family.partition("@")[0]).megatron(config)  # type: ignore[misc]
    hf_config = {k: v for k, v in config.items() if k != "model_type"}
    torch.manual_seed(0)
    hf = (
        AutoModelForCausalLM.from_config(
            AutoConfig.for_model(config["model_type"], **hf_config), dtype=dtype
        )
        .to(device)
        .eval()
    )
    layout = ParallelLayout(tp=tp, pp=pp, ep=ep)
    here = Rank(
        pp=parallel_state.get_pipeline_model_parallel_rank(),
        tp=parallel_state.get_tensor_model_parallel_rank(),
        ep=parallel_state.get_expert_model_parallel_rank(),
        etp=parallel_state.get_expert_tensor_parallel_rank(),
    )
    dispatcher = "alltoall" if cuda else "allgather"  # alltoall makes CUDA streams at init
    tconfig = transformer_config(mapping, layout, dtype, token_dispatcher=dispatcher)
    model = build_gpt_model(mapping, layout, tconfig).eval()
    ours = shard(hf.state_dict(), mapping, layout, here)
    theirs = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    result = {
        "names_equal": set(ours) == set(theirs),
        "name_diff": sorted(set(ours) ^ set(theirs)),
        "shapes_equal": all(ours[k].shape == theirs[k].shape for k in set(ours) & set(theirs)),
    }
    model.load_state_dict(ours, strict=False)
    if pp > 1:  # a forward needs Megatron's pipeline schedule; names and shapes are the check
        return result
    vocab = int(config["vocab_size"])
    ids = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1)).to(device)
    group = parallel_state.get_tensor_model_parallel_group()
    with torch.no_grad():
        # Unpacked: two rows of causal sequences.
        ref = hf(ids).logits
        positions = torch.arange(SEQ, device=device).expand(2, SEQ)
        logits = _gather_vocab(model(ids, positions, None), tp, group)
        result["max_abs_diff"] = (logits[..., :vocab].float() - ref.float()).abs().max().item()
        result["ref_scale"] = ref.abs().max().item()
        # Packed (THD): sequences of 5, 12 and 7 tokens in one row, positions restarting.
        seqs = [ids[0, :5], ids[1], ids[0, 5:]]
        lengths = torch.tensor([len(x) for x in seqs])
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
        cu = cu.to(device)
        packed = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=int(lengths.max()),
            max_seqlen_kv=int(lengths.max()),
        )
        positions = torch.cat([torch.arange(len(x), device=device) for x in seqs])[None]
        out = model(torch.cat(seqs)[None], positions, None, packed_seq_params=packed)
        got = _gather_vocab(out, tp, group)[0, :, :vocab]
        want = torch.cat([hf(x[None]).logits[0] for x in seqs])
        result["packed_max_abs_diff"] = (got.float() - want.float()).abs().max().item()
    result.update(_grads(hf, model, mapping, layout, here, ids, vocab, device))
    return result


def _grads(
    hf: Any,
    model: Any,
    mapping: Any,
    layout: Any,
    here: Any,
    ids: torch.Tensor,
    vocab: int,
    device: torch.device,
) -> dict[str, float]:
    """One loss over logprobs and entropy (what an RL loss reads), backward through both models:
    Megatron's logprobs from its hidden states (miles.megatron.head) against transformers' full
    log-softmax, and every weight's gradient, gathered from all ranks, against transformers'."""
    from megatron.core import parallel_state

    from miles.megatron.convert import gather
    from miles.megatron.head import bypass_output_layer, token_logprobs

    temperature = 0.8
    g = torch.Generator().manual_seed(2)
    targets = torch.randint(0, vocab, ids.shape, generator=g).to(device)
    a, b = (torch.randn(ids.shape, generator=g).to(device) for _ in range(2))

    logp = torch.log_softmax(hf(ids).logits.float() / temperature, dim=-1)
    ref_lp = logp.gather(-1, targets[..., None]).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    hf.zero_grad()
    (ref_lp * a + ref_ent * b).sum().backward()

    bypass_output_layer(model)
    model.zero_grad()
    positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
    lp, ent = token_logprobs(
        model, ids, positions, targets, vocab_size=vocab, temperature=temperature
    )
    (lp * a + ent * b).sum().backward()
    # What finalize_model_grads does in a training step: per-head q/k norms see only this tensor
    # rank's heads, so their gradients are summed over the tensor group.
    tp_group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(tp_group) > 1 and not mapping.transformer.get("multi_latent_attention"):
        for name, param in model.named_parameters():
            if ("q_layernorm" in name or "k_layernorm" in name) and param.grad is not None:
                dist.all_reduce(param.grad, group=tp_group)

    # Gradients as shards (buffers: zeros), from every rank, put together under HF names.
    params = dict(model.named_parameters())
    mine = {
        k: (params[k].grad if k in params and params[k].grad is not None else torch.zeros_like(v))
        for k, v in model.state_dict().items()
        if not k.endswith("_extra_state")
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (here, {k: v.cpu() for k, v in mine.items()}))
    grads = gather(dict(everyone), mapping, layout)
    theirs = {
        k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in hf.named_parameters()
    }
    scale = max(t.abs().max().item() for t in theirs.values())
    diffs = {k: (grads[k].to(device) - t).abs().max().item() for k, t in theirs.items()}
    if os.environ.get("MILES_DEBUG_GRADS"):
        print({k: round(v, 6) for k, v in diffs.items() if v > 1e-4})
    diff = max(diffs.values())
    return {
        "logprob_max_abs_diff": (lp - ref_lp).abs().max().item(),
        "entropy_max_abs_diff": (ent - ref_ent).abs().max().item(),
        "grad_max_abs_diff": diff,
        "grad_scale": scale,
    }


def _gather_vocab(logits: torch.Tensor, tp: int, group: Any) -> torch.Tensor:
    """The full vocabulary's logits from each tensor rank's shard."""
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _cases(argv: list[str]) -> list[Case]:
    cases, words = [], [*argv, "+"]
    while words:
        end = words.index("+")
        family, tp, ep, pp, *overrides = words[:end]
        cases.append((family, int(tp), int(ep), int(pp), overrides))
        words = words[end + 1 :]
    return cases


def main() -> None:
    cases = _cases(sys.argv[1:])
    worlds = {tp * ep * pp for _, tp, ep, pp, _ in cases}
    assert len(worlds) == 1, f"cases joined by + need one world size, got {sorted(worlds)}"
    world = worlds.pop()
    port = int(os.environ.get("MILES_TEST_PORT", "29561"))
    spawn_and_print(_run, args=(world, cases, port), nprocs=world)


if __name__ == "__main__":
    main()
