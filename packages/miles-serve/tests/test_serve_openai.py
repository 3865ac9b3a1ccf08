"""`miles serve` as SGLang's server to OpenAI clients: the official `openai` client over HTTP
against a real `miles serve` process (a tiny random model, the engine's paged path on the CPU,
a 160-token context), each answer checked against transformers' own forward where it has numbers.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import jsonschema
import openai
import pytest
import torch
from transformers import AutoTokenizer

CONTEXT = 160  # the `paged` server's context (conftest.py, PAGED_CONTEXT)
PROMPT = [11, 12, 13, 14]


@pytest.fixture(scope="module")
def client(paged: Any) -> openai.OpenAI:
    # Generation is open on loopback (the server made its own key for control calls).
    return openai.OpenAI(base_url=paged.url + "/v1", api_key="unused", max_retries=0)


def log_softmax_at(reference: Any, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: transformers' next-token log_softmax after each prefix of `ids`."""
    with torch.no_grad():
        return torch.log_softmax(reference(input_ids=torch.tensor([ids])).logits[0].float(), -1)


def test_chat_n_samples_with_top_logprobs_equal_transformers(client, paged, model, reference):
    tok = AutoTokenizer.from_pretrained(model)
    out = client.chat.completions.create(
        model=paged.model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=3,
        logprobs=True, top_logprobs=4, seed=3,
        extra_body={"return_token_ids": True, "return_prompt_token_ids": True},
    )  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1, 2]
    total = 0
    for choice in out.choices:
        extra = choice.model_extra or {}
        prompt, ids = extra["prompt_token_ids"], extra["token_ids"]
        total += len(ids)
        content = choice.logprobs.content
        assert len(content) == len(ids) and choice.finish_reason in ("stop", "length")
        logp = log_softmax_at(reference, prompt + ids)
        for i, (entry, token) in enumerate(zip(content, ids, strict=True)):
            row = logp[len(prompt) - 1 + i]
            assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry.token == tok.decode([token])
            want = torch.topk(row, 4)
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
                want.values.tolist(), abs=1e-4
            )
            assert [t.token for t in entry.top_logprobs] == [
                tok.decode([t]) for t in want.indices.tolist()
            ]
    assert out.usage.completion_tokens == total
    assert out.usage.prompt_tokens == len(prompt)  # the prompt once, not once per sample
    # Three samples of one prompt with a seed: not all the same (n is really n samples).
    assert len({tuple((c.model_extra or {})["token_ids"]) for c in out.choices}) > 1


def test_chat_streams_what_it_answers_whole(client, paged):
    kwargs: dict[str, Any] = {
        "model": paged.model, "messages": [{"role": "user", "content": "ab"}], "max_tokens": 10,
        "temperature": 0, "n": 2,
    }  # fmt: skip
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    texts, finish, usage, chunks = {0: "", 1: ""}, {}, None, 0
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert chunks > 3  # the answer came in pieces, not as one object
    for c in whole.choices:  # greedy: the streamed text is the whole answer's
        assert texts[c.index] == c.message.content
        assert finish[c.index] == c.finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_continuous_usage_and_completions_stream(client, paged):
    stream = client.completions.create(
        model=paged.model, prompt="abc", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, logprobs=2,
    )  # fmt: skip
    seen = [c for c in stream]
    assert all(c.usage is not None for c in seen)
    # SGLang's order: the choice's chunks, then (include_usage) the total in a chunk of its own.
    *answer, total = seen
    assert total.choices == [] and answer[-1].choices[0].finish_reason in ("stop", "length")
    # Each chunk carries the logprobs of the tokens it brings (as SGLang streams them).
    streamed = [c.choices[0].logprobs.tokens for c in answer if c.choices[0].logprobs]
    assert total.usage.completion_tokens == sum(len(tokens) for tokens in streamed)
    assert answer[-1].usage.completion_tokens == total.usage.completion_tokens


def test_completions_take_a_list_of_prompts_n_and_echo(client, paged, model, reference):
    tok = AutoTokenizer.from_pretrained(model)
    out = client.completions.create(
        model=paged.model, prompt=["ab", "cd"], n=2, max_tokens=4, temperature=0,
        echo=True, logprobs=2,
    )  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        prompt = "ab" if c.index < 2 else "cd"
        assert c.text.startswith(prompt)
        prompt_ids = tok(prompt)["input_ids"]
        lp = c.logprobs
        assert lp.token_logprobs[0] is None  # the first prompt token has no logprob
        n = len(prompt_ids)
        logp = log_softmax_at(reference, prompt_ids)
        for i in range(1, n):
            assert lp.token_logprobs[i] == pytest.approx(
                logp[i - 1, prompt_ids[i]].item(), abs=1e-4
            )
        assert len(lp.top_logprobs[-1]) == 2 and lp.text_offset[0] == 0
    assert out.choices[0].text == out.choices[1].text  # greedy: both samples the same


