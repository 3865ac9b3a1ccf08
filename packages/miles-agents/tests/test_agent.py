"""Rollout function `agent`: an agent that only speaks the OpenAI API, over real HTTP to the
gateway, in front of a real tiny Qwen3 on the native engine. The sample must be exactly the
tokens the server reported to the agent, call by call, with the agent's own additions masked."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.agents.api import AgentOutcome, AgentRolloutConfig, AgentSession
from miles.agents.calculator import calculator
from miles.agents.rollout import AgentRollout
from miles.core.contracts.protocols import PromptGroup
from miles.core.contracts.types import GenerateRequest, GenerateResult, SampleStatus, SamplingParams

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(1200)


class _Ctx:
    """The rollout context over one in-process engine."""

    def __init__(self, engine: Any, sampling: SamplingParams) -> None:
        self.engine, self.sampling, self.tokenizer = engine, sampling, engine.tokenizer

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        return list(self.engine.results(requests))


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


class Recorder:
    """Chats for `calls` turns, appending a tool message after each reply, and keeps what the
    server answered (with SGLang's RL extensions: token ids and logprobs)."""

    def __init__(self, calls: int = 3, edit_history: bool = False) -> None:
        self.calls, self.edit_history = calls, edit_history
        self.answers: list[dict[str, Any]] = []
        self.statuses: list[int] = []

    def __call__(self, session: AgentSession) -> AgentOutcome:
        messages = [{"role": "user", "content": "add 2 and 3"}]
        for turn in range(self.calls):
            status, answer = post(
                f"{session.base_url}/chat/completions",
                {
                    "model": session.model,
                    "messages": messages,
                    "max_tokens": 6,
                    "temperature": 0.3,  # the run's sampling wins: logprobs stay the trainer's
                    "logprobs": True,
                    "return_token_ids": True,
                },
            )
            self.statuses.append(status)
            if status != 200:
                raise RuntimeError(answer["error"]["message"])
            self.answers.append(answer)
            messages.append(answer["choices"][0]["message"])
            messages.append({"role": "user", "content": f"tool says {turn}"})
            if self.edit_history:
                messages[0] = {"role": "user", "content": "add 2 and 4"}
        return AgentOutcome(0.5, {"seen": len(self.answers)})


def rollout_with(agent: Any) -> AgentRollout:
    rollout = AgentRollout(AgentRolloutConfig())  # the calculator, swapped out below
    rollout.agent = agent
    return rollout


def run_episode(rollout: AgentRollout, engine: Any, max_new_tokens: int = 200) -> Any:
    ctx = _Ctx(engine, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens))
    group = PromptGroup(group_id=3, prompt_ids=[1, 2], row={"q": 1}, sample_ids=[11])
    (sample,) = asyncio.run(rollout(ctx, group))
    return sample


@pytest.fixture(scope="module")
def engine(model: str) -> Any:
    from miles.torch.engine.engine import TorchRolloutEngine

    return TorchRolloutEngine(model, seed=0)


def test_the_sample_is_exactly_what_the_server_reported_to_the_agent(engine: Any) -> None:
    agent = Recorder(calls=3)
    sample = run_episode(rollout_with(agent), engine)
    assert sample.status is SampleStatus.COMPLETED, sample.error
    assert sample.metadata["env_reward"] == 0.5 and sample.metadata["seen"] == 3
    assert sample.metadata["turns"] == 3 and sample.sample_id == 11 and sample.group_id == 3

    ids = sample.prompt_ids + sample.response_ids
    first = agent.answers[0]["choices"][0]
    assert sample.prompt_ids == first["prompt_token_ids"]
    expected_mask = [0] * len(ids)
    expected_logprobs = [0.0] * len(ids)
    for answer in agent.answers:
        choice = answer["choices"][0]
        prompt, generated = choice["prompt_token_ids"], choice["token_ids"]
        # Every call's prompt is the episode so far: the server never re-tokenized a reply.
        assert ids[: len(prompt) + len(generated)] == prompt + generated
        span = range(len(prompt), len(prompt) + len(generated))
        for i, logprob in zip(span, choice["logprobs"]["content"], strict=True):
            expected_mask[i], expected_logprobs[i] = 1, logprob["logprob"]
        text = engine.tokenizer.decode(generated, skip_special_tokens=True)
        assert choice["message"]["content"] == text
    last = agent.answers[-1]["choices"][0]
    assert ids == last["prompt_token_ids"] + last["token_ids"]
    n = len(sample.prompt_ids)
    assert sample.loss_mask == expected_mask[n:]
    assert sample.rollout_logprobs == expected_logprobs[n:]
    # The agent's additions (the reply's closing tokens and the tool message) are in the
    # sequence as the chat template renders them.
    between = ids[len(first["prompt_token_ids"]) + len(first["token_ids"]) :]
    tool_text = engine.tokenizer.decode(between)
    assert "<|im_start|>user\ntool says 0<|im_end|>\n<|im_start|>assistant\n" in tool_text

    # Teacher-forced over exactly these tokens, the model gives the logprobs the engine
    # reported at the run's temperature (1.0), whatever temperature the agent asked for.
    with torch.no_grad():
        logits = engine.model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    for i, trained in enumerate(sample.loss_mask):
        if trained:
            assert abs(logp[n - 1 + i].item() - sample.rollout_logprobs[i]) < 1e-4


