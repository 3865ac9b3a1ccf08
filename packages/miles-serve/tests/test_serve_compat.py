"""`miles serve` where SGLang's own server tests found it differing from SGLang: logit_bias (OpenAI's
and the native sampling_params'), chat's continue_final_message, the Responses API's sampling
extras and error object, the /v1 error shape, /v1/score's out-of-vocabulary label, stop_regex's
matched_stop, /get_server_info's max_total_num_tokens, and a request the engine refuses. Over HTTP
against real servers (the official `openai` client on /v1), on the paged path and on the hf path.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from transformers import AutoTokenizer

CONTEXT = 160  # the in-process app's context, as the `paged` server's (conftest.py)
PROMPT = [11, 12, 13, 14]


@pytest.fixture(scope="module", params=["paged", "hf"])
def either(request: pytest.FixtureRequest) -> Any:
    """The paged server, then the hf one (conftest's `server`: the CPU's default path)."""
    return request.getfixturevalue("paged" if request.param == "paged" else "server")


def client_of(server: Any) -> openai.OpenAI:
    # Generation is open on loopback (the server made its own key for control calls).
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(model: str) -> Any:
    return AutoTokenizer.from_pretrained(model)


def greedy(server: Any, **extra: Any) -> tuple[list[int], list[float]]:
    """(token ids, logprobs) of a greedy completion of PROMPT, ignoring EOS."""
    out = client_of(server).completions.create(
        model=server.model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, "return_token_ids": True}, **extra,
    )  # fmt: skip
    choice = out.choices[0]
    return (choice.model_extra or {})["token_ids"], list(choice.logprobs.token_logprobs)


# -- logit_bias ------------------------------------------------------------------------------


def test_logit_bias_forces_forbids_and_is_the_sampled_distribution(either, reference):
    plain, plain_logprobs = greedy(either)
    target = next(t for t in range(40, 128) if t not in plain)
    forced, logprobs = greedy(either, logit_bias={str(target): 100})
    assert forced == [target] * 6
    # SGLang's logprobs are of the biased distribution: a +100 token has probability ~1; its
    # unbiased logprob (the model's own) is far below.
    assert all(lp > -1e-3 for lp in logprobs), logprobs
    with torch.no_grad():
        raw = torch.log_softmax(reference(input_ids=torch.tensor([PROMPT])).logits[0, -1], -1)
    assert raw[target].item() < -1.0
    # -100 on the argmax: the first token changes; the rest of the vocabulary keeps its order.
    banned, banned_logprobs = greedy(either, logit_bias={str(plain[0]): -100})
    first, second = torch.topk(raw, 2).indices.tolist()
    assert plain[0] == first and banned[0] == second
    assert plain_logprobs[0] == pytest.approx(raw[first].item(), abs=1e-4)
    # Its logprob: of the distribution without the argmax (exp(-100) of it left), renormalised.
    without = raw[second] - torch.log1p(-raw[first].exp())
    assert banned_logprobs[0] == pytest.approx(without.item(), abs=1e-3)
    # A bias of 0 changes nothing.
    assert greedy(either, logit_bias={str(target): 0})[0] == plain


def test_logit_bias_on_chat_and_native_generate(either):
    client = client_of(either)
    target = 77
    chat = client.chat.completions.create(
        model=either.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=1.0, logit_bias={str(target): 100}, extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert (chat.choices[0].model_extra or {})["token_ids"] == [target] * 4
    # SGLang's native form, in a batch: the bias is the first prompt's only (its isolation test).
    body = {
        "input_ids": [PROMPT, PROMPT],
        "sampling_params": [
            {"max_new_tokens": 4, "temperature": 1.0, "logit_bias": {str(target): 100.0}},
            {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        ],
        "return_logprob": True,
    }
    status, out = either.call("/generate", body)
    assert status == 200, out
    assert [e[1] for e in out[0]["meta_info"]["output_token_logprobs"]] == [target] * 4
    assert out[1]["output_ids"] == greedy(either)[0][:4]


def test_logit_bias_outside_the_vocabulary_is_a_400(paged):
    for bias, words in (({"128": 1}, "got 128"), ({"-1": 1}, "got -1"), ({"x": 1}, "token ids")):
        status, out = paged.call(
            "/generate", {"input_ids": PROMPT, "sampling_params": {"logit_bias": bias}}
        )
        assert status == 400 and "logit_bias" in out["error"]["message"], out
        assert words in out["error"]["message"], out
    with pytest.raises(openai.BadRequestError, match=re.escape("keys in [0, 127], got 500")):
        client_of(paged).completions.create(
            model=paged.model, prompt=PROMPT, max_tokens=2, logit_bias={"500": 5}
        )


# -- chat: continue_final_message ------------------------------------------------------------


def test_continue_final_message_continues_the_assistant_turn(paged, tokenizer):
    messages = [
        {"role": "user", "content": "name a colour"},
        {"role": "assistant", "content": "The colour is"},
    ]
    client = client_of(paged)

    def prompt_ids(**extra: Any) -> list[int]:
        out = client.chat.completions.create(
            model=paged.model, messages=messages, max_tokens=2, temperature=0,
            extra_body={"return_prompt_token_ids": True, **extra},
        )  # fmt: skip
        return list((out.choices[0].model_extra or {})["prompt_token_ids"])

    continued = prompt_ids(continue_final_message=True)
    want = tokenizer.apply_chat_template(
        messages, continue_final_message=True, add_generation_prompt=False, tokenize=True
    )
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert continued == list(want)
    # The assistant's text is the prompt's end: no end-of-turn after it, no new turn opened.
    assert tokenizer.decode(continued).endswith("The colour is")
    closed = prompt_ids()
    assert closed != continued and len(closed) > len(continued)
    # With a last message that is not the assistant's, the flag changes nothing (SGLang).
    messages = messages[:1]
    assert prompt_ids(continue_final_message=True) == prompt_ids()


# -- /v1/responses ---------------------------------------------------------------------------


def test_responses_take_sglangs_sampling_extras(paged):
    client = client_of(paged)

    def respond(**extra: Any) -> Any:
        return client.responses.create(
            model=paged.model, input="hello", max_output_tokens=12, store=False, **extra
        )

    plain = respond(temperature=0)
    text = plain.output_text
    assert len(text) > 6
    # SGLang 0.5's usage names beside OpenAI's.
    usage = plain.usage.model_extra or {}
    assert usage["prompt_tokens"] == plain.usage.input_tokens
    assert usage["completion_tokens"] == plain.usage.output_tokens
    # top_k 1 at temperature 1 is greedy: the same text (sampling would not be).
    assert respond(temperature=1.0, extra_body={"top_k": 1}).output_text == text
    # stop cuts the text where the string first occurs.
    stop = text[3:5]
    stopped = respond(temperature=0, extra_body={"stop": [stop]})
    assert stopped.status == "completed" and stopped.output_text == text[: text.find(stop)]
    for name, value in (("frequency_penalty", 1.0), ("presence_penalty", 0.5),
                        ("repetition_penalty", 1.3), ("min_p", 0.1)):  # fmt: skip
        out = respond(temperature=0, extra_body={name: value})
        assert out.status in ("completed", "incomplete"), name
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        respond(extra_body={"frequency_penalty": 3.0})


def test_responses_errors_are_the_nested_error_object(paged):
    status, out = paged.call(
        "/v1/responses", {"model": paged.model, "input": "Hi", "previous_response_id": "bad"}
    )
    assert status == 400, out
    assert out["error"] == {
        "message": "Invalid 'response_id': 'bad'. Expected an ID that begins with 'resp'.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": 400,
    }
    status, out = paged.call("/v1/responses", {"input": "Hi", "bogus": 1})
    assert status == 400 and set(out) == {"error"}, out
    assert "'bogus'" in out["error"]["message"] and out["error"]["code"] == 400


# -- error shapes ----------------------------------------------------------------------------


def test_v1_errors_are_sglangs_error_response_and_native_ones_unchanged(paged):
    status, out = paged.call(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "bogus": 1}
    )
    assert status == 400, out
    assert out["object"] == "error" and out["type"] == "BadRequestError" and out["code"] == 400
    assert "'bogus'" in out["message"] and "param" in out and out["param"] is None
    assert out["error"]["message"] == out["message"] and out["error"]["type"] == "BadRequestError"
    try:
        client_of(paged).completions.create(model=paged.model, prompt="", max_tokens=1)
    except openai.BadRequestError as exc:
        assert exc.status_code == 400 and exc.type == "BadRequestError"
    else:
        raise AssertionError("an empty prompt was accepted")
    status, out = paged.call("/v1/models/other")
    assert status == 404 and out["type"] == "NotFoundError" and out["code"] == 404, out
    # The native endpoints keep SGLang's {"error": {"message"}}.
    status, out = paged.call("/generate", {"input_ids": PROMPT, "bogus": 1})
    assert status == 400 and out == {"error": {"message": out["error"]["message"]}}, out


def test_score_label_outside_the_vocabulary_is_sglangs_400(paged):
    status, out = paged.call(
        "/v1/score",
        {"query": "The capital of France is", "items": ["Paris", "London"],
         "label_token_ids": [999999], "apply_softmax": True},
    )  # fmt: skip
    assert status == 400, out
    assert out["type"] == "BadRequestError"
    assert "Token ID 999999 is out of vocabulary (vocab size: 128)" in out["message"]


# -- matched_stop for stop_regex -------------------------------------------------------------


def test_stop_regex_matched_stop_is_the_pattern(either):
    def chat(**extra: Any) -> dict[str, Any]:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 12,
                "temperature": 0, "ignore_eos": True, **extra}  # fmt: skip
        status, out = either.call("/v1/chat/completions", body)
        assert status == 200, out
        return dict(out["choices"][0])

    text = chat()["message"]["content"]
    # A pattern that never occurs literally: SGLang does not cut the text (its cut looks for
    # the pattern string), so the matched text stays.
    piece = text[3:5]
    pattern = "(?:" + re.escape(piece) + ")"
    hit = chat(stop_regex=pattern)
    assert hit["finish_reason"] == "stop" and hit["matched_stop"] == pattern
    content = hit["message"]["content"]
    assert content.startswith(text[: text.find(piece) + len(piece)])
    assert len(content) <= len(text)
    # /generate's finish_reason.matched is the pattern too.
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    status, out = either.call("/generate", {"input_ids": PROMPT, "sampling_params": params})
    assert status == 200, out
    pattern = "(?:" + re.escape(out["text"][2:4]) + ")"
    params["stop_regex"] = [pattern]
    status, out = either.call("/generate", {"input_ids": PROMPT, "sampling_params": params})
    assert status == 200, out
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}


# -- /get_server_info ------------------------------------------------------------------------


def test_server_info_has_max_total_num_tokens(paged, server):
    status, info = paged.call("/get_server_info")
    assert status == 200 and isinstance(info["max_total_num_tokens"], int)
    assert info["max_total_num_tokens"] == paged.call("/get_memory_pool_size")[1]
    # The hf path has no KV pool: the context length.
    status, info = server.call("/get_server_info")
    assert status == 200 and info["engine_path"] == "hf"
    assert info["max_total_num_tokens"] == info["context_length"] > 0


# -- a request the engine refuses ------------------------------------------------------------


@pytest.fixture(scope="module")
def overpromised(model: str) -> Iterator[str]:
    """An app that serves a context of 160 tokens over a paged engine that runs 64 at most, in
    this process on a real port: what the engine refuses gets past the server's own checks."""
    import uvicorn

    from miles.runtime.cluster.process import free_port
    from miles.serve.server import ServeSettings, build_app
    from miles.torch.engine.config import TorchEngineConfig
    from miles.torch.engine.engine import TorchRolloutEngine

    engine = TorchRolloutEngine(
        model, path="paged",
        paged=TorchEngineConfig(max_batch_size=4, max_context=64, kv_cache_tokens=256),
    )  # fmt: skip
    app = build_app(engine, ServeSettings(model_path=model, max_context=CONTEXT))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)


def test_a_request_the_engine_refuses_is_a_400(overpromised, model):
    client = openai.OpenAI(base_url=overpromised + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="the engine refused the request") as caught:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=100)
    assert "max_context 64" in str(caught.value) and caught.value.type == "BadRequestError"
    # Within the engine's limit the same server answers.
    ok = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")
    request = urllib.request.Request(
        overpromised + "/generate",
        data=json.dumps({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 100}}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(request, timeout=60)
    assert http.value.code == 400
    assert "the engine refused the request" in json.loads(http.value.read())["error"]["message"]