def test_no_max_tokens_runs_to_the_context_and_ignore_eos(client, paged):
    out = client.chat.completions.create(
        model=paged.model, messages=[{"role": "user", "content": "hi"}], temperature=0,
        extra_body={"ignore_eos": True, "return_prompt_token_ids": True},
    )  # fmt: skip
    (choice,) = out.choices
    prompt = len((choice.model_extra or {})["prompt_token_ids"])
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == CONTEXT - prompt  # not 16


def test_matched_stop_for_strings_regexes_and_token_ids(paged):
    def chat(**extra: Any) -> dict[str, Any]:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 12,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip
        status, out = paged.call("/v1/chat/completions", body)
        assert status == 200, out
        return out["choices"][0]

    free = chat()
    assert free["finish_reason"] == "length" and free["matched_stop"] is None
    text, ids = free["message"]["content"], free["token_ids"]
    stop = text[3:5]
    hit = chat(stop=[stop])
    assert hit["finish_reason"] == "stop" and hit["matched_stop"] == stop
    assert hit["message"]["content"] == text[: text.find(stop)]
    pattern = re.escape(text[4]) + "."
    regex = chat(stop_regex=pattern)
    assert regex["finish_reason"] == "stop"
    assert re.fullmatch(pattern, regex["matched_stop"]) is not None
    at = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # its first occurrence
    token = chat(stop_token_ids=[ids[at]])
    assert token["matched_stop"] == ids[at] and token["token_ids"] == ids[: at + 1]


def test_json_schema_output_parses_and_validates(client, paged):
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["colour", "ok"],
        "additionalProperties": False,
    }
    for seed in range(3):
        out = client.chat.completions.create(
            model=paged.model, messages=[{"role": "user", "content": "json"}], max_tokens=60,
            seed=seed, response_format={"type": "json_schema",
                                        "json_schema": {"name": "c", "schema": schema}},
        )  # fmt: skip
        value = json.loads(out.choices[0].message.content)
        jsonschema.validate(value, schema)
    out = client.completions.create(
        model=paged.model, prompt="n=", max_tokens=8, extra_body={"regex": "[0-9]{3}"}
    )
    assert re.fullmatch("[0-9]{3}", out.choices[0].text)
    with pytest.raises(openai.BadRequestError, match="regex"):
        client.completions.create(model=paged.model, prompt="n=", extra_body={"regex": "(["})


def test_penalties_change_the_distribution(paged):
    base = {"input_ids": PROMPT, "return_logprob": True}
    params = {"max_new_tokens": 8, "temperature": 0}
    _, plain = paged.call("/generate", {**base, "sampling_params": params})
    ids = plain["output_ids"]
    # Forcing the same tokens through a penalty: the logprobs of repeated tokens must change.
    for name, value in (("repetition_penalty", 1.8), ("frequency_penalty", 1.5)):
        _, out = paged.call("/generate", {**base, "sampling_params": {**params, name: value}})
        assert (
            out["output_ids"] != ids
            or out["meta_info"]["output_token_logprobs"]
            != plain["meta_info"]["output_token_logprobs"]
        ), name


def test_generate_n_top_logprobs_and_prompt_logprobs(paged, reference):
    body = {
        "input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 3,
        "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 4, "n": 2},
    }  # fmt: skip
    status, out = paged.call("/generate", body)
    assert status == 200, out
    assert isinstance(out, list) and len(out) == 2
    logp = log_softmax_at(reference, PROMPT)
    for answer in out:
        meta = answer["meta_info"]
        inputs = meta["input_token_logprobs"]
        assert [e[1] for e in inputs] == PROMPT and inputs[0][0] is None
        for i in range(1, len(PROMPT)):
            assert inputs[i][0] == pytest.approx(logp[i - 1, PROMPT[i]].item(), abs=1e-4)
        tops = meta["output_top_logprobs"]
        assert len(tops) == len(answer["output_ids"]) and all(len(row) == 3 for row in tops)
        assert all(row[0][0] >= row[1][0] >= row[2][0] for row in tops)


