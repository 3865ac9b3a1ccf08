"""TorchRolloutEngine: logprobs match a plain transformers forward; batching, pause, lifecycle."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.core.contracts.backends import RolloutEngine
from miles.core.contracts.types import GenerateRequest, GenerateResult, SamplingParams
from miles.torch.engine.batch import Batch
from miles.torch.engine.engine import TorchRolloutEngine

torch.set_num_threads(1)

PROMPT_LENS = [5, 17, 9, 2, 30, 11, 1, 23]


def make_requests(sampling: SamplingParams, lens=PROMPT_LENS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        GenerateRequest(i, torch.randint(3, 128, (n,), generator=g).tolist(), sampling)
        for i, n in enumerate(lens)
    ]


def by_id(results) -> dict[int, GenerateResult]:
    return {r.request_id: r for r in results}


def reference_logprobs(model, prompt: list[int], response: list[int], temperature: float):
    """log_softmax(logits / T) at each response position: one unpadded, uncached forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_match_transformers_forward(tiny_model, arch, temperature):
    path = tiny_model(arch)
    # max_batch_size 3 < 8 requests: rows finish, leave, and new prompts are merged in.
    engine = TorchRolloutEngine(path, max_batch_size=3)
    sampling = SamplingParams(temperature=temperature, top_p=0.9, max_new_tokens=12)
    requests = make_requests(sampling)
    results = by_id(engine.results(requests))
    assert sorted(results) == [r.request_id for r in requests]

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    for req in requests:
        res = results[req.request_id]
        assert len(res.response_ids) == len(res.logprobs) > 0
        ref = reference_logprobs(model, req.prompt_ids, res.response_ids, temperature or 1.0)
        chosen = ref.gather(1, torch.tensor(res.response_ids).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(torch.tensor(res.logprobs), chosen, rtol=0, atol=1e-4)
        if temperature == 0:
            assert res.response_ids == ref.argmax(dim=-1).tolist()


def test_batch_size_does_not_change_greedy_results(tiny_model):
    requests = make_requests(SamplingParams(temperature=0.0, max_new_tokens=10))
    outputs = []
    for max_batch_size in (1, 3, 64):
        engine = TorchRolloutEngine(tiny_model("qwen3"), max_batch_size=max_batch_size)
        outputs.append(by_id(engine.results(requests)))
    for req in requests:
        ids = [out[req.request_id].response_ids for out in outputs]
        assert ids[0] == ids[1] == ids[2]
        lps = [torch.tensor(out[req.request_id].logprobs) for out in outputs]
        torch.testing.assert_close(lps[0], lps[2], rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_prompts_merged_mid_decode_match_running_alone(tiny_model, monkeypatch, arch):
    """Uneven budgets make rows finish at different steps, so waiting prompts are prefilled and
    merged into a batch whose rows are mid-decode (left-padded to a common cache length). Greedy
    results must equal each request run alone (batch size 1) and in pairs."""
    merged_mid_decode = 0
    merge = Batch.merge

    def counting_merge(self: Batch, other: Batch) -> None:
        nonlocal merged_mid_decode
        # A live row that already decoded: the new rows join a batch in the middle of decoding.
        merged_mid_decode += any(len(r.response) > 1 and not r.done for r in self.rows)
        merge(self, other)

    monkeypatch.setattr(Batch, "merge", counting_merge)
    budgets = [3, 11, 1, 6, 9, 2, 12, 4]
    prompts = make_requests(SamplingParams(), lens=[5, 17, 9, 2, 30, 11, 1, 23], seed=3)
    requests = [
        GenerateRequest(
            r.request_id, r.prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=n)
        )
        for r, n in zip(prompts, budgets, strict=True)
    ]
    alone = by_id(TorchRolloutEngine(tiny_model(arch), max_batch_size=1).results(requests))
    assert merged_mid_decode == 0
    for max_batch_size in (2, 3):
        engine = TorchRolloutEngine(tiny_model(arch), max_batch_size=max_batch_size)
        batched = by_id(engine.results(requests))
        for req in requests:
            got, ref = batched[req.request_id], alone[req.request_id]
            assert got.response_ids == ref.response_ids, (max_batch_size, req.request_id)
            torch.testing.assert_close(
                torch.tensor(got.logprobs), torch.tensor(ref.logprobs), rtol=0, atol=1e-5
            )
    assert merged_mid_decode > 0  # the merge path really ran


def test_results_stream_in_finishing_order(tiny_model):
    engine = TorchRolloutEngine(tiny_model("qwen3"))
    budgets = [9, 1, 5, 3]
    requests = [
        GenerateRequest(i, [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=n))
        for i, n in enumerate(budgets)
    ]
    stream = engine.results(requests)
    assert next(stream).request_id == 1  # the one-token request is yielded before the rest run
    rest = list(stream)
    # Rows that stop early on eos could come sooner; none can come later than its budget.
    assert {r.request_id for r in rest} == {0, 2, 3}
    for r in rest:
        assert len(r.response_ids) <= budgets[r.request_id]


def test_results_finished_together_stream_as_one_item(tiny_model):
    """One message per model step that finished anything, not one per request."""
    engine = TorchRolloutEngine(tiny_model("qwen3"))
    budgets = [1, 1, 1, 3]
    requests = [
        GenerateRequest(i, [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=n))
        for i, n in enumerate(budgets)
    ]
    items = list(engine.generate(requests))
    assert sorted(r.request_id for r in items[0]) == [0, 1, 2]  # all three after one token
    assert sorted(r.request_id for item in items for r in item) == [0, 1, 2, 3]
    assert all(item for item in items)  # no empty item


def test_protocol_and_lifecycle(tiny_model):
    path = tiny_model("qwen3")
    engine = TorchRolloutEngine(path, seed=1)
    assert isinstance(engine, RolloutEngine)
    assert engine.tokenizer.decode(engine.tokenizer.encode("hi!")) == "hi!"
    health = engine.health()
    assert health["ok"] is True
    assert health["device"] == "cpu" and health["model"] == path
    assert health["weight_version"] == engine.weight_version == 0

    # On CPU release_memory frees nothing, but the engine refuses work until resume_memory.
    engine.release_memory()
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.results(make_requests(SamplingParams(max_new_tokens=2)))
    engine.resume_memory()
    assert len(list(engine.results(make_requests(SamplingParams(max_new_tokens=2))))) == 8


def test_bad_requests_fail_at_call_time(tiny_model):
    engine = TorchRolloutEngine(tiny_model("qwen3"))
    with pytest.raises(ValueError, match="empty prompt"):
        engine.results([GenerateRequest(7, [], SamplingParams())])
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.results([GenerateRequest(7, [1], SamplingParams(max_new_tokens=-1))])
    with pytest.raises(ValueError, match="dtype"):
        TorchRolloutEngine(tiny_model("qwen3"), dtype="float8")
    zero = list(engine.results([GenerateRequest(7, [4, 5], SamplingParams(max_new_tokens=0))]))
    assert [(r.response_ids, r.finish_reason) for r in zero] == [([], "length")]


def test_pause_aborts_running_and_queued_requests(tiny_model):
    engine = TorchRolloutEngine(tiny_model("qwen3"), max_batch_size=2)
    requests = [
        GenerateRequest(i, [5, 6, 7 + i], SamplingParams(temperature=0.0, max_new_tokens=n))
        for i, n in enumerate([1, 8, 8, 8])
    ]
    stream = engine.results(requests)
    first = next(stream)
    assert (first.request_id, first.finish_reason) == (0, "length")
    engine.pause()
    rest = by_id(stream)
    assert sorted(rest) == [1, 2, 3]
    assert all(r.finish_reason == "abort" for r in rest.values())
    assert len(rest[1].response_ids) == len(rest[1].logprobs) == 1  # prefilled with request 0
    assert rest[2].response_ids == rest[3].response_ids == []  # never admitted

    with pytest.raises(RuntimeError, match="paused"):
        engine.results(requests)
    engine.resume()
    assert {r.finish_reason for r in engine.results(requests)} <= {"stop", "length"}


@pytest.mark.gpu
def test_cuda_matches_cpu_and_releases_memory(tiny_model):
    path = tiny_model("qwen3")
    requests = make_requests(SamplingParams(temperature=0.0, max_new_tokens=8))
    cpu = by_id(TorchRolloutEngine(path).results(requests))
    engine = TorchRolloutEngine(path, device="cuda")
    gpu = by_id(engine.results(requests))
    for req in requests:
        torch.testing.assert_close(
            torch.tensor(gpu[req.request_id].logprobs),
            torch.tensor(cpu[req.request_id].logprobs),
            rtol=0,
            atol=1e-3,
        )
    checksum = engine.weights_checksum()
    engine.release_memory()
    assert next(engine.model.parameters()).device.type == "cpu"
    engine.resume_memory()
    assert next(engine.model.parameters()).device.type == "cuda"
    assert engine.weights_checksum() == checksum
    assert len(list(engine.results(requests))) == len(requests)


@pytest.mark.parametrize("path", ["hf", "paged"])
def test_progress_reports_each_requests_tokens_after_every_step(tiny_model, path):
    """on_progress (what `miles serve` streams) sees every unfinished request's tokens after
    each model step: growing prefixes of what the request ends with, logprobs included."""
    engine = TorchRolloutEngine(tiny_model("qwen3"), path=path)
    budgets = {0: 8, 1: 3}
    requests = [
        GenerateRequest(i, [5, 6, 7 + i], SamplingParams(temperature=0.0, max_new_tokens=n))
        for i, n in budgets.items()
    ]
    seen: dict[int, list[tuple[list[int], list[float]]]] = {0: [], 1: []}

    def progress(request_id: int, ids: list[int], logprobs: list[float]) -> None:
        seen[request_id].append((list(ids), list(logprobs)))

    done = by_id(r for batch in engine.generate(requests, on_progress=progress) for r in batch)
    for i, result in done.items():
        snapshots = seen[i]
        lengths = [len(ids) for ids, _ in snapshots]
        if path == "hf":  # one token per step: a snapshot at each length before the last
            assert lengths == list(range(1, len(result.response_ids)))
        else:  # a decode step may run a burst of several tokens
            assert lengths and lengths == sorted(set(lengths))
            assert lengths[-1] < len(result.response_ids)
        for ids, logprobs in snapshots:
            assert ids == result.response_ids[: len(ids)]
            assert logprobs == result.logprobs[: len(ids)]
