"""The example agent: a tool-using calculator that talks to its model only through the OpenAI
chat API, and the `quickstart-agent` recipe that trains it on a laptop CPU.

Each turn the model either calls the calculator, `max 3 17 5` (the tool's reply, `17`, comes
back as the next message), or answers with one number, which ends the episode: reward 1 if it is
the row's answer, else 0. Anything else, or running out of calls, ends it with 0. The agent is
ordinary client code (urllib here; the `openai` package works the same way): it never sees a
token id, and the run still trains on exactly the tokens the model produced.
"""

from __future__ import annotations

import json
import random
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.agents.api import AgentOutcome, AgentSession
from miles.core.config import RunConfig
from miles.core.contracts.recipe import Recipe
from miles.recipes.quickstart import CONFIG as QUICKSTART
from miles.recipes.quickstart import twin_config

TOOL = "max"


@dataclass
class CalculatorAgentConfig:
    answer_key: str = "answer"
    max_calls: int = 3  # model calls per episode
    max_tokens: int = 8  # tokens per model call
    # Ask for server-sent events, as most agent frameworks' OpenAI clients do.
    stream: bool = True

    def __post_init__(self) -> None:
        if self.max_calls < 1 or self.max_tokens < 1:
            raise ValueError("max_calls and max_tokens must be >= 1")


def calculator(words: list[str]) -> str | None:
    """`max a b c` -> the largest of the numbers; None when it is not such a call."""
    if len(words) < 2 or words[0] != TOOL or not all(w.isdigit() for w in words[1:]):
        return None
    return str(max(int(w) for w in words[1:]))


class CalculatorAgent:
    def __init__(self, config: CalculatorAgentConfig) -> None:
        self.config = config

    def __call__(self, session: AgentSession) -> AgentOutcome:
        messages: list[dict[str, Any]] = [{"role": "user", "content": session.row["prompt"]}]
        tool_calls = 0
        for _ in range(self.config.max_calls):
            reply = self._chat(session, messages)
            words = reply.split()
            messages.append({"role": "assistant", "content": reply})
            if (result := calculator(words)) is not None:
                tool_calls += 1
                messages.append({"role": "user", "content": result})
                continue
            correct = len(words) == 1 and words[0] == str(session.row[self.config.answer_key])
            return AgentOutcome(float(correct), {"tool_calls": tool_calls})
        return AgentOutcome(0.0, {"tool_calls": tool_calls})

    def _chat(self, session: AgentSession, messages: list[dict[str, Any]]) -> str:
        body = {
            "model": session.model,
            "messages": messages,
            "max_tokens": self.config.max_tokens,
            "stream": self.config.stream,
        }
        request = urllib.request.Request(
            f"{session.base_url}/chat/completions",
            data=json.dumps(body).encode(),
            headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {session.api_key}",
            },
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            if not self.config.stream:
                answer = json.loads(response.read())
                return str(answer["choices"][0]["message"]["content"] or "")
            return _streamed_content(response)


def _streamed_content(response: Any) -> str:
    """The reply's text from a chat stream: each event's `delta.content`, up to `[DONE]`."""
    parts = []
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            break
        for choice in json.loads(data)["choices"]:
            parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts)


# -- the recipe ----------------------------------------------------------------------------------

CONFIG: dict[str, Any] = {
    **QUICKSTART,
    "name": "quickstart-agent",
    "rollout": {
        **QUICKSTART["rollout"],
        # One episode's tokens after the first prompt: a call, the tool's reply, an answer.
        "max_new_tokens": 24,
        "function": {"name": "agent", "agent": "calculator"},
    },
    "reward": {"name": "env"},
    "eval": {"temperature": 0.0, "max_prompts": 128},
}


def write_format_data(path: Path, rl_rows: Path, seed: int) -> None:
    """SFT rows that teach the turn format only, never which number is right: a first turn
    that calls the calculator on the prompt's numbers (or, sometimes, answers with a random one
    of them), and a turn after the tool's reply that answers with a random one of them. RL
    then starts near chance and has to find that the tool's reply is the answer."""
    rng = random.Random(seed)
    with rl_rows.open() as source, path.open("w") as out:
        for line in source:
            prompt = json.loads(line)["prompt"]
            numbers = prompt.split()[1:]
            call = " ".join([TOOL, *numbers])
            draw = rng.random()
            row: dict[str, Any]
            if draw < 0.4:
                row = {"prompt": prompt, "response": call}
            elif draw < 0.5:
                row = {"prompt": prompt, "response": rng.choice(numbers)}
            else:
                turns = [
                    {"role": "user", "content": prompt},
                    {"role": "assistant", "content": call},
                    {"role": "user", "content": calculator(call.split())},
                ]
                row = {"prompt": turns, "response": rng.choice(numbers)}
            out.write(json.dumps(row) + "\n")


def prepare(assets: Path, config: RunConfig) -> dict[str, Any]:
    from miles.recipes import quickstart_task

    model_dir, data_dir = assets / "model", assets / "data"
    if not (model_dir / "config.json").exists():
        quickstart_task.build_model(model_dir, config.seed, family=config.model.family or "qwen3")
    if not (data_dir / "agent_sft.jsonl").exists():
        paths = quickstart_task.write_datasets(data_dir, config.seed)
        write_format_data(data_dir / "agent_sft.jsonl", Path(paths["rl_train"]), config.seed)
    return {
        "model.path": str(model_dir),
        "data.path": str(data_dir / "rl_train.jsonl"),
        "eval.data": str(data_dir / "eval.jsonl"),
        "warmstart.data": str(data_dir / "agent_sft.jsonl"),
    }


def quickstart_agent() -> Recipe:
    return Recipe(
        config=CONFIG,
        prepare=prepare,
        description=__doc__ or "",
        prepares=("model.path", "data.path", "eval.data", "warmstart.data"),
        model_config=twin_config,
        runs_on="cpu",
    )
