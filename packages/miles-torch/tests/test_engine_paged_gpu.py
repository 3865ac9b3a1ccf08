"""The paged engine path on a CUDA GPU: the Triton decode kernel against plain attention, the
engine against a transformers forward in fp32 and bf16, CUDA graphs against eager steps, and
weights loaded in place and memory released and restored under captured graphs."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.core.contracts.types import GenerateRequest, SamplingParams
from miles.torch.engine.config import TorchEngineConfig
from miles.torch.engine.engine import TorchRolloutEngine

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
    settings = TorchEngineConfig(**{**values, **overrides})
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


SHAPE = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64)


def test_paged_engine_logprobs_match_transformers_in_fp32(tiny_model):
    path = tiny_model("qwen3", **SHAPE)
    reqs = requests(SamplingParams(temperature=1.0, max_new_tokens=24))
    results = {r.request_id: r for r in engine(path, "float32").results(reqs)}
    error = logprob_error(path, torch.float32, results, reqs, 1.0)
    print(f"fp32: max |logprob - transformers fp32| = {error:.2e}")
    assert error <= 1e-4


def test_paged_engine_bf16_error_is_within_transformers_own_bf16_noise(tiny_model):
    """Against the fp32 forward, our bf16 logprobs may be off by at most twice what
    transformers' own bf16 forward is off by on the same tokens."""
    path = tiny_model("qwen3", **SHAPE)
    reqs = requests(SamplingParams(temperature=1.0, max_new_tokens=24))
    results = {r.request_id: r for r in engine(path, "bfloat16").results(reqs)}
    exact = transformers_logprobs(path, torch.float32, results, reqs, 1.0)
    theirs = max_diff(transformers_logprobs(path, torch.bfloat16, results, reqs, 1.0), exact)
    ours = max_diff({k: v.logprobs for k, v in results.items()}, exact)
    print(f"bf16 vs fp32 transformers: ours {ours:.2e}, transformers' bf16 {theirs:.2e}")
    assert ours <= 2 * theirs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_equal_their_torch_arithmetic(dtype):
    from miles.torch.engine.paged import fused

    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, heads, kv_heads, d = 37, 16, 8, 128
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    x = torch.randn((tokens, 1024), generator=g, device="cuda").to(dtype)
    r = torch.randn((tokens, 1024), generator=g, device="cuda").to(dtype)
    w = (1 + 0.1 * torch.randn(1024, generator=g, device="cuda")).to(dtype)
    out, summed = fused.rms_norm(x, w, 1e-6, r)
    torch.testing.assert_close(summed, r + x, rtol=0, atol=0)
    torch.testing.assert_close(out, fused._torch_rms_norm(r + x, w, 1e-6), **tol)
    qkv = torch.randn((tokens, (heads + 2 * kv_heads) * d), generator=g, device="cuda").to(dtype)
    qw = (1 + 0.1 * torch.randn(d, generator=g, device="cuda")).to(dtype)
    kw = (1 + 0.1 * torch.randn(d, generator=g, device="cuda")).to(dtype)
    angle = torch.rand((tokens, d // 2), generator=g, device="cuda") * 6.28
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(dtype)
    sin = torch.cat([angle.sin(), angle.sin()], -1).to(dtype)
    slots = torch.randperm(64, generator=g, device="cuda")[:tokens]
    for norms in [((qw, 1e-6), (kw, 1e-6)), (None, None)]:
        outputs = []
        for device in ["cuda", "cpu"]:
            caches = [torch.zeros((4, 16, kv_heads, d), dtype=dtype, device=device) for _ in "kv"]
            moved = [None if n is None else (n[0].to(device), n[1]) for n in norms]
            q = fused.qk_norm_rope_store(
                qkv.to(device), heads, kv_heads, d, *moved, cos.to(device), sin.to(device),
                *caches, slots.to(device),
            )  # fmt: skip
            outputs.append([q.cpu(), *(c.cpu() for c in caches)])
        for a, b in zip(*outputs, strict=True):
            torch.testing.assert_close(a, b, **tol)
    gate_up = torch.randn((tokens, 2 * 3072), generator=g, device="cuda").to(dtype)
    torch.testing.assert_close(fused.silu_mul(gate_up).cpu(), fused.silu_mul(gate_up.cpu()), **tol)


def test_graphs_equal_eager_and_survive_weight_loads_and_release(tiny_model):
    path = tiny_model("qwen3", **SHAPE)
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


MOE_SHAPE = dict(
    hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
)  # fmt: skip


def test_grouped_experts_equal_transformers_experts_in_bf16(tiny_model):
    from miles.torch.engine.paged.moe import experts_forward, grouped

    assert grouped(torch.device("cuda"), torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model("qwen3_moe", **MOE_SHAPE), dtype=torch.bfloat16
    ).cuda()
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((77, 256), generator=g, device="cuda").to(torch.bfloat16)
    indices = torch.stack([torch.randperm(8, generator=g, device="cuda")[:2] for _ in range(77)])
    indices[:10] = torch.tensor([3, 5], device="cuda")  # a crowded expert, and empty ones
    weights = torch.rand((77, 2), generator=g, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        want = experts(x, indices, weights).float()
        got = experts_forward(x, indices, weights, experts.gate_up_proj, experts.down_proj).float()
    print(
        f"grouped experts vs transformers, bf16: max abs diff {float((got - want).abs().max()):.2e}"
    )
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def _moe_engine(path, dtype, **overrides):
    values = dict(
        page_size=16, max_batch_size=8, max_context=512, kv_cache_tokens=16384, cuda_graphs=True,
    )  # fmt: skip
    settings = TorchEngineConfig(**{**values, **overrides})
    return TorchRolloutEngine(
        path, device="cuda", dtype=dtype, max_batch_size=settings.max_batch_size,
        path="paged", paged=settings, record_routing="ids",
    )  # fmt: skip


def test_paged_moe_on_gpu_records_routes_in_graphs_and_matches_transformers(tiny_model):
    """fp32 (experts one by one, eager): the same tokens and routes as the hf path. bf16
    (grouped experts, decode in CUDA graphs): the recorded routes are those a transformers bf16
    forward of the same tokens takes, up to bf16 ties, and the logprobs are within
    transformers' own bf16 noise. (bf16 graphs and eager steps need not agree token for token:
    a graph runs its bucket's row count, and GEMMs round differently for different shapes.)"""
    path = tiny_model("qwen3_moe", **MOE_SHAPE)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    reqs = requests(greedy)
    fp32 = {r.request_id: r for r in _moe_engine(path, "float32").results(reqs)}
    hf = TorchRolloutEngine(path, device="cuda", dtype="float32", record_routing="ids")
    want = {r.request_id: r for r in hf.results(reqs)}
    for rid, res in want.items():
        assert fp32[rid].response_ids == res.response_ids
        assert (fp32[rid].routing == res.routing).all()
    graphed = _moe_engine(path, "bfloat16")
    assert graphed._paged._graphed
    sampled = requests(SamplingParams(temperature=1.0, max_new_tokens=24, seed=5))
    a = {r.request_id: r for r in graphed.results(sampled)}
    assert graphed._paged.graphs is not None and graphed._paged.graphs.graphs
    # Teacher-forced transformers bf16 forward over the same tokens, its routers hooked.
    from miles.torch.routing import RoutingRecorder, router_adapter

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    recorder = RoutingRecorder(model, router_adapter(model, "test"), with_weights=False)
    agree = total = 0
    for req in sampled:
        res = a[req.request_id]
        with torch.no_grad():
            model(torch.tensor([req.prompt_ids + res.response_ids[:-1]], device="cuda"))
        theirs = recorder.take()[0].sort(dim=-1).values.cpu().numpy()
        ours = torch.from_numpy(res.routing[:-1]).long().sort(dim=-1).values.numpy()
        same = (ours == theirs).all(axis=-1)
        agree, total = agree + int(same.sum()), total + same.size
    print(f"bf16 MoE: {agree}/{total} token-layer routes equal transformers' bf16 forward")
    assert agree / total >= 0.95
    exact = transformers_logprobs(path, torch.float32, a, sampled, 1.0)
    theirs = max_diff(transformers_logprobs(path, torch.bfloat16, a, sampled, 1.0), exact)
    ours = max_diff({k: v.logprobs for k, v in a.items()}, exact)
    print(f"bf16 MoE vs fp32 transformers: ours {ours:.2e}, transformers' bf16 {theirs:.2e}")
    assert ours <= 2 * theirs


def test_fused_sampling_kernel_equals_the_torch_sampler_and_draws_the_right_distribution():
    from miles.torch.engine import sample_kernel
    from miles.torch.engine.sampler import _draw

    g = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 256, 151936
    logits = (3 * torch.randn((rows, vocab), generator=g, device="cuda")).to(torch.bfloat16)
    greedy = torch.arange(rows, device="cuda") % 5 == 0
    temp = torch.where(greedy, 1.0, torch.rand(rows, generator=g, device="cuda") + 0.3)
    u = torch.rand(rows, generator=g, device="cuda")
    tokens, logprobs = sample_kernel.fused_sample(logits, temp, greedy, u)
    ref = torch.log_softmax(logits.float() / temp.unsqueeze(1), dim=-1)
    want = torch.where(greedy, ref.argmax(dim=-1), _draw(ref, u))
    agree = float((tokens == want).float().mean())
    print(f"fused sampler: {agree:.4f} of rows draw the torch sampler's token")
    assert agree >= 0.99
    torch.testing.assert_close(
        logprobs, ref.gather(1, tokens.unsqueeze(1)).squeeze(1), rtol=0, atol=1e-5
    )
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04], device="cuda")
    n = 200_000
    drawn, _ = sample_kernel.fused_sample(
        probs.log().expand(n, -1), torch.ones(n, device="cuda"),
        torch.zeros(n, dtype=torch.bool, device="cuda"), torch.rand(n, generator=g, device="cuda"),
    )  # fmt: skip
    counts = torch.bincount(drawn, minlength=5).double()
    chi2 = float(((counts - n * probs.double()) ** 2 / (n * probs.double())).sum())
    assert chi2 < 18.47  # 4 degrees of freedom, p = 0.001
