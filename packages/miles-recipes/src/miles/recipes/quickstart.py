"""The `quickstart` recipe: RL visibly learning on a laptop CPU in a few minutes.

A tiny Qwen3 (random init, a word-level tokenizer made here) first learns the answer *format*
by SFT on data whose answers are random, so RL starts near chance. GRPO then has to discover the
rule (answer with the largest listed number), and held-out prompts check that it generalises.
Nothing is special-cased: the same actors, engine, reward and loss plugins run every recipe.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.core.config import RunConfig
from miles.core.contracts.recipe import Recipe

CONFIG: dict[str, Any] = {
    "name": "quickstart",
    "seed": 0,
    "steps": 30,
    "mode": "sync",
    # model.path, data.path, eval.data and warmstart.data are filled in by prepare().
    "data": {"prompt_key": "prompt"},
    "rollout": {
        "backend": "torch",
        "engines": 1,
        "prompts_per_step": 32,
        "samples_per_prompt": 8,
        "temperature": 1.0,
        "max_new_tokens": 4,
    },
    "reward": {"name": "exact_match", "answer_key": "answer"},
    "algorithm": {"advantage": "grpo", "loss": "ppo_clip", "aggregation": "token_mean"},
    "train": {"backend": "fsdp", "world_size": 1, "lr": 3.0e-3, "micro_batch_tokens": 4096},
    "warmstart": {"steps": 100, "batch_size": 64},
    "eval": {"temperature": 0.0},
    "checkpoint": {"keep_last": 1},
}


PREPARES = ("model.path", "data.path", "eval.data", "warmstart.data")


def prepare(assets: Path, config: RunConfig, *, default_family: str = "qwen3") -> dict[str, Any]:
    """Makes the tiny model, tokenizer and datasets once; a resumed run reuses them.

    The model is the tiny twin of `model.family` (default: Qwen3), so the same task runs on any
    installed family: `miles run quickstart --set model.family=deepseek_v4`.
    """
    from miles.recipes import quickstart_task

    model_dir, data_dir = assets / "model", assets / "data"
    # A model.path of the user's own (--set) wins over the twin: none is built then.
    if not config.model.path and not (model_dir / "config.json").exists():
        quickstart_task.build_model(
            model_dir, config.seed, family=config.model.family or default_family
        )
    if not (data_dir / "eval.jsonl").exists():
        paths = quickstart_task.write_datasets(data_dir, config.seed)
    else:
        paths = {n: str(data_dir / f"{n}.jsonl") for n in ("rl_train", "eval", "sft")}
    return {
        "model.path": config.model.path or str(model_dir),
        "data.path": paths["rl_train"],
        "eval.data": paths["eval"],
        "warmstart.data": paths["sft"],
    }


def twin_config(config: RunConfig, default_family: str = "qwen3") -> dict[str, Any]:
    """The config.json of the tiny twin `prepare` makes (for planning before it is made)."""
    from miles.recipes.twins import twin_config_dict

    return twin_config_dict(config.model.family or default_family)


def lora_note(config: RunConfig) -> list[str]:
    """LoRA here adapts a ~100k-parameter model of random weights: measured, it ends far below
    full training (eval 0.55 at the default lr, 0.69 at lr 1e-2, against 0.96)."""
    if config.lora is None:
        return []
    return [
        "LoRA on the quickstart's tiny random-weight model learns less than full training (eval "
        "about 0.55 at train.lr 3e-3 and 0.7 at 1e-2, against 0.96): adapters reshape a model "
        "that already knows; for more here raise train.lr (--set train.lr=1e-2) or drop lora"
    ]


def quickstart() -> Recipe:
    return Recipe(
        config=CONFIG,
        prepare=prepare,
        description=__doc__ or "",
        prepares=PREPARES,
        model_config=twin_config,
        runs_on="cpu",
        summary_notes=lora_note,
    )


# The same task on a tiny Qwen3-MoE (4 experts, top-2), with routing replay on: the engines record
# every token's experts and the trainer routes through them. `--set moe.routing_replay=off`
# turns replay off (the agreement is still measured).
CONFIG_MOE: dict[str, Any] = {
    **CONFIG,
    "name": "quickstart-moe",
    "moe": {"routing_replay": "ids"},
}


def prepare_moe(assets: Path, config: RunConfig) -> dict[str, Any]:
    return prepare(assets, config, default_family="qwen3_moe")


def quickstart_moe() -> Recipe:
    return Recipe(
        config=CONFIG_MOE,
        prepare=prepare_moe,
        description=__doc__ or "",
        prepares=PREPARES,
        model_config=lambda config: twin_config(config, "qwen3_moe"),
        runs_on="cpu",
    )
