"""The quickstart task's assets: tokenizer, tiny model and datasets, all made offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles.recipes import quickstart_task as qt


def _rows(path: str) -> list[dict[str, str]]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("quickstart_model")
    qt.build_model(out, seed=0)
    return out


def test_tokenizer_chat_template_and_round_trip(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "max 3 17 5 9"}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == [
        "<|im_start|>", "user", "max", "3", "17", "5", "9", "<|im_end|>", "<|im_start|>", "assistant"
    ]  # fmt: skip
    assert tok.unk_token_id not in ids
    # A response is one number word then the eos; decoding drops the special tokens.
    answer = tok("17", add_special_tokens=False)["input_ids"]
    assert len(answer) == 1
    assert tok.decode([*answer, tok.eos_token_id], skip_special_tokens=True).strip() == "17"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id != tok.eos_token_id


def test_model_is_a_tiny_qwen3_in_safetensors(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    assert (model_dir / "model.safetensors").exists()
    assert not list(model_dir.glob("*.bin"))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.model_type == "qwen3"
    assert model.config.vocab_size == len(qt.vocabulary())
    assert sum(p.numel() for p in model.parameters()) < 200_000
    logits = model(input_ids=torch.tensor([[2, 5, 7, 11]])).logits
    assert logits.shape == (1, 4, len(qt.vocabulary()))


def test_build_model_is_seeded(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        qt.build_model(tmp_path / name, seed)
    a, b, c = (load_file(tmp_path / n / "model.safetensors") for n in "abc")
    key = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a[key], b[key])
    assert not torch.equal(a[key], c[key])


def test_datasets_hold_out_eval_prompts_and_answer_with_the_max(tmp_path: Path) -> None:
    paths = qt.write_datasets(tmp_path, seed=0)
    rl, ev, sft = (_rows(paths[n]) for n in ("rl_train", "eval", "sft"))
    assert (len(rl), len(ev), len(sft)) == (qt.NUM_RL_PROMPTS, qt.NUM_EVAL_PROMPTS, qt.NUM_SFT_ROWS)

    def numbers(prompt: str) -> list[int]:
        word, *rest = prompt.split()
        assert word == qt.INSTRUCTION and len(rest) == qt.NUM_ITEMS
        return [int(x) for x in rest]

    for row in rl + ev:
        assert row["answer"] == str(max(numbers(row["prompt"])))
    eval_prompts = {r["prompt"] for r in ev}
    assert len(eval_prompts) == len(ev)
    assert not eval_prompts & {r["prompt"] for r in rl}
    assert not eval_prompts & {r["prompt"] for r in sft}
    # SFT answers are a listed number but carry no rule: the max only about 1 / NUM_ITEMS of
    # the time, so RL starts near chance.
    assert all(int(r["response"]) in numbers(r["prompt"]) for r in sft)
    hit = sum(r["response"] == str(max(numbers(r["prompt"]))) for r in sft) / len(sft)
    assert abs(hit - 1 / qt.NUM_ITEMS) < 0.03


def test_datasets_are_deterministic_per_seed(tmp_path: Path) -> None:
    a = qt.write_datasets(tmp_path / "a", seed=3)
    b = qt.write_datasets(tmp_path / "b", seed=3)
    c = qt.write_datasets(tmp_path / "c", seed=4)
    for name in a:
        assert Path(a[name]).read_text() == Path(b[name]).read_text()
    assert Path(a["eval"]).read_text() != Path(c["eval"]).read_text()


def test_a_model_path_of_the_users_own_builds_no_twin(tmp_path: Path) -> None:
    """`miles run quickstart --set model.path=...`: the datasets are made, the model is not."""
    from miles.core.config import apply_overrides
    from miles.core.registry.validation import check_config
    from miles.recipes.quickstart import CONFIG, PREPARES, prepare

    data = apply_overrides(dict(CONFIG), [f"model.path={tmp_path / 'mine'}"])
    made = prepare(tmp_path / "assets", check_config(data, None, made_later=PREPARES))
    assert made["model.path"] == str(tmp_path / "mine")
    assert not (tmp_path / "assets" / "model").exists()
    assert _rows(made["data.path"]) and _rows(made["eval.data"])
