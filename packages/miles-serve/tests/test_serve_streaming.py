"""`miles serve`'s OpenAI streams chunk by chunk, as SGLang sends them: each chunk carries the
logprobs of the tokens it brings, one choice per chunk (n samples, lists of prompts), the prompt
first with `echo`, and chat deltas that name reasoning_content and tool_calls. The official
`openai` client (and raw server-sent events) over HTTP against a real `miles serve` on both engine
paths; greedy answers streamed and unstreamed must agree token for token.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from miles.sglang import openai as wire_openai
from miles.sglang.openai import Choice
from miles.sglang.openai_chunks import finished_stream

CONTEXT = 160
PROMPT = [11, 12, 13, 14]
# Runs to max_tokens, special tokens kept in the text: each token's text is part of the text.
WHOLE = {"ignore_eos": True, "skip_special_tokens": False}
EMPTY_DELTA = {"content": None, "reasoning_content": None, "tool_calls": None}


@pytest.fixture(scope="module", params=["paged", "hf"])
def served(
    request: pytest.FixtureRequest,
    model: str,
    tmp_path_factory: pytest.TempPathFactory,
    serve_process_for_module: Any,
) -> Iterator[Any]:
    start_server, stop_server = serve_process_for_module
    server = start_server(
        model, tmp_path_factory.mktemp(f"serve-stream-{request.param}"),
        "--engine-path", request.param, "--context-length", str(CONTEXT),
    )  # fmt: skip
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(served: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def events(served: Any, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON objects of a raw server-sent event stream, `[DONE]` checked and dropped."""
    status, text = served.call(path, {**body, "stream": True})
    assert status == 200, text
    data = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_completions_chunks_carry_their_tokens_logprobs(client, served):
    kwargs: dict[str, Any] = {
        "model": served.model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
        "logprobs": 3, "extra_body": WHOLE,
    }  # fmt: skip
    whole = client.completions.create(**kwargs).choices[0]
    seen = list(client.completions.create(**kwargs, stream=True))
    assert len(seen) > 1  # in pieces, not one last chunk
    text, tokens, logprobs, tops, offsets = "", [], [], [], []
    for chunk in seen:
        (choice,) = chunk.choices
        lp = choice.logprobs
        assert lp is not None and lp.tokens, "a chunk without its tokens' logprobs"
        assert "".join(lp.tokens) == choice.text  # this chunk's tokens make this chunk's text
        assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        assert all(isinstance(top, dict) and len(top) > 0 for top in lp.top_logprobs)
        text += choice.text
        tokens += lp.tokens
        logprobs += lp.token_logprobs
        tops += lp.top_logprobs
        offsets += lp.text_offset
    assert seen[-1].choices[0].finish_reason == whole.finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in seen[:-1])
    assert text == whole.text == "".join(tokens)
    assert tokens == whole.logprobs.tokens and len(tokens) == 12
    assert logprobs == pytest.approx(whole.logprobs.token_logprobs, abs=1e-4)
    assert offsets == whole.logprobs.text_offset  # offsets into the whole text, not the chunk's
    for got, want in zip(tops, whole.logprobs.top_logprobs, strict=True):
        assert got.keys() == want.keys()
        assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)


def test_chat_chunks_carry_their_tokens_logprobs_and_top_k(client, served):
    kwargs: dict[str, Any] = {
        "model": served.model, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 3,
        "extra_body": WHOLE,
    }  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    seen = list(client.chat.completions.create(**kwargs, stream=True))
    role, body, last = seen[0].choices[0], seen[1:-1], seen[-1].choices[0]
    assert role.delta.role == "assistant" and role.delta.content == "" and role.logprobs is None
    assert len(body) > 1
    text, entries = "", []
    for chunk in body:
        (choice,) = chunk.choices
        assert choice.finish_reason is None and choice.delta.role is None
        content = choice.logprobs.content
        assert content, "a content chunk without its tokens' logprobs"
        assert "".join(e.token for e in content) == choice.delta.content
        for entry in content:
            assert entry.bytes == list(entry.token.encode())
            assert len(entry.top_logprobs) == 3
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        text += choice.delta.content
        entries += content
    # The end in a chunk of its own: no text, no logprobs (SGLang's finish chunk).
    assert last.finish_reason == whole.finish_reason == "length" and last.logprobs is None
    assert last.delta.content is None
    assert text == whole.message.content
    want = whole.logprobs.content
    assert [e.token for e in entries] == [e.token for e in want] and len(entries) == 10
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in want], abs=1e-4)
    for got, expected in zip(entries, want, strict=True):
        assert [t.token for t in got.top_logprobs] == [t.token for t in expected.top_logprobs]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(
            [t.logprob for t in expected.top_logprobs], abs=1e-4
        )


