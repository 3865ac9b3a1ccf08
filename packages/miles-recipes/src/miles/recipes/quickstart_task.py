"""The quickstart task: a tiny model learns "say the largest number" by RL, on a laptop CPU.

The prompt lists a few distinct numbers; the correct response is the largest one. Everything is
made here from nothing (no hub downloads): a word-level tokenizer, a randomly initialised
Qwen3-architecture model, and JSONL datasets.

Why this task learns visibly and quickly:
- The SFT warm-start data answers with a *random* number from the prompt, so it teaches only the
  format ("reply with one of the listed numbers, then stop"). After it the policy picks roughly
  uniformly among the listed numbers: mean reward ~ 1 / NUM_ITEMS at RL step 0.
- The rule RL must find is "copy the listed number with the highest value". A transformer does
  that with its existing copy path plus a value-ordered preference, so a handful of GRPO steps
  lift reward to ~1, and the rule carries over to number lists never seen in training.

Rows: RL and eval files hold `{"prompt": str, "answer": str}`; the SFT file holds
`{"prompt": str, "response": str}`. `prompt` is the user message text: render it with the
tokenizer's chat template (`add_generation_prompt=True`). `response` and `answer` hold just the
answer word; the end-of-turn token (`<|im_end|>`, the tokenizer's eos) is not part of the text.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from miles.recipes.words import INSTRUCTION, NUM_ITEMS, NUM_VALUES, vocabulary

__all__ = ["INSTRUCTION", "NUM_ITEMS", "NUM_VALUES", "build_model", "vocabulary", "write_datasets"]

# Sizes of the generated datasets. Eval prompts are number lists that no training file contains
# (RL or SFT), so eval measures the rule, not memory. 16384 SFT rows = 64 steps of 256 rows.
NUM_RL_PROMPTS = 4096
NUM_EVAL_PROMPTS = 256
NUM_SFT_ROWS = 16384


def build_model(out_dir: str | Path, seed: int, *, family: str = "qwen3", **overrides: Any) -> None:
    """Writes the tiny twin of `family` (random weights, safetensors) with this task's tokenizer
    to `out_dir`. The Qwen3 twin is a ~100k-parameter model: big enough for the rule, small
    enough for a 2-core CPU; the Qwen3-MoE twin has the same shape with 4 experts, top-2."""
    # Imported here: the datasets alone need neither torch nor transformers.
    from miles.recipes.twins import write_twin

    write_twin(family, out_dir, seed=seed, **overrides)


def make_prompt(numbers: list[int]) -> str:
    return " ".join([INSTRUCTION, *map(str, numbers)])


def answer_of(numbers: list[int]) -> str:
    return str(max(numbers))


def _draw_lists(
    rng: random.Random, count: int, exclude: set[tuple[int, ...]], *, unique: bool
) -> list[list[int]]:
    """`count` number lists (distinct numbers within each), none in `exclude`; `unique`: no repeats."""
    seen = set(exclude)
    lists: list[list[int]] = []
    while len(lists) < count:
        numbers = rng.sample(range(NUM_VALUES), NUM_ITEMS)
        if tuple(numbers) not in seen:
            if unique:
                seen.add(tuple(numbers))
            lists.append(numbers)
    return lists


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_datasets(out_dir: str | Path, seed: int) -> dict[str, str]:
    """Writes rl_train / eval / sft JSONL files to `out_dir`; returns {name: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    eval_lists = _draw_lists(rng, NUM_EVAL_PROMPTS, exclude=set(), unique=True)
    held_out = {tuple(n) for n in eval_lists}
    rl_lists = _draw_lists(rng, NUM_RL_PROMPTS, exclude=held_out, unique=True)
    # SFT teaches the format only: the response is a uniformly random number from the prompt.
    # Its lists may repeat each other or RL lists (all training data), never eval ones.
    sft_lists = _draw_lists(rng, NUM_SFT_ROWS, exclude=held_out, unique=False)

    rows = {
        "rl_train": [{"prompt": make_prompt(n), "answer": answer_of(n)} for n in rl_lists],
        "eval": [{"prompt": make_prompt(n), "answer": answer_of(n)} for n in eval_lists],
        "sft": [{"prompt": make_prompt(n), "response": str(rng.choice(n))} for n in sft_lists],
    }
    paths = {}
    for name, name_rows in rows.items():
        paths[name] = str(out / f"{name}.jsonl")
        _write_jsonl(Path(paths[name]), name_rows)
    return paths
