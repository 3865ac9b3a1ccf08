"""What an agent episode cannot take: sampling that is not the run's (the trained logprobs are the
run's sampler's), refused by name rather than silently ignored."""

from __future__ import annotations

import pytest

from miles.agents.gateway import _episode_call
from miles.sglang import openai
from miles.sglang.protocol import BadRequest

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "extra",
    [{"logit_bias": {"5": 10}}, {"continue_final_message": True}, {"frequency_penalty": 0.5}],
)
def test_sampling_the_run_does_not_do_is_refused_by_name(extra: dict[str, object]) -> None:
    parsed = openai.parse_chat({"messages": MESSAGES, **extra})
    with pytest.raises(BadRequest, match=next(iter(extra))):
        _episode_call(parsed, "/v1/chat/completions")


def test_a_plain_call_passes() -> None:
    body = _episode_call(openai.parse_chat({"messages": MESSAGES}), "/v1/chat/completions")
    assert body["messages"] == MESSAGES