def test_one_choice_per_chunk_for_prompt_lists_and_n(client, served):
    kwargs: dict[str, Any] = {
        "model": served.model, "prompt": ["ab", "cd"], "n": 2, "max_tokens": 6,
        "temperature": 0, "extra_body": WHOLE,
    }  # fmt: skip
    whole = client.completions.create(**kwargs)
    texts: dict[int, str] = defaultdict(str)
    finished: Counter[int] = Counter()
    usage = None
    stream = client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        (choice,) = chunk.choices  # never several choices in one chunk
        texts[choice.index] += choice.text
        finished[choice.index] += choice.finish_reason is not None
    assert texts == {c.index: c.text for c in whole.choices} and len(texts) == 4
    assert finished == {0: 1, 1: 1, 2: 1, 3: 1}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens == 24

    chat = {"model": served.model, "messages": [{"role": "user", "content": "ab"}],
            "max_tokens": 6, "temperature": 0, "n": 2, "extra_body": WHOLE}  # fmt: skip
    answer = client.chat.completions.create(**chat)
    order: dict[int, list[str]] = defaultdict(list)
    said: dict[int, str] = defaultdict(str)
    for chunk in client.chat.completions.create(**chat, stream=True):
        (choice,) = chunk.choices
        kind = "role" if choice.delta.role else "end" if choice.finish_reason else "text"
        order[choice.index].append(kind)
        said[choice.index] += choice.delta.content or ""
    for index in (0, 1):  # each choice: its role first, its end last, once each
        kinds = order[index]
        assert kinds[0] == "role" and kinds[-1] == "end" and set(kinds[1:-1]) == {"text"}
    assert said == {c.index: c.message.content for c in answer.choices}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_chunks_carry_their_token_ids_and_their_choices_usage(served, path):
    """SGLang's stream: with return_token_ids each chunk brings the ids of its tokens (joined,
    the answer's) and a choice's first chunk its prompt's ids; with continuous_usage_stats each
    chunk counts its own choice so far, and include_usage still ends with the request's total."""
    chat = path.endswith("chat/completions")
    prompt = {"messages": [{"role": "user", "content": "ab"}]} if chat else {"prompt": "ab"}
    body = {
        **prompt, "max_tokens": 7, "temperature": 0, "n": 2, **WHOLE, "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    status, whole = served.call(path, {k: v for k, v in body.items() if k != "stream_options"})
    assert status == 200, whole
    expected = {c["index"]: c for c in whole["choices"]}
    seen = events(served, path, body)
    *chunks, total = seen
    assert total["choices"] == [] and total["usage"]["completion_tokens"] == 14
    ids: dict[int, list[int]] = defaultdict(list)
    prompts: dict[int, list[tuple[int, list[int]]]] = defaultdict(list)  # (chunk number, ids)
    counts: dict[int, list[int]] = defaultdict(list)
    carrying: Counter[int] = Counter()  # chunks that bring token ids, per choice
    texts: Counter[int] = Counter()  # chunks that bring text, per choice
    for event in chunks:
        (choice,) = event["choices"]
        index = choice["index"]
        if "prompt_token_ids" in choice:
            prompts[index].append((len(counts[index]), choice["prompt_token_ids"]))
        ids[index] += choice.get("token_ids", [])
        carrying[index] += bool(choice.get("token_ids"))
        texts[index] += bool(choice["delta"]["content"] if chat else choice["text"])
        usage = event["usage"]  # this choice's counts, not the request's
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["prompt_tokens"] == len(expected[index]["prompt_token_ids"])
        counts[index].append(usage["completion_tokens"])
    for index, want in expected.items():
        assert ids[index] == want["token_ids"]  # joined, exactly the unstreamed answer's ids
        # Once, in the choice's first chunk (chat: its role chunk, before any text).
        assert prompts[index] == [(0, want["prompt_token_ids"])]
        # The ids come as they are made: when the text came in several chunks, so did they (how
        # many chunks a fast engine's steps make depends on the machine: one is possible).
        if texts[index] > 1:
            assert carrying[index] > 1
        assert counts[index] == sorted(counts[index]) and counts[index][-1] == 7


@pytest.mark.parametrize("prompt", ["ab", ["ab", "cd"], PROMPT], ids=["text", "list", "ids"])
def test_echo_streams_the_prompt_first(client, served, model, prompt):
    kwargs: dict[str, Any] = {
        "model": served.model, "prompt": prompt, "max_tokens": 5, "temperature": 0,
        "echo": True, "logprobs": 2, "extra_body": WHOLE,
    }  # fmt: skip
    whole = client.completions.create(**kwargs)
    tok = AutoTokenizer.from_pretrained(model)
    prompts = prompt if isinstance(prompt, list) and isinstance(prompt[0], str) else [prompt]
    echoed = [p if isinstance(p, str) else tok.decode(p) for p in prompts]
    first: dict[int, Any] = {}
    texts: dict[int, str] = defaultdict(str)
    tokens: dict[int, list[str]] = defaultdict(list)
    logprobs: dict[int, list[float | None]] = defaultdict(list)
    offsets: dict[int, list[int]] = defaultdict(list)
    for chunk in client.completions.create(**kwargs, stream=True):
        (choice,) = chunk.choices
        first.setdefault(choice.index, choice)
        texts[choice.index] += choice.text
        tokens[choice.index] += choice.logprobs.tokens
        logprobs[choice.index] += choice.logprobs.token_logprobs
        offsets[choice.index] += choice.logprobs.text_offset
    assert sorted(first) == [c.index for c in whole.choices] == list(range(len(prompts)))
    for c in whole.choices:
        head = first[c.index]
        assert head.text.startswith(echoed[c.index]) and len(head.text) > len(echoed[c.index])
        # The prompt's tokens come first, its first token without a logprob.
        assert head.logprobs.token_logprobs[0] is None
        assert "".join(head.logprobs.tokens).startswith(echoed[c.index])
        assert texts[c.index] == c.text and c.text.startswith(echoed[c.index])
        assert tokens[c.index] == c.logprobs.tokens
        assert offsets[c.index] == c.logprobs.text_offset
        assert logprobs[c.index][0] is None and c.logprobs.token_logprobs[0] is None
        assert logprobs[c.index][1:] == pytest.approx(c.logprobs.token_logprobs[1:], abs=1e-4)
    plain = client.completions.create(
        model=served.model, prompt=prompt, max_tokens=5, temperature=0, stream=True, echo=True
    )
    heads: dict[int, str] = {}
    for chunk in plain:  # without logprobs too
        (choice,) = chunk.choices
        heads.setdefault(choice.index, choice.text)
    assert all(heads[i].startswith(echoed[i]) for i in range(len(prompts)))


def test_chat_deltas_name_reasoning_content_and_tool_calls(client, served):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2,
            "temperature": 0}  # fmt: skip
    seen = events(served, "/v1/chat/completions", body)
    assert all(len(e["choices"]) == 1 for e in seen)
    for choice in (e["choices"][0] for e in seen):
        delta = choice["delta"]
        assert "reasoning_content" in delta and delta["reasoning_content"] is None
        assert "tool_calls" in delta and delta["tool_calls"] is None
        if choice["finish_reason"] is not None:
            assert delta == EMPTY_DELTA
    assert sum(e["choices"][0]["finish_reason"] is not None for e in seen) == 2
    # The official client reads them off every chunk, as SGLang's tests do.
    stream = client.chat.completions.create(model=served.model, stream=True, **body)
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert delta.reasoning_content is None and delta.tool_calls is None  # type: ignore[attr-defined]