def test_a_streamed_episode_trains_on_what_was_streamed(engine: Any) -> None:
    """The official openai client streams two turns through the gateway: the text it pieced
    together is each turn's answer, and the sample holds the same tokens as unstreamed calls."""
    import openai

    streamed: list[str] = []
    finals: list[Any] = []

    def agent(session: AgentSession) -> AgentOutcome:
        client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "add 2 and 3"}]
        for turn in range(2):
            text, last = "", None
            for chunk in client.chat.completions.create(
                model=session.model, messages=messages, max_tokens=6, stream=True,
                stream_options={"include_usage": True}, logprobs=True,
                extra_body={"return_token_ids": True},
            ):  # fmt: skip
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    if choice.finish_reason is not None:
                        last = choice
                if chunk.usage is not None:
                    finals.append(chunk.usage)
            streamed.append(text)
            finals.append(last)
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": f"tool says {turn}"}]  # fmt: skip
        return AgentOutcome(1.0, {})

    sample = run_episode(rollout_with(agent), engine)
    assert sample.status is SampleStatus.COMPLETED, sample.error
    lasts = [f for f in finals if hasattr(f, "finish_reason")]
    usages = [f for f in finals if hasattr(f, "completion_tokens")]
    assert len(lasts) == 2 and len(usages) == 2
    for text, last, usage in zip(streamed, lasts, usages, strict=True):
        ids = (last.model_extra or {})["token_ids"]
        assert text == engine.tokenizer.decode(ids, skip_special_tokens=True)
        assert usage.completion_tokens == len(ids) == len(last.logprobs.content)
        assert ids == sample.response_ids[: len(ids)] or any(
            sample.response_ids[i : i + len(ids)] == ids for i in range(len(sample.response_ids))
        )


def test_an_edited_history_is_refused_and_fails_the_sample_with_the_reason(engine: Any) -> None:
    agent = Recorder(calls=2, edit_history=True)
    sample = run_episode(rollout_with(agent), engine)
    assert agent.statuses == [200, 400]
    assert sample.status is SampleStatus.FAILED
    assert "append to the conversation" in (sample.error or "")
    assert "messages do not start with the previous call's messages" in (sample.error or "")


def test_the_episode_budget_truncates_and_agent_errors_fail_only_their_sample(engine) -> None:
    # rollout.max_new_tokens bounds everything after the first prompt, the agent's messages too.
    sample = run_episode(rollout_with(Recorder(calls=6)), engine, max_new_tokens=20)
    assert sample.status is SampleStatus.TRUNCATED
    assert len(sample.response_ids) <= 20 and len(sample.loss_mask) == len(sample.response_ids)

    def broken(session: AgentSession) -> float:
        post(
            f"{session.base_url}/chat/completions", {"messages": [{"role": "user", "content": "x"}]}
        )
        raise KeyError("no such tool")

    sample = run_episode(rollout_with(broken), engine)
    assert sample.status is SampleStatus.FAILED
    assert sample.error == "the agent raised KeyError: 'no such tool'"