def test_prefix_cache_shows_in_cached_tokens(client, paged):
    prompt = list(range(20, 84))  # 64 tokens: whole pages to reuse
    first = client.completions.create(model=paged.model, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=paged.model, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_responses_api(client, paged):
    out = client.responses.create(
        model=paged.model, input="hello", instructions="be brief", max_output_tokens=5,
        store=False,
    )  # fmt: skip
    # Cut at max_output_tokens: completed, as SGLang answers; the message item says incomplete.
    assert out.status == "completed" and out.incomplete_details is None
    assert isinstance(out.output_text, str)
    assert out.usage.output_tokens <= 5 and out.usage.input_tokens > 0
    with pytest.raises(openai.NotFoundError, match="not found"):  # store: false kept nothing
        client.responses.retrieve(out.id)


def test_responses_are_stored_continued_retrieved_and_deleted(client, paged):
    first = client.responses.create(
        model=paged.model, input="hello", instructions="be brief", max_output_tokens=6,
        temperature=0,
    )  # fmt: skip
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(
        model=paged.model, input="and again", previous_response_id=first.id,
        max_output_tokens=4, temperature=0,
    )  # fmt: skip
    # The continuation's prompt is the conversation: the first input, its answer as the
    # assistant's turn, then the new input (the first's instructions are not carried over).
    conversation = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and again"},
    ]
    chat = client.chat.completions.create(model=paged.model, messages=conversation, max_tokens=1)
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id
    assert client.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model=paged.model, input="x", previous_response_id=first.id)
    with pytest.raises(openai.BadRequestError, match="begins with 'resp'"):
        client.responses.retrieve("nope")
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(model=paged.model, input="x", background=True)


def test_responses_stream_openais_events(model: str, serve_process: Any, tmp_path: Any) -> None:
    # A server whose steps take 50 ms, one token each: the text comes in several deltas whatever
    # the machine (a tiny model's steps on an idle one can end before the stream reads one).
    start_server, stop_server = serve_process
    slow = start_server(model, tmp_path, "--engine-path", "paged", "--context-length", "160",
                        slow=0.05)  # fmt: skip
    try:
        client = openai.OpenAI(base_url=slow.url + "/v1", api_key="unused", max_retries=0)
        kwargs: dict[str, Any] = {
            "model": slow.model, "input": "hello", "max_output_tokens": 12, "temperature": 0,
            "store": False,
        }  # fmt: skip
        whole = client.responses.create(**kwargs)
        events = list(client.responses.create(**kwargs, stream=True))
    finally:
        stop_server(slow)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1  # as it is generated, not all at the end
    assert "".join(deltas) == whole.output_text == events[-4].text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens > 1


def test_score_equals_transformers(paged, reference):
    query, items, labels = [11, 12], [[13], [14, 15]], [5, 6, 7]
    status, out = paged.call(
        "/v1/score",
        {"query": query, "items": items, "label_token_ids": labels, "apply_softmax": True},
    )
    assert status == 200, out
    for item, row in zip(items, out["scores"], strict=True):
        logits = log_softmax_at(reference, query + item)[-1][labels]
        want = torch.softmax(logits, -1).tolist()
        assert row == pytest.approx(want, abs=1e-4) and math.isclose(sum(row), 1, abs_tol=1e-6)


def test_models_errors_and_context_wording(client, paged):
    models = client.models.list().data
    assert models[0].id == paged.model
    card = models[0].model_extra or {}
    assert card["max_model_len"] == CONTEXT and card["root"] == paged.model
    assert client.models.retrieve(paged.model).id == paged.model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    status, out = paged.call("/no/such/route")
    assert status == 404 and "error" in out and "detail" not in out
    long = "ab" * CONTEXT
    with pytest.raises(openai.BadRequestError, match="is longer than the model's context length"):
        client.chat.completions.create(
            model=paged.model, messages=[{"role": "user", "content": long}]
        )
    with pytest.raises(openai.BadRequestError, match="exceeds the model's maximum context"):
        client.chat.completions.create(
            model=paged.model, messages=[{"role": "user", "content": "a"}], max_tokens=CONTEXT
        )
    status, out = paged.call("/get_memory_pool_size")
    assert status == 200 and isinstance(out, int) and out > CONTEXT


def test_unknown_fields_are_still_400_by_name(paged):
    status, out = paged.call(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "bogus": 1}
    )
    assert status == 400 and "'bogus'" in out["error"]["message"]
    status, out = paged.call(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "custom_logit_processor": "x"},
    )
    assert status == 400 and "custom_logit_processor" in out["error"]["message"]


def test_the_hf_path_serves_the_same_features(server, model, reference):
    """The engine's other path (`miles serve`'s default on the CPU): n samples with top
    logprobs, a stream, and structured output, through the official client."""
    hf = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    status, info = server.call("/get_server_info")
    assert status == 200 and info["engine_path"] == "hf"
    out = hf.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=4, n=2, logprobs=3, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1]
    ids = (out.choices[0].model_extra or {})["token_ids"]
    logp = log_softmax_at(reference, PROMPT + ids)
    for i, top in enumerate(out.choices[0].logprobs.top_logprobs):
        want = torch.topk(logp[len(PROMPT) - 1 + i], 3).values.tolist()
        assert sorted(top.values(), reverse=True) == pytest.approx(want, abs=1e-4)
    text = "".join(
        c.choices[0].text
        for c in hf.completions.create(
            model=server.model, prompt=PROMPT, max_tokens=4, temperature=0, stream=True
        )
    )
    assert text == out.choices[0].text
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    value = hf.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "json"}], max_tokens=40,
        seed=1, response_format={"type": "json_schema",
                                 "json_schema": {"name": "o", "schema": schema}},
    ).choices[0].message.content  # fmt: skip
    jsonschema.validate(json.loads(value), schema)
    status, out = server.call("/get_memory_pool_size")
    assert status == 400 and "no KV memory pool" in out["error"]["message"]


