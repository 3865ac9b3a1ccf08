"""Rollout function `agent` over real HTTP with real chat templates (Qwen3's, on a tiny tokenizer)
and a scripted model: multi-turn thinking agents, input_ids calls between messages calls, and
what a refused call leaves in the sample, the metrics and samples.jsonl."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from miles.agents.api import AgentOutcome, AgentRolloutConfig, AgentSession
from miles.agents.rollout import AgentRollout
from miles.core.contracts.protocols import PromptGroup
from miles.core.contracts.types import (
    GenerateRequest,
    GenerateResult,
    Sample,
    SampleStatus,
    SamplingParams,
)
from miles.runtime.rollout.ledger import SampleLedger
from miles.runtime.rollout.rollout_metrics import agent_metrics

THINK = "<think>\nthe tool knows\n</think>\n\n"
TOOL_TURN = (
    "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)


class Scripted:
    """The rollout context over a scripted model: each call writes the next reply, then ends its
    turn (`<|im_end|>`)."""

    def __init__(self, tokenizer: Any, replies: list[str]) -> None:
        self.tokenizer, self.replies = tokenizer, list(replies)
        self.sampling = SamplingParams(temperature=1.0, max_new_tokens=400)
        self.prompts: list[list[int]] = []

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        out = []
        for r in requests:
            self.prompts.append(list(r.prompt_ids))
            text = self.replies.pop(0)
            ids = [
                *self.tokenizer.encode(text, add_special_tokens=False),
                self.tokenizer.eos_token_id,
            ]
            out.append(GenerateResult(r.request_id, ids, [-0.5] * len(ids), "stop", 0))
        return out


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


class Agent:
    """Sends `turns` (each: new messages, or a function of the answers so far giving input_ids),
    appending every reply; keeps the statuses and answers."""

    def __init__(self, turns: list[Any], kwargs: dict[str, Any] | None = None) -> None:
        self.turns, self.kwargs = turns, kwargs or {}
        self.statuses: list[int] = []
        self.answers: list[dict[str, Any]] = []

    def __call__(self, session: AgentSession) -> AgentOutcome:
        messages: list[dict[str, Any]] = []
        for turn in self.turns:
            body: dict[str, Any] = {"messages": messages, "return_token_ids": True}
            if callable(turn):  # an input_ids call: the messages it stands for, and its tokens
                new, body["input_ids"] = turn(self.answers)
            else:
                new = turn
            messages += new
            if self.kwargs:
                body["chat_template_kwargs"] = self.kwargs
            status, answer = post(f"{session.base_url}/chat/completions", body)
            self.statuses.append(status)
            if status != 200:
                raise RuntimeError(answer["error"]["message"])
            self.answers.append(answer["choices"][0])
            messages.append(answer["choices"][0]["message"])
        return AgentOutcome(1.0)


def episode(tokenizer: Any, agent: Agent, replies: list[str]) -> tuple[Sample, Scripted]:
    rollout = AgentRollout(AgentRolloutConfig())
    rollout.agent = agent
    ctx = Scripted(tokenizer, replies)
    group = PromptGroup(group_id=0, prompt_ids=[1], row={}, sample_ids=[5])
    (sample,) = asyncio.run(rollout(ctx, group))
    return sample, ctx


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def tool(text: str) -> list[dict[str, Any]]:
    return [{"role": "tool", "content": text}]


@pytest.mark.parametrize("thinking", [True, False])
def test_a_qwen3_agent_takes_turns_with_a_tool_and_the_user(
    thinking: bool, chat_tokenizer: Any
) -> None:
    tok = chat_tokenizer("qwen3")
    think = THINK if thinking else ""
    agent = Agent(
        [user("largest of 3 7?"), tool("7"), user("thanks")],
        {} if thinking else {"enable_thinking": False},
    )
    sample, ctx = episode(tok, agent, [think + "max 3 7", think + "7", think + "ok"])
    assert agent.statuses == [200, 200, 200], sample.error
    assert sample.status is SampleStatus.COMPLETED and sample.metadata["turns"] == 3
    ids = sample.prompt_ids + sample.response_ids
    for choice, prompt in zip(agent.answers, ctx.prompts, strict=True):
        assert choice["prompt_token_ids"] == prompt  # what the engine got, the agent was told
        # Every call's prompt and reply are in the sample as they were, thinking included.
        assert ids[: len(prompt) + len(choice["token_ids"])] == prompt + choice["token_ids"]
    assert ids == ctx.prompts[-1] + agent.answers[-1]["token_ids"]
    first = agent.answers[0]
    after = ids[len(first["prompt_token_ids"]) + len(first["token_ids"]) :]
    no_think = "" if thinking else "<think>\n\n</think>\n\n"
    assert tok.decode(after).startswith(TOOL_TURN + no_think + think + "7")
    assert tok.decode(ids).count("<think>") == 3  # each turn's, as the engine saw them
    n = len(sample.prompt_ids)
    trained = [ids[n + i] for i, m in enumerate(sample.loss_mask or []) if m]
    assert trained == [t for a in agent.answers for t in a["token_ids"]]
    # Qwen3's template would render this conversation into other tokens: the drift metric says so.
    assert sample.metadata["agent_retemplate_drift"] is True
    assert agent_metrics([sample]) == {"agent/refused": 0.0, "agent/retemplate_drift_frac": 1.0}


def test_input_ids_between_messages_calls_that_are_not_the_messages_are_refused_later(
    chat_tokenizer: Any, tmp_path: Path
) -> None:
    tok = chat_tokenizer("qwen3")

    def own_tokens(answers: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
        last = answers[-1]  # the agent's own rendering of a tool result: not the template's
        mine = tok.encode(
            "\n<|im_start|>user\nresult: 7<|im_end|>\n<|im_start|>assistant\n",
            add_special_tokens=False,
        )
        return tool("7"), last["prompt_token_ids"] + last["token_ids"] + mine

    agent = Agent([user("largest of 3 7?"), own_tokens, user("thanks")])
    sample, _ = episode(tok, agent, ["max 3 7", "7", "ok"])
    assert agent.statuses == [200, 200, 400]
    assert sample.status is SampleStatus.FAILED
    assert "(messages_after_input_ids)" in (sample.error or "") and "call 2 sent input_ids" in (
        sample.error or ""
    )
    assert sample.metadata["agent_refused"] == "messages_after_input_ids"
    assert "agent_retemplate_drift" not in sample.metadata
    assert agent_metrics([sample]) == {
        "agent/refused/messages_after_input_ids": 1.0,
        "agent/refused": 1.0,
    }
    # samples.jsonl names the reason.
    ledger = SampleLedger(tmp_path / "samples.jsonl")
    ledger.record([sample], step=0, fate="trained")
    (row,) = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert row["status"] == "failed" and "messages_after_input_ids" in row["error"]


def test_input_ids_that_are_the_messages_rendering_let_messages_calls_go_on(
    chat_tokenizer: Any,
) -> None:
    tok = chat_tokenizer("qwen3")

    def template_tokens(answers: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
        last = answers[-1]  # as the gateway appends a tool result after a reply ending <|im_end|>
        turn = tok.encode(TOOL_TURN, add_special_tokens=False)
        return tool("7"), last["prompt_token_ids"] + last["token_ids"] + turn

    agent = Agent([user("largest of 3 7?"), template_tokens, user("thanks")])
    sample, ctx = episode(tok, agent, ["max 3 7", "7", "ok"])
    assert agent.statuses == [200, 200, 200] and sample.status is SampleStatus.COMPLETED
    ids = sample.prompt_ids + sample.response_ids
    assert ids == ctx.prompts[-1] + agent.answers[-1]["token_ids"]
    text = tok.decode(ids)
    # The third call appended only its own message: turn 2 was not rendered a second time.
    assert text.count("<tool_response>") == 1 and text.count("thanks") == 1
    assert text.endswith("<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\nok<|im_end|>")


def test_refusals_and_drift_are_counted_over_a_batch() -> None:
    samples = [
        Sample(prompt_ids=[1], metadata={"agent_refused": "edited_history"}),
        Sample(prompt_ids=[1], metadata={"agent_refused": "edited_history"}),
        Sample(prompt_ids=[1], metadata={"agent_refused": "template_error"}),
        Sample(prompt_ids=[1], metadata={"agent_retemplate_drift": True}),
        Sample(prompt_ids=[1], metadata={"agent_retemplate_drift": False}),
        Sample(prompt_ids=[1], metadata={"turns": 2}),  # another rollout function's sample
    ]
    assert agent_metrics(samples) == {
        "agent/refused/edited_history": 2.0,
        "agent/refused/template_error": 1.0,
        "agent/refused": 3.0,
        "agent/retemplate_drift_frac": 0.5,
    }
    assert agent_metrics(samples[-1:]) == {}