def test_the_gateway_answers_bad_calls_with_clear_errors(engine: Any) -> None:
    seen: dict[str, Any] = {}
    barrier = threading.Event()

    def prober(session: AgentSession) -> float:
        url = session.base_url
        seen["models"] = post(url.replace("/v1", "/v1/models"), {})[0]  # GET only
        seen["bad_json"] = post(f"{url}/chat/completions", {"messages": "hi"})
        seen["unknown"] = post(f"{url}/chat/completions", {"messages": [], "frequency": 1})
        seen["n"] = post(
            f"{url}/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}
        )
        seen["other"] = post(url.replace("/sessions/", "/sessions/x").rstrip("/") + "/completions",
                             {"prompt": "x"})  # fmt: skip
        ok = post(f"{url}/completions", {"prompt": "abc", "max_tokens": 3})
        seen["completion"] = ok
        more = post(f"{url}/completions", {"prompt": "zzz", "max_tokens": 3})
        seen["not_extending"] = more
        barrier.set()
        return 1.0

    sample = run_episode(rollout_with(prober), engine)
    assert barrier.is_set()
    assert seen["models"] == 405
    assert seen["bad_json"][0] == 400 and "messages" in seen["bad_json"][1]["error"]["message"]
    assert seen["unknown"][0] == 400 and "frequency" in seen["unknown"][1]["error"]["message"]
    assert seen["n"][0] == 400 and "n must be 1" in seen["n"][1]["error"]["message"]
    assert seen["other"][0] == 404 and "no open episode" in seen["other"][1]["error"]["message"]
    assert seen["completion"][0] == 200
    assert seen["completion"][1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert seen["not_extending"][0] == 400
    assert sample.status is SampleStatus.FAILED and "prompt text" in (sample.error or "")


def test_the_calculator_tool() -> None:
    assert calculator(["max", "3", "17", "5"]) == "17"
    assert calculator(["max"]) is None and calculator(["7"]) is None
    assert calculator(["max", "3", "x"]) is None


def test_quickstart_agent_learns_through_miles_serve(quickstart_model, tmp_path, serve_process):
    """The example agent trains on CPU, its calls served by `miles serve` behind the sglang
    backend: reward climbs from chance, and the episodes keep using the tool."""
    start_server, stop_server = serve_process
    server = start_server(quickstart_model, tmp_path)
    try:
        run = tmp_path / "run"
        done = subprocess.run(
            [
                sys.executable, "-m", "miles.core.cli", "run", "quickstart-agent",
                "--run-dir", str(run),
                "--set", f"model.path={quickstart_model}",
                "--set", "rollout.backend=sglang",
                "--set", f"rollout.urls=[{server.url}]",
                "--set", "telemetry.progress=false",
            ],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in metrics if "rollout/reward_mean" in m]
        (final,) = [m["eval/reward_mean"] for m in metrics if "eval/reward_mean" in m]
        assert len(steps) == 30 and all(m["rollout/failed"] == 0 for m in steps)
        for m in steps:  # the trainer's logprobs of the agent's tokens are the engine's
            assert m["train/rollout_logprob_abs_diff"] < 1e-4, m
        assert steps[0]["rollout/reward_mean"] < 0.35 and final >= 0.7, (steps[0], final)
        # Two model calls per episode, the tool call and then the answer from its result: the
        # warm-start teaches the call (about 1.8 turns at step 0), and RL must not unlearn it.
        # One step's mean is noisy (1.56 to 1.98 over the last steps of two runs): the last five.
        turns = [m["rollout/turns_mean"] for m in steps[-5:]]
        assert sum(turns) / len(turns) > 1.5, turns
        # Each call is an engine call of its own, and the engine runs many at once (its actor
        # once ran at most 8 streams, so the server never saw a batch of more).
        assert _most_at_once(run / "traces.jsonl", "miles.generate") > 8
    finally:
        stop_server(server)


def _most_at_once(traces: Path, name: str) -> int:
    """The most spans called `name` that were open at the same time."""
    spans = [json.loads(line) for line in traces.read_text().splitlines()]
    edges = sorted(
        (ns, step)
        for s in spans
        if s["name"] == name
        for ns, step in ((s["start_ns"], 1), (s["end_ns"], -1))
    )
    running = most = 0
    for _, step in edges:  # at equal times an end (-1) sorts before a start
        running += step
        most = max(most, running)
    return most


@pytest.fixture(scope="module")
def quickstart_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from miles.recipes import quickstart_task

    model = tmp_path_factory.mktemp("quickstart") / "model"
    quickstart_task.build_model(model, 0)
    return str(model)