def test_the_paged_engine_runs_what_the_served_context_allows(
    serve_process_for_module: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The engine's KV cache and longest request follow the served context: a model allowing
    8192 tokens, served with a 6000-token KV cache, reports 6000, and runs a 4500-token prompt
    (over the engine's rollout default of 4096, which once aborted every such request)."""
    from miles.torch.testing import make_tiny_model

    long_model = make_tiny_model(
        tmp_path_factory.mktemp("long") / "model", vocab_size=128, max_position_embeddings=8192
    )
    start_server, stop_server = serve_process_for_module
    server = start_server(
        long_model, tmp_path_factory.mktemp("serve-long"),
        "--engine-path", "paged", "--max-total-tokens", "6000",
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        (entry,) = client.models.list().data
        assert entry.model_dump()["max_model_len"] == 6000
        prompt = [int(i) % 100 + 3 for i in range(4500)]
        out = client.completions.create(model=entry.id, prompt=prompt, max_tokens=8, temperature=0)
        assert out.choices[0].finish_reason == "length", out
        assert out.usage.prompt_tokens == 4500 and out.usage.completion_tokens == 8
        # Past the served context: refused up front, in SGLang's wording.
        with pytest.raises(
            openai.BadRequestError, match="exceeds the model's maximum context length of 6000"
        ):
            client.completions.create(model=entry.id, prompt=prompt, max_tokens=1600)
    finally:
        stop_server(server)


def test_a_repeated_prompt_reports_every_token_but_the_last_as_cached(
    model: str, serve_process_for_module: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """As SGLang's radix cache with its default page size of 1: the second time a prompt is
    sent, all of it but the last token (whose logits must be computed) comes from the cache, and
    the answer is the same as with no cache hit; 16-token pages reuse whole pages only."""
    start_server, stop_server = serve_process_for_module
    prompt = [int(i) % 90 + 5 for i in range(37)]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    cached, outputs = {}, {}
    for page_size in (1, 16):
        server = start_server(
            model, tmp_path_factory.mktemp(f"serve-page{page_size}"), "--engine-path", "paged",
            "--page-size", str(page_size),
        )  # fmt: skip
        try:
            first, second = (server.call("/generate", body)[1] for _ in range(2))
            # SGLang's cache_salt: a salted request shares cached prefixes only with its salt.
            salted = [
                server.call("/generate", {**body, "cache_salt": salt})[1]
                for salt in ("tenant-a", "tenant-a", "tenant-b")
            ]
            # logprob_start_len without return_logprob asks for nothing (SGLang): still a hit.
            unasked = {**body, "logprob_start_len": 0, "return_logprob": False}
            third = server.call("/generate", unasked)[1]
        finally:
            stop_server(server)
        assert third["meta_info"]["cached_tokens"] == cached_hit(page_size)
        assert "input_token_logprobs" not in third["meta_info"]
        assert [s["meta_info"]["cached_tokens"] for s in salted] == [0, cached_hit(page_size), 0]
        assert all(s["output_ids"] == first["output_ids"] for s in salted)
        assert first["meta_info"]["cached_tokens"] == 0
        assert first["output_ids"] == second["output_ids"]
        cached[page_size] = second["meta_info"]["cached_tokens"]
        outputs[page_size] = second["output_ids"]
    assert cached == {1: cached_hit(1), 16: cached_hit(16)} == {1: 36, 16: 32}
    assert outputs[1] == outputs[16]


def cached_hit(page_size: int) -> int:
    """Cached tokens of the 37-token prompt sent again: all but the last, in whole pages."""
    return (37 - 1) // page_size * page_size


def test_cache_salt_is_checked(paged: Any) -> None:
    for path, body in (
        ("/generate", {"input_ids": PROMPT, "cache_salt": 5}),
        ("/generate", {"input_ids": PROMPT, "cache_salt": ""}),
        ("/v1/completions", {"prompt": PROMPT, "cache_salt": ["a"]}),
    ):
        status, answer = paged.call(path, body)
        assert status == 400 and "cache_salt" in json.dumps(answer), answer
