"""The paged engine path on a CUDA GPU: the Triton decode kernel against plain attention, the
engine against a transformers forward in fp32 and bf16, CUDA graphs against eager steps, and
weights loaded in place and memory released and restored under captured graphs."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.core.types import GenerateRequest, SamplingParams
from miles.torch.engine.engine import TorchRolloutEngine
from miles.torch.engine.paged.runner import PagedSettings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPT_LENS = [5, 17, 9, 2, 30, 11, 1, 23, 64, 40]


def reference_decode(q, k_cache, v_cache, table, lens, scale):
    out = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        slots = [
            int(table[b, t // k_cache.shape[1]]) * k_cache.shape[1] + t % k_cache.shape[1]
            for t in range(n)
        ]
        idx = torch.tensor(slots, device=q.device)
        k = k_cache.flatten(0, 1)[idx].float().transpose(0, 1)  # [kv_heads, n, d]
        v = v_cache.flatten(0, 1)[idx].float().transpose(0, 1)
        group = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        w = torch.softmax((q[b].float().unsqueeze(1) @ k.transpose(1, 2)) * scale, dim=-1)
        out.append((w @ v).squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (32, 4, 64), (8, 8, 128)])
def test_triton_paged_decode_matches_plain_attention(dtype, atol, heads, kv_heads, head_dim):
    from miles.torch.engine.paged.decode_kernel import paged_decode

    g = torch.Generator(device="cuda").manual_seed(0)
    page, pages, rows = 16, 600, 6
    lens = torch.tensor([1, 15, 16, 17, 300, 2000], dtype=torch.int32, device="cuda")
    width = 128
    perm = torch.randperm(pages - 1, generator=g, device="cuda")[: rows * width // 8] + 1
    table = torch.zeros((rows, width), dtype=torch.int32, device="cuda")
    table[:, : width // 8] = perm.view(rows, -1).int()
    table[5, :] = (torch.arange(width, device="cuda") % (pages - 1) + 1).int()  # the long row
    k_cache = torch.randn((pages, page, kv_heads, head_dim), generator=g, device="cuda").to(dtype)
    v_cache = torch.randn((pages, page, kv_heads, head_dim), generator=g, device="cuda").to(dtype)
    q = torch.randn((rows, heads, head_dim), generator=g, device="cuda").to(dtype)
    scale = head_dim**-0.5
    got = paged_decode(q, k_cache, v_cache, table, lens, scale).float()
    expected = reference_decode(q, k_cache, v_cache, table, lens, scale)
    torch.testing.assert_close(got, expected, rtol=0, atol=atol)


def engine(path, dtype, **overrides):
    values = dict(
        page_size=16, max_batch_size=8, max_context=512, max_prefill_tokens=4096,
        mem_fraction=0.5, kv_cache_tokens=16384, cuda_graphs=True,
    )  # fmt: skip
    settings = PagedSettings(**{**values, **overrides})
    return TorchRolloutEngine(
        path, device="cuda", dtype=dtype, max_batch_size=settings.max_batch_size,
        path="paged", paged=settings,
    )  # fmt: skip


def requests(sampling, lens=PROMPT_LENS):
    g = torch.Generator().manual_seed(0)
    return [
        GenerateRequest(i, torch.randint(3, 128, (n,), generator=g).tolist(), sampling)
        for i, n in enumerate(lens)
    ]


def transformers_logprobs(path, dtype, results, reqs, temperature):
    """Per request: log_softmax(logits / T) of its response tokens from a plain forward."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    out = {}
    for req in reqs:
        res = results[req.request_id]
        with torch.no_grad():
            ids = torch.tensor([req.prompt_ids + res.response_ids], device="cuda")
            logits = model(ids).logits[0].float()
        n = len(req.prompt_ids)
        ref = torch.log_softmax(logits[n - 1 : -1] / (temperature or 1.0), dim=-1)
        chosen = ref.gather(1, torch.tensor(res.response_ids, device="cuda").unsqueeze(1))
        out[req.request_id] = chosen.squeeze(1).cpu()
    return out


def max_diff(a, b):
    return max(float((torch.as_tensor(a[k]) - torch.as_tensor(b[k])).abs().max()) for k in a)


def logprob_error(path, dtype, results, reqs, temperature):
    ref = transformers_logprobs(path, dtype, results, reqs, temperature)
    return max_diff({k: v.logprobs for k, v in results.items()}, ref)


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-4), ("bfloat16", 0.1)])
def test_paged_engine_logprobs_match_transformers_on_gpu(tiny_model, dtype, atol):
    """bf16: transformers' own bf16 forward is the reference, so the bound is bf16 noise; the
    measured number is printed."""
    path = tiny_model(
        "qwen3", hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64
    )
    eng = engine(path, dtype)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24)
    reqs = requests(sampling)
    results = {r.request_id: r for r in eng.results(reqs)}
    error = logprob_error(path, getattr(torch, dtype), results, reqs, 1.0)
    print(f"{dtype}: max |logprob - transformers| = {error:.2e}")
    assert error <= atol


def test_graphs_equal_eager_and_survive_weight_loads_and_release(tiny_model):
    path = tiny_model(
        "qwen3", hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64
    )
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    graphed, eager = engine(path, "float32"), engine(path, "float32", cuda_graphs=False)
    a = {r.request_id: r for r in graphed.results(requests(greedy))}
    b = {r.request_id: r for r in eager.results(requests(greedy))}
    for rid in a:
        assert a[rid].response_ids == b[rid].response_ids
        torch.testing.assert_close(
            torch.tensor(a[rid].logprobs), torch.tensor(b[rid].logprobs), rtol=0, atol=1e-5
        )
    # New weights by Hugging Face name land in the fused matrices the graphs read.
    state = {n: t.clone() for n, t in graphed.model.state_dict().items()}
    g = torch.Generator(device="cuda").manual_seed(1)
    new = {n: t + 0.05 * torch.randn(t.shape, generator=g, device="cuda") for n, t in state.items()}
    graphed.load_weights(new.items(), version=1)
    held = torch.cuda.memory_allocated()
    cache = graphed._paged.kv
    cache_bytes = cache.numel() * cache.element_size()
    del cache
    graphed.release_memory()
    assert held - torch.cuda.memory_allocated() >= cache_bytes
    graphed.resume_memory()
    reqs = requests(SamplingParams(temperature=1.0, max_new_tokens=16))
    results = {r.request_id: r for r in graphed.results(reqs)}
    model_dir = path + "-perturbed"
    model = AutoModelForCausalLM.from_pretrained(path)
    model.load_state_dict({n: t.cpu() for n, t in new.items()}, strict=False)
    model.save_pretrained(model_dir)
    assert logprob_error(model_dir, torch.float32, results, reqs, 1.0) <= 1e-4
