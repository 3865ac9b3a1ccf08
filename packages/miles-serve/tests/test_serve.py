"""`miles serve` over real HTTP: SGLang's /generate and its wire format, bad requests, pause /
continue / abort, weight updates through a weight-update group and from disk, memory release."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from miles.runtime.cluster.process import free_port
from miles.sglang import protocol as wire
from miles.torch.testing import make_tiny_model

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(300)

VOCAB = 128


def hf_logprobs(model_dir: str, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Each response token's log_softmax(logits) from transformers' own forward (fp32)."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=ids).logits[0].float(), -1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[positions, torch.tensor(response)]


def generate(server: Any, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {"input_ids": prompt, "return_logprob": True, **extra}
    body.setdefault("sampling_params", {"max_new_tokens": 8})
    status, out = server.call("/generate", body)
    assert status == 200, out
    return out


def test_generate_logprobs_equal_transformers_and_the_wire_format_is_sglangs(server, model):
    prompt = [5, 17, 33, 2, 90]
    out = generate(server, prompt, sampling_params={"max_new_tokens": 12, "temperature": 1.0})
    assert set(out) == set(wire.RESPONSE_FIELDS)
    meta = out["meta_info"]
    assert set(meta) == set(wire.META_INFO_FIELDS) | set(wire.META_INFO_LOGPROB_FIELDS)
    assert meta["prompt_tokens"] == len(prompt)
    assert meta["completion_tokens"] == len(out["output_ids"]) > 0
    assert meta["finish_reason"]["type"] in wire.FINISH_TYPES
    assert meta["weight_version"] == "default"
    entries = meta["output_token_logprobs"]
    assert [e[1] for e in entries] == out["output_ids"]
    assert all(isinstance(e[0], float) and e[2] is None for e in entries)
    want = hf_logprobs(model, prompt, out["output_ids"])
    got = torch.tensor([e[0] for e in entries])
    assert (got - want).abs().max().item() < 1e-4


def test_batches_text_stream_and_stop_reasons(server):
    status, out = server.call(
        "/generate",
        {
            "input_ids": [[1, 2, 3], [4, 5]],
            "rid": "batch",
            "sampling_params": {"max_new_tokens": 3},
        },
    )
    assert status == 200 and [o["meta_info"]["id"] for o in out] == ["batch_0", "batch_1"]
    for o in out:
        finish = o["meta_info"]["finish_reason"]
        assert finish == {"type": "length", "length": 3} or finish["type"] == "stop"
    # Greedy twice: the same tokens.
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    first, second = (server.call("/generate", body)[1] for _ in range(2))
    assert first["output_ids"] == second["output_ids"]
    assert isinstance(first["text"], str)
    # Streamed as SGLang streams by default: each chunk is the answer so far (finish_reason
    # null), the last one the whole answer, then [DONE].
    long = {**body, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    whole = server.call("/generate", {**long, "return_logprob": True})[1]
    status, text = server.call("/generate", {**long, "return_logprob": True, "stream": True})
    assert status == 200
    events = [line for line in text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    import json

    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    *partial, last = chunks
    assert last["output_ids"] == whole["output_ids"]
    assert last["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    if len(whole["output_ids"]) > 4:
        assert partial, "the stream sent the answer only at the end"
    for chunk in partial:
        ids = chunk["output_ids"]
        assert chunk["meta_info"]["finish_reason"] is None
        assert 0 < len(ids) < len(whole["output_ids"]) and ids == whole["output_ids"][: len(ids)]
        logprobs = chunk["meta_info"]["output_token_logprobs"]
        assert logprobs == whole["meta_info"]["output_token_logprobs"][: len(ids)]
    assert [len(c["output_ids"]) for c in partial] == sorted(
        {len(c["output_ids"]) for c in partial}
    )
    # A stop token: the answer ends at it, and the finish reason names it.
    stop = first["output_ids"][2]
    out = server.call(
        "/generate",
        {**body, "sampling_params": {**body["sampling_params"], "stop_token_ids": [stop]}},
    )[1]
    assert out["output_ids"][-1] == stop
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"input_ids": [1, 2', "malformed JSON"),
        (b'{"input_ids": [1, 2], "temprature": 1}', "unknown field 'temprature'"),
        (b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}', "max_new_tokens must be >= 0"),
        (b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2000}}', "exceeds the model's maximum context length of 1024"),
        (b'{"input_ids": [1, 2], "lora_path": "x"}', "'lora_path' is an SGLang field"),
        (b'{"input_ids": [1, 999]}', "input_ids must be in [0, 128)"),
        (b'{"input_ids": [1, 2], "text": "a"}', "exactly one of 'text' and 'input_ids'"),
        (b'{"input_ids": [1, 2], "return_logprob": "yes"}', "'return_logprob' must be"),
        (b'[1, 2]', "must be a JSON object"),
        (b'{"input_ids": [1, 2], "logprob_start_len": -2}', "logprob_start_len must be >= -1"),
        (b'{"input_ids": [1, 2], "sampling_params": {"min_new_tokens": 3}}', "'min_new_tokens' is an SGLang field"),
    ],
)  # fmt: skip
def test_bad_requests_get_a_clear_400_and_the_server_keeps_serving(server, raw, message):
    status, out = server.call("/generate", raw=raw)
    assert status == 400, out
    assert message in out["error"]["message"]
    assert (
        server.call("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})[0]
        == 200
    )


def flushed(server: Any, within_s: float = 10.0) -> bool:
    """/flush_cache as a client calls it: 400 while requests run, so retried until 200."""
    deadline = time.monotonic() + within_s
    while server.call("/flush_cache", {})[0] != 200:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_information_endpoints(server):
    status, info = server.call("/get_server_info")
    assert status == 200 and info["served_by"] == "miles serve" and info["version"]
    assert server.call("/get_model_info")[1]["is_generation"] is True
    assert server.call("/health_generate")[0] == 200
    assert server.call("/get_weight_version")[1] == {"weight_version": "default"}
    assert flushed(server)


def _many(server: Any, count: int, max_new_tokens: int) -> list[Any]:
    """Start `count` long requests on threads; their futures."""
    assert flushed(server)  # the previous test's engine calls have ended
    pool = ThreadPoolExecutor(count)
    body = {"sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0}}
    futures = [
        pool.submit(generate, server, [3 + i % 50, 7, 9], rid=f"long-{i}", **body)
        for i in range(count)
    ]
    pool.shutdown(wait=False)
    return futures


def _until_running(server: Any) -> None:
    deadline = time.monotonic() + 30
    while server.call("/flush_cache", {})[0] == 200:  # 400 once requests run
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.01)


def test_pause_abort_answers_running_requests_with_abort(server):
    futures = _many(server, 24, 900)
    _until_running(server)
    status, out = server.call("/pause_generation", {"mode": "abort"})
    assert status == 200 and out["success"], out
    results = [f.result(timeout=120) for f in futures]
    aborted = [r for r in results if r["meta_info"]["finish_reason"]["type"] == "abort"]
    assert aborted, "no request was running at the pause"
    for r in aborted:
        assert len(r["output_ids"]) == len(r["meta_info"]["output_token_logprobs"]) < 900
    # Paused: new work waits for continue (SGLang holds it), it is neither refused nor aborted.
    waiting = _many(server, 1, 2)[0]
    time.sleep(0.3)
    assert not waiting.done(), "a request ran while generation was paused"
    assert server.call("/health_generate")[0] == 503
    assert server.call("/continue_generation", {})[0] == 200
    late = waiting.result(timeout=60)
    assert (
        late["meta_info"]["finish_reason"]["type"] != "abort" and 1 <= len(late["output_ids"]) <= 2
    )


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_keeps_running_requests_and_continue_finishes_them(server, model, mode):
    futures = _many(server, 24, 900)
    _until_running(server)
    assert server.call("/pause_generation", {"mode": mode})[0] == 200
    time.sleep(0.2)
    held = [f for f in futures if not f.done()]
    assert held, "every request finished before the pause"
    assert server.call("/flush_cache", {})[0] == 400  # held requests count as running
    assert server.call("/continue_generation", {})[0] == 200
    results = [f.result(timeout=300) for f in futures]
    assert all(r["meta_info"]["finish_reason"]["type"] != "abort" for r in results)
    for r in results:  # the two parts joined: one logprob per token, the budget kept
        entries = r["meta_info"]["output_token_logprobs"]
        assert [e[1] for e in entries] == r["output_ids"]
        finish = r["meta_info"]["finish_reason"]
        assert (
            len(r["output_ids"]) == 900
            if finish["type"] == "length"
            else len(r["output_ids"]) < 900
        )
    # The joined logprobs are the model's own (the weights did not change).
    r = max(results, key=lambda r: len(r["output_ids"]))
    got = torch.tensor([e[0] for e in r["meta_info"]["output_token_logprobs"]])
    prompt = [3 + int(r["meta_info"]["id"].split("-")[1]) % 50, 7, 9]
    assert (got - hf_logprobs(model, prompt, r["output_ids"])).abs().max().item() < 1e-4
    assert flushed(server)


def test_continue_returns_at_once_and_resumes_held_requests_before_queued_ones(server):
    # On the CPU one engine call runs at a time (the hf path), so `queued` waits behind `held`.
    # Greedy from this prompt runs to the budget (about 2 s here), so neither ends early.
    body = {"sampling_params": {"max_new_tokens": 900, "temperature": 0}}
    pool = ThreadPoolExecutor(2)
    finished: dict[str, float] = {}

    def timed(rid: str) -> None:
        generate(server, [4, 8, 15], rid=rid, **body)
        finished[rid] = time.monotonic()

    assert flushed(server)
    futures = [pool.submit(timed, "held")]
    _until_running(server)
    futures.append(pool.submit(timed, "queued"))
    time.sleep(0.3)  # queued behind the running call
    assert server.call("/pause_generation", {"mode": "in_place"})[0] == 200
    time.sleep(0.3)
    assert len(finished) == 0, "a request ended before the pause"
    assert server.call("/continue_generation", {})[0] == 200
    returned = time.monotonic()
    for future in futures:
        future.result(timeout=300)
    assert returned < min(finished.values()), "continue_generation waited for an engine call"
    # The request that was running goes first: `queued` ends a whole generation (about 2 s) after
    # it, or with it when the batcher takes both into one engine call after the continue.
    assert finished["held"] < finished["queued"] + 0.5, finished
    assert flushed(server)


def test_abort_one_request_leaves_the_others_running(server):
    futures = _many(server, 8, 900)
    _until_running(server)
    status, out = server.call("/abort_request", {"rid": "long-3"})
    assert status == 200, out
    results = {f.result(timeout=300)["meta_info"]["id"]: f.result() for f in futures}
    for rid, r in results.items():
        finish = r["meta_info"]["finish_reason"]["type"]
        if rid != "long-3":
            assert finish != "abort", rid
    assert server.call("/abort_request", {})[0] == 400


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def _trainer_group(port: int, world: int, name: str) -> Any:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, timeout=timedelta(seconds=60))
    return dist.ProcessGroupGloo(dist.PrefixStore(name, store), 0, world, timedelta(seconds=60))


def _in_thread(fn: Any, *args: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)))
    thread.start()
    return thread, out


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_weights_through_the_update_group(server, tmp_path, load_format):
    new = make_tiny_model(tmp_path / "new", vocab_size=VOCAB, seed=7)
    weights = dict(AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32).state_dict())
    port, name = free_port(), f"group-{load_format}"
    init, answer = _in_thread(
        server.call,
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
         "world_size": 2, "group_name": name, "backend": "gloo"},
    )  # fmt: skip
    group = _trainer_group(port, 2, name)
    init.join(60)
    assert answer[0][0] == 200 and answer[0][1]["success"], answer
    names = list(weights)
    body = {
        "names": names,
        "dtypes": ["float32"] * len(names),
        "shapes": [list(weights[n].shape) for n in names],
        "group_name": name,
        "weight_version": f"v-{load_format}",
        "load_format": load_format,
    }
    post, answer = _in_thread(server.call, "/update_weights_from_distributed", body)
    if load_format == "flattened_bucket":
        _broadcast(group, torch.cat([weights[n].flatten() for n in names]))
    else:
        for n in names:
            _broadcast(group, weights[n].contiguous())
    post.join(60)
    assert answer[0] == (200, {"success": True, "message": f"loaded {len(names)} tensor(s)"})
    assert server.call("/get_weight_version")[1] == {"weight_version": f"v-{load_format}"}
    prompt = [4, 8, 15, 16]
    out = generate(server, prompt)
    assert out["meta_info"]["weight_version"] == f"v-{load_format}"
    got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
    assert (got - hf_logprobs(new, prompt, out["output_ids"])).abs().max().item() < 1e-4
    assert server.call("/destroy_weights_update_group", {"group_name": name})[0] == 200
    assert server.call("/update_weights_from_distributed", body)[0] == 400  # no group now


def test_weights_from_disk_then_back(server, model, tmp_path):
    other = make_tiny_model(tmp_path / "other", vocab_size=VOCAB, seed=3)
    status, out = server.call(
        "/update_weights_from_disk", {"model_path": other, "weight_version": "disk"}
    )
    assert status == 200 and out["success"], out
    assert server.call("/get_model_info")[1]["model_path"] == other  # SGLang: the model served
    prompt = [9, 9, 1]
    out = generate(server, prompt)
    got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
    assert (got - hf_logprobs(other, prompt, out["output_ids"])).abs().max().item() < 1e-4
    status, out = server.call("/update_weights_from_disk", {"model_path": str(tmp_path / "none")})
    assert status == 400 and "no safetensors" in out["error"]["message"]
    assert out["success"] is False and "no safetensors" in out["message"]  # SGLang's contract
    assert server.call("/get_model_info")[1]["model_path"] == other  # unchanged by the failure
    assert (
        server.call(
            "/update_weights_from_disk", {"model_path": model, "weight_version": "default"}
        )[0]
        == 200
    )


def test_weights_from_tensor_by_reference_and_refused_payloads(server, model, tmp_path):
    """A colocated trainer's bucket by reference (a shared-memory file on the CPU; CUDA IPC on
    a GPU), as the sglang backend sends it; payloads that are not tensor rebuilds get a 400."""
    import base64
    import pickle

    from miles.core.contracts.weight_sync import plan_buckets
    from miles.sglang.tensors import serialize_bucket
    from miles.torch.sync.group import meta_of
    from miles.torch.sync.ipc import pack_bucket, release, share

    new = make_tiny_model(tmp_path / "new", vocab_size=VOCAB, seed=11)
    weights = dict(AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32).state_dict())
    plan = plan_buckets((meta_of(n, t) for n, t in weights.items()), 2**16)
    assert len(plan.buckets) > 1
    named = iter(weights.items())
    for index, bucket in enumerate(plan.buckets):
        handle = share(pack_bucket(bucket, named, "cpu"))
        try:
            status, out = server.call(
                "/update_weights_from_tensor",
                {"serialized_named_tensors": [serialize_bucket(bucket, handle)],
                 "load_format": None, "flush_cache": index == len(plan.buckets) - 1,
                 "weight_version": "ipc"},
            )  # fmt: skip
        finally:
            release(handle)  # the server answered: it copied the bucket out
        assert status == 200 and out["success"], out
    prompt = [3, 1, 4, 1, 5]
    out = generate(server, prompt)
    assert out["meta_info"]["weight_version"] == "ipc"
    got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
    assert (got - hf_logprobs(new, prompt, out["output_ids"])).abs().max().item() < 1e-4

    class Evil:
        def __reduce__(self):
            import os

            return os.system, ("touch /tmp/miles-should-not-exist",)

    for payload, message in [
        (pickle.dumps([("w", Evil())]), "calls posix.system, which is not a tensor rebuild"),
        (pickle.dumps({"w": 1}), "expected a list of (name, tensor)"),
        (b"not a pickle", "not a tensor payload"),
    ]:
        entry = base64.b64encode(payload).decode()
        status, out = server.call(
            "/update_weights_from_tensor", {"serialized_named_tensors": [entry]}
        )
        assert status == 400 and message in out["error"]["message"], out
    assert not Path("/tmp/miles-should-not-exist").exists()
    # A rebuild of a file that is not a trainer's bucket is refused too.
    from miles.sglang.tensors import _Call, shared_file

    sneaky = pickle.dumps([("w", _Call(shared_file, ("/etc/passwd", 4, "float32")))])
    status, out = server.call(
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [base64.b64encode(sneaky).decode()]},
    )
    assert status == 400 and "is not a bucket file" in out["error"]["message"], out
    restore = server.call(
        "/update_weights_from_disk", {"model_path": model, "weight_version": "default"}
    )
    assert restore[0] == 200
    assert generate(server, prompt)["meta_info"]["finish_reason"]["type"] in ("stop", "length")


def test_release_and_resume_memory(server):
    assert server.call("/release_memory_occupation", {"tags": ["weights", "kv_cache"]})[0] == 200
    status, out = server.call("/generate", {"input_ids": [1, 2]})
    assert status == 503 and "resume_memory_occupation" in out["error"]["message"]
    assert server.call("/release_memory_occupation", {"tags": ["nope"]})[0] == 400
    assert server.call("/resume_memory_occupation", {})[0] == 200
    assert (
        server.call("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})[0]
        == 200
    )


def test_api_key(model, tmp_path, serve_process):
    start_server, stop_server = serve_process
    server = start_server(model, tmp_path, "--api-key", "s3cret", "--max-body-mb", "1")
    try:
        status, out = server.call("/get_server_info")
        assert status == 401 and "API key" in out["error"]["message"]
        good = {"Authorization": "Bearer s3cret"}
        assert server.call("/get_server_info", headers=good)[0] == 200
        assert server.call("/health")[0] == 200  # health stays open for load balancers
        # urllib sends the whole body before it reads: a refusal must still arrive as an answer,
        # not a broken pipe (the server reads and drops a refused body, up to a bound).
        big = json.dumps({"text": "x" * (12 << 20)}).encode()
        for _ in range(5):
            assert server.call("/generate", raw=big, headers=good)[0] == 413
            assert server.call("/update_weight_version", raw=big)[0] == 401
    finally:
        stop_server(server)
    # SIGTERM: uvicorn drains, the app shuts down, then the signal ends the process.
    assert "miles serve: shut down" in Path(server.log).read_text()


def test_openai_completions_with_token_ids(server, model):
    from miles.sglang import openai

    prompt = [11, 12, 13]
    body = {"prompt": prompt, "max_tokens": 6, "logprobs": 1, "return_token_ids": True}
    status, out = server.call("/v1/completions", body)
    assert status == 200, out
    assert set(out) == set(openai.COMPLETION_RESPONSE_FIELDS) and out["object"] == "text_completion"
    (choice,) = out["choices"]
    assert set(openai.COMPLETION_CHOICE_FIELDS) <= set(choice)
    assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) > 0
    assert choice["finish_reason"] in ("stop", "length")
    assert set(out["usage"]) == set(openai.USAGE_FIELDS)
    assert out["usage"]["completion_tokens"] == len(choice["token_ids"])
    got = torch.tensor(choice["logprobs"]["token_logprobs"])
    assert (got - hf_logprobs(model, prompt, choice["token_ids"])).abs().max().item() < 1e-4
    assert len(choice["logprobs"]["tokens"]) == len(choice["token_ids"])


def test_openai_chat_with_input_ids_returns_the_exact_tokens(server, model):
    from miles.sglang import openai

    ids = [3, 30, 31, 32]
    body = {
        "messages": [{"role": "user", "content": "ignored: input_ids are the prompt"}],
        "input_ids": ids,
        "max_tokens": 5,
        "logprobs": True,
        "return_token_ids": True,
        "return_meta_info": True,
    }
    status, out = server.call("/v1/chat/completions", body)
    assert status == 200, out
    (choice,) = out["choices"]
    assert set(openai.CHAT_CHOICE_FIELDS) <= set(choice) and out["object"] == "chat.completion"
    assert choice["message"]["role"] == "assistant" and isinstance(
        choice["message"]["content"], str
    )
    assert choice["prompt_token_ids"] == ids
    meta = choice["meta_info"]
    assert [e[1] for e in meta["output_token_logprobs"]] == choice["token_ids"]
    got = torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]])
    assert (got - hf_logprobs(model, ids, choice["token_ids"])).abs().max().item() < 1e-4
    # Without input_ids the tokenizer's chat template makes the prompt (transformers' own).
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "say a"}]
    want = AutoTokenizer.from_pretrained(model).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )["input_ids"]
    status, out = server.call(
        "/v1/chat/completions", {"messages": messages, "return_prompt_token_ids": True}
    )
    assert status == 200, out
    assert out["choices"][0]["prompt_token_ids"] == want
    status, out = server.call("/v1/chat/completions", {**body, "n": 2})
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1]
    status, out = server.call("/v1/chat/completions", {**body, "n": 65})
    assert status == 400 and "n must be in [1, 64]" in out["error"]["message"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nothing-here"], "neither a config file nor a recipe"),
        (["quickstart", "--set", "steps=abc"], "steps: expected an integer"),
        (["quickstart", "--max-queue", "0"], "--max-batch-size and --max-queue must be at least 1"),
    ],
)
def test_serve_refuses_bad_arguments_with_a_message(args, message):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "miles.core.cli", "serve", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


NO_KEY = {"Authorization": ""}
GENERATE = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}


def test_without_api_key_control_needs_the_servers_own_key(server):
    """The audit: with no --api-key anyone who reached the port replaced the weights. Now the
    server makes a key (its file readable by its user only); control and weight endpoints need
    it, generation on loopback does not."""
    from miles.sglang.serve_keys import key_file

    port = int(server.url.rsplit(":", 1)[1])
    path = key_file("127.0.0.1", port)
    assert path.stat().st_mode & 0o777 == 0o600
    for route, body in [
        ("/update_weights_from_disk", {"model_path": "/nonexistent"}),
        ("/update_weight_version", {"new_version": "evil"}),
        ("/pause_generation", {}),
        ("/release_memory_occupation", {}),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1}),
    ]:
        status, out = server.call(route, body, headers=NO_KEY)
        assert status == 401 and "API key" in out["error"]["message"], route
    assert server.call("/generate", GENERATE, headers=NO_KEY)[0] == 200
    assert server.call("/get_server_info", headers=NO_KEY)[0] == 200
    assert server.call("/get_weight_version")[1]["weight_version"] != "evil"


@pytest.mark.parametrize(
    "headers, status",
    [
        ({"Content-Type": "text/plain"}, 415),  # a browser's "simple" cross-site POST
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
        ({"Origin": "http://evil.example"}, 403),
        ({"Host": "evil.example:30000"}, 403),  # DNS rebinding
    ],
)
def test_browser_style_requests_are_refused(server, headers, status):
    got, out = server.call("/pause_generation", {}, headers=headers)
    assert got == status, out
    assert server.call("/generate", GENERATE, headers=headers)[0] == status


@pytest.mark.parametrize(
    "raw, message",
    [
        (b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', "NaN"),
        (b'{"input_ids": [1], "sampling_params": {"temperature": 1e999}}', "finite"),
        (b'{"input_ids": [1], "sampling_params": {"top_p": -Infinity}}', "Infinity"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ],
)
def test_non_finite_and_deep_bodies_are_400(server, raw, message):
    status, out = server.call("/generate", raw=raw)
    assert status == 400 and message in out["error"]["message"], out


def _black_hole() -> Any:
    """A listening socket that never accepts: a weight-update group's trainer that is gone (the
    TCP handshake completes, nothing ever answers)."""
    import socket

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    return hole


def _join_body(port: int) -> dict[str, Any]:
    return {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "backend": "gloo",
    }  # fmt: skip


def test_weight_calls_that_hang_get_a_deadline_and_never_take_the_workers(
    model, tmp_path, serve_process
):
    """The audit: one init_weights_update_group to a dead trainer hung 600 s; 45 of them took
    every worker. Now each has a deadline (504 naming what it waited for), and they run one at a
    time on a lane of their own, so generation is answered meanwhile."""
    start_server, stop_server = serve_process
    server = start_server(model, tmp_path, "--weight-timeout", "8")
    hole = _black_hole()
    try:
        body = _join_body(hole.getsockname()[1])
        with ThreadPoolExecutor(45) as pool:
            started = time.monotonic()
            calls = [
                pool.submit(server.call, "/init_weights_update_group", body) for _ in range(45)
            ]
            time.sleep(1.0)
            status, out = server.call("/generate", GENERATE)
            assert status == 200, out
            assert not all(call.done() for call in calls)  # answered while they still wait
            results = [call.result() for call in calls]
        assert time.monotonic() - started < 40  # not 45 x 8 s: the waiters give up on time
        statuses = [status for status, _ in results]
        assert 504 in statuses and set(statuses) <= {503, 504}, statuses
        timed_out = next(out for status, out in results if status == 504)
        assert timed_out["success"] is False
        assert "init_weights_update_group" in timed_out["message"]
        assert f"127.0.0.1:{body['master_port']}" in timed_out["message"]
        # The lane is free again: a real weight load goes through.
        status, out = server.call("/update_weights_from_disk", {"model_path": model})
        assert status == 200 and out["success"], out
    finally:
        hole.close()
        stop_server(server)


def test_sigterm_exits_in_bounded_time_with_a_weight_call_in_flight(model, tmp_path, serve_process):
    """The audit: after SIGTERM the server stopped listening and its process lived 13+ minutes,
    blocked on a group set-up. Now it drains for --shutdown-timeout, then exits."""
    start_server, _ = serve_process
    server = start_server(model, tmp_path, "--weight-timeout", "600", "--shutdown-timeout", "1")
    hole = _black_hole()
    try:
        with ThreadPoolExecutor(1) as pool:
            pool.submit(
                server.call, "/init_weights_update_group", _join_body(hole.getsockname()[1])
            )
            time.sleep(1.0)
            server.process.terminate()
            started = time.monotonic()
            server.process.wait(timeout=30)
        assert time.monotonic() - started < 25  # --shutdown-timeout 1 + 10 s; not 600 s
    finally:
        hole.close()
        if server.process.poll() is None:
            server.process.kill()
