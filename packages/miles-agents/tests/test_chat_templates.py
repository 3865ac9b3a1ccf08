"""An agent episode's token sequence under real chat templates (Qwen3, Qwen3.5, DeepSeek-R1 on
tiny tokenizers: chat_templates/README.md): each call keeps the ids the engine generated, thinking
tokens included, and appends only the new turn as the template renders it after the reply."""

from __future__ import annotations

from typing import Any

import pytest

from miles.agents.trajectory import Diverged, Trajectory
from miles.core.contracts.types import GenerateResult

OFF = {"enable_thinking": False}
CALL, RESULT, ANSWER = "max 3 7", "7", "7"
# What the model generates for the three calls of the episode below, by template and kwargs.
THINK = "<think>\nthe tool knows\n</think>\n\n"  # Qwen3 thinking on: the model opens <think>
OPENED = "the tool knows\n</think>\n\n"  # Qwen3.5 and DeepSeek-R1: the prompt opened <think>
QWEN_TOOL = (
    "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)
QWEN_USER = "\n<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"
CASES = {
    # name: (template, kwargs, what the model writes before its text, what each append is)
    "qwen3": ("qwen3", {}, THINK, (QWEN_TOOL, QWEN_USER)),
    "qwen3-no-thinking": ("qwen3", OFF, "", (QWEN_TOOL + EMPTY_THINK, QWEN_USER + EMPTY_THINK)),
    "qwen3.5": ("qwen3_5", {}, OPENED, (QWEN_TOOL + "<think>\n", QWEN_USER + "<think>\n")),
    "qwen3.5-no-thinking": (
        "qwen3_5", OFF, "", (QWEN_TOOL + EMPTY_THINK, QWEN_USER + EMPTY_THINK)
    ),
    "deepseek-r1": (
        "deepseek_r1",
        {},
        OPENED,
        (  # R1's template adds no generation prompt after tool outputs
            "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>7<｜tool▁output▁end｜>"
            "<｜tool▁outputs▁end｜>",
            "<｜User｜>thanks<｜Assistant｜><think>\n",
        ),
    ),
}  # fmt: skip


class Episode:
    """Drives a `Trajectory` as the gateway does, with a scripted model."""

    def __init__(self, tokenizer: Any, kwargs: dict[str, Any], tools: Any = None) -> None:
        self.tok, self.kwargs, self.tools = tokenizer, kwargs, tools
        self.t = Trajectory(tokenizer)
        self.messages: list[dict[str, Any]] = []
        self.prompts: list[list[int]] = []
        self.generated: list[list[int]] = []

    def call(self, new: list[dict[str, Any]], writes: str) -> str:
        """Sends the conversation grown by `new`; the model writes `writes`, then ends its turn."""
        self.messages += new
        prompt = self.t.chat_prompt(self.messages, self.tools, self.kwargs)
        ids = [*self.tok.encode(writes, add_special_tokens=False), self.tok.eos_token_id]
        self.t.record(prompt, GenerateResult(0, ids, [-0.5] * len(ids), "stop", 0))
        reply = str(self.tok.decode(ids, skip_special_tokens=True))
        self.t.remember_chat(self.messages, reply, self.tools, self.kwargs)
        self.messages.append({"role": "assistant", "content": reply})
        self.prompts.append(prompt)
        self.generated.append(ids)
        return reply


def tool_then_user(tokenizer: Any, kwargs: dict[str, Any], prefix: str) -> Episode:
    """A tool call, the tool's result, an answer, the user's follow-up, a last answer."""
    ep = Episode(tokenizer, kwargs)
    ep.call([{"role": "user", "content": "largest of 3 7?"}], prefix + CALL)
    ep.call([{"role": "tool", "content": RESULT}], prefix + ANSWER)
    ep.call([{"role": "user", "content": "thanks"}], prefix + "ok")
    return ep


@pytest.mark.parametrize("case", list(CASES))
def test_each_call_keeps_the_generated_ids_and_appends_only_the_new_turn(
    case: str, chat_tokenizer: Any
) -> None:
    template, kwargs, prefix, appends = CASES[case]
    tok = chat_tokenizer(template)
    ep = tool_then_user(tok, kwargs, prefix)
    t = ep.t
    assert ep.prompts[0] == t.prompt_ids
    for i, append in enumerate(appends):
        before = ep.prompts[i] + ep.generated[i]  # what the engine saw and generated, exactly
        prompt = ep.prompts[i + 1]
        assert prompt[: len(before)] == before
        assert tok.decode(prompt[len(before) :]) == append
    assert t.ids == ep.prompts[-1] + ep.generated[-1]
    assert tok.decode(ep.generated[0], skip_special_tokens=True) == prefix + CALL
    # The loss mask is 1 on exactly the generated tokens, their logprobs kept.
    n = len(t.prompt_ids)
    trained = [t.ids[n + i] for i, m in enumerate(t.loss_mask) if m]
    assert trained == [x for ids in ep.generated for x in ids]
    assert [lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m] == [-0.5] * len(trained)
    # Each real template renders this conversation afresh into other tokens: it drops or adds
    # think blocks of earlier turns, which is why the history is never rendered again.
    assert t.retemplate_drift() is True


def test_the_tiny_chatml_template_renders_the_episode_as_it_was_trained(
    chat_tokenizer: Any,
) -> None:
    ep = tool_then_user(chat_tokenizer("chatml"), {}, "")
    assert ep.t.retemplate_drift() is False


def test_a_reply_sent_back_without_its_reasoning_is_accepted_and_the_reasoning_trained(
    chat_tokenizer: Any,
) -> None:
    tok = chat_tokenizer("qwen3")
    ep = Episode(tok, {})
    reply = ep.call([{"role": "user", "content": "q"}], THINK + CALL)
    ep.messages[-1] = {"role": "assistant", "content": reply.split("</think>")[-1].strip()}
    ep.call([{"role": "tool", "content": RESULT}], THINK + ANSWER)
    assert tok.decode(ep.t.ids).count("<think>") == 2  # both turns' reasoning, as generated


@pytest.mark.parametrize(
    ("template", "edit", "reason"),
    [
        ("qwen3", lambda m: m.__setitem__(0, {"role": "user", "content": "other"}), "edited_history"),
        ("qwen3", lambda m: m.pop(), "edited_history"),  # the reply dropped
        ("qwen3", lambda m: m[-1].update(content="max 9 9"), "edited_history"),
        # Qwen3.5's template refuses a system message after the first.
        ("qwen3_5", lambda m: m.append({"role": "system", "content": "be brief"}), "template_error"),
        # DeepSeek-R1's moves every system message to the top of the prompt.
        ("deepseek_r1", lambda m: m.append({"role": "system", "content": "be brief"}),
         "template_moves_messages"),
    ],
)  # fmt: skip
def test_a_history_that_does_not_grow_is_refused_with_its_reason(
    template: str, edit: Any, reason: str, chat_tokenizer: Any
) -> None:
    ep = Episode(chat_tokenizer(template), {})
    ep.call([{"role": "user", "content": "q"}], CALL)
    edit(ep.messages)
    with pytest.raises(Diverged, match=f"cannot be trained on \\({reason}\\)") as err:
        ep.call([{"role": "user", "content": "next"}], ANSWER)
    assert err.value.reason == reason == ep.t.refused and ep.t.diverged == str(err.value)
    assert ep.t.calls == 1  # nothing of the refused call was recorded


def test_a_system_message_qwen3_renders_in_place_is_appended(chat_tokenizer: Any) -> None:
    tok = chat_tokenizer("qwen3")
    ep = Episode(tok, {})
    ep.call([{"role": "user", "content": "q"}], CALL)
    ep.call([{"role": "system", "content": "be brief"}], ANSWER)
    appended = tok.decode(ep.prompts[1][len(ep.prompts[0]) + len(ep.generated[0]) :])
    assert appended == "\n<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>assistant\n"


def test_changed_tools_or_template_kwargs_are_refused(chat_tokenizer: Any) -> None:
    ep = Episode(chat_tokenizer("qwen3"), {})
    ep.call([{"role": "user", "content": "q"}], CALL)
    ep.kwargs = OFF
    with pytest.raises(Diverged, match="changed_template_args"):
        ep.call([{"role": "user", "content": "next"}], ANSWER)