def test_a_finished_answers_stream_names_them_too():
    """The agent gateway's stream of an answer made whole (`finished_stream`)."""
    request = wire_openai.parse_chat(
        {"messages": [{"role": "user", "content": "x"}], "stream": True, "logprobs": True}
    )
    result = {
        "text": "ab",
        "output_ids": [5, 6],
        "meta_info": {
            "id": "r1", "finish_reason": {"type": "length", "length": 2}, "cached_tokens": 0,
            "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]],
        },
    }  # fmt: skip
    raw = finished_stream(request, "chat.completion.chunk", "m", Choice(0, [1], result),
                          {5: "a", 6: "b"}.__getitem__)  # fmt: skip
    assert raw[-1] == b"data: [DONE]\n\n"
    seen = [json.loads(e.decode().removeprefix("data: ")) for e in raw[:-1]]
    deltas = [e["choices"][0]["delta"] for e in seen]
    assert deltas[0] == {"role": "assistant", "content": "", "reasoning_content": None,
                         "tool_calls": None}  # fmt: skip
    assert "".join(d["content"] or "" for d in deltas) == "ab"
    assert deltas[-1] == EMPTY_DELTA
    assert all(d["reasoning_content"] is None and d["tool_calls"] is None for d in deltas)
    last = seen[-1]["choices"][0]
    assert last["finish_reason"] == "length"
    assert [e["logprob"] for e in last["logprobs"]["content"]] == [-0.5, -0.25]
