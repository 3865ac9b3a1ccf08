"""Agents against real `miles serve` processes (`miles.serve.testing`), and real chat templates on
tiny tokenizers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from miles.serve.fixtures import model, serve_process, serve_process_for_module, server

__all__ = ["model", "serve_process", "serve_process_for_module", "server"]


# -- real chat templates on tiny tokenizers ------------------------------------------------------

_TEMPLATES = Path(__file__).parent / "chat_templates"  # README.md there says where each is from
# (special tokens, other added tokens) of each family's tokenizer.
_QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN_ADDED = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
_DEEPSEEK_NAMES = ["begin▁of▁sentence", "end▁of▁sentence", "User", "Assistant", "tool▁sep"] + [
    f"tool▁{kind}▁{end}"
    for kind in ("calls", "call", "outputs", "output")
    for end in ("begin", "end")
]
_QWEN = (_QWEN_SPECIAL, _QWEN_ADDED)
_DEEPSEEK = (tuple(f"<｜{name}｜>" for name in _DEEPSEEK_NAMES), ("<think>", "</think>"))


def make_chat_tokenizer(template: str) -> Any:
    """A character-level tokenizer (as `miles.torch.testing`'s) with the tokens and chat template
    of a real model family: `qwen3`, `qwen3_5` or `deepseek_r1` (chat_templates/NAME.jinja), or
    `chatml` (the tiny test models' template)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from miles.torch.testing import CHAT_TEMPLATE

    special, added = _DEEPSEEK if template.startswith("deepseek") else _QWEN
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate([*special, *added, *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=special[0]))
    # One pre-token per character, newlines too (a run of them must not become one unknown).
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(special))
    tok.add_tokens(list(added))
    text = CHAT_TEMPLATE if template == "chatml" else (_TEMPLATES / f"{template}.jinja").read_text()
    if template.startswith("deepseek"):
        names = {"bos_token": special[0], "eos_token": special[1], "pad_token": special[1]}
    else:
        names = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, unk_token=special[0], chat_template=text, **names
    )


@pytest.fixture(scope="session")
def chat_tokenizer() -> Any:
    """`chat_tokenizer(template)`: `make_chat_tokenizer`, made once per template."""
    made: dict[str, Any] = {}

    def get(template: str) -> Any:
        if template not in made:
            made[template] = make_chat_tokenizer(template)
        return made[template]

    return get
