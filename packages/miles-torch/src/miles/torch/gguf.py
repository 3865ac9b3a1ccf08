"""GGUF checkpoints (llama.cpp's format) as ordinary Hugging Face checkpoints.

transformers reads a GGUF file (`from_pretrained(dir, gguf_file=...)`, with the `gguf` package)
and dequantises its tensors to float, but the model it returns still counts as quantized: it
cannot be fine-tuned or saved. Miles converts the file once into a plain checkpoint directory
(config.json without `quantization_config`, the tokenizer with its chat template, the weights
as float32 safetensors under transformers' names) in its cache, keyed by the file's sha256.
Engines, trainers, the planner, weight sync and checkpoints then all read that directory, so a
GGUF model behaves like any other: the names that sync and checkpoints use are transformers'
own, and a saved checkpoint loads back without GGUF.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import structlog

from miles.core.cache import cache_dir

log = structlog.get_logger(__name__)

MARKER = "miles-gguf.json"  # written last: a directory without it is an unfinished conversion


def is_gguf(model_path: str, gguf_file: str | None = None) -> bool:
    return bool(gguf_file) or model_path.endswith(".gguf")


def gguf_source(model_path: str, gguf_file: str | None = None) -> Path:
    """The GGUF file that `model.path` (a .gguf file, or a directory with `model.gguf_file`)
    names. Raises FileNotFoundError naming it."""
    path = Path(model_path).expanduser() / gguf_file if gguf_file else Path(model_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF checkpoint not found: {path}")
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def converted_checkpoint(
    model_path: str, gguf_file: str | None = None, cache: Path | None = None
) -> Path:
    """The plain checkpoint directory of a GGUF model, converting it on first use. Concurrent
    callers (several workers, several runs) wait for one conversion."""
    source = gguf_source(model_path, gguf_file)
    digest = file_sha256(source)
    root = cache or cache_dir("gguf")
    out = root / f"{source.stem}-{digest[:16]}"
    if (out / MARKER).is_file():
        return out
    with (root / f"{out.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / MARKER).is_file():
            log.info("converting a GGUF checkpoint", source=str(source), to=str(out))
            _convert(source, digest, out)
    return out


def _convert(source: Path, digest: str, out: Path) -> None:
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        raise ImportError(
            f"{source.name} is a GGUF checkpoint: reading it needs the `gguf` package "
            "(pip install gguf)"
        ) from None
    # torch and transformers only here: the driver asks `is_gguf` of every run's model.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    # Built from the config alone, without the GGUF quantizer, the model is ordinary: trainable
    # and savable.
    config = copy.deepcopy(quantized.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), assign=True, strict=True)
    plain.tie_weights()
    plain.generation_config = quantized.generation_config
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        info = {"source": str(source), "sha256": digest, "parameters": plain.num_parameters()}
        (Path(tmp) / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        Path(tmp).rename(out)
