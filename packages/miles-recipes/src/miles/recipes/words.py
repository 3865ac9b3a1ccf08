"""The quickstart task's words: a word-level tokenizer over the numbers "0" ... "19" and the
instruction "max", with a ChatML template. Every tiny twin ships with it (`twins.write_twin`), so
the quickstart task runs on any family's twin. Made here from nothing: no hub downloads.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

NUM_VALUES = 20  # the numbers are the words "0" ... "19"
NUM_ITEMS = 4  # numbers per prompt; chance-level reward is 1 / NUM_ITEMS
INSTRUCTION = "max"

PAD, UNK, IM_START, IM_END = "<|pad|>", "<|unk|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, UNK, IM_START, IM_END)
ROLE_WORDS = ("system", "user", "assistant")

# Qwen-style ChatML. The word-level pre-tokenizer splits on whitespace, so the newlines only
# separate words; special tokens are split out before that.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def vocabulary() -> list[str]:
    """All tokens, in id order: special tokens first, then words."""
    numbers = [str(i) for i in range(NUM_VALUES)]
    return [*SPECIAL_TOKENS, *ROLE_WORDS, INSTRUCTION, *numbers]


def build_tokenizer(out_dir: str | Path) -> None:
    """Writes a Hugging Face fast tokenizer (word-level, ChatML template) to `out_dir`."""
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(vocabulary())}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        unk_token=UNK,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=64,
    )
    tokenizer.save_pretrained(str(out_dir))
