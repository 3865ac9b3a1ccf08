"""The `miles serve` command. Torch, the engine and the web stack load only when it runs, so
`miles --help` stays fast."""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from miles.torch.engine.engine import TorchRolloutEngine


@click.command()
@click.argument("target")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=int, default=30000, show_default=True)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a key of the recipe or config (e.g. model.path=...).",
)
@click.option("--device", default=None, help="cpu or cuda (default: cuda when there is one).")
@click.option("--dtype", default=None, help="float32 or bfloat16 (default: bfloat16 on a GPU).")
@click.option("--max-batch-size", type=int, default=64, show_default=True)
@click.option(
    "--max-queue",
    type=int,
    default=1024,
    show_default=True,
    help="Prompts waiting beyond this get HTTP 503.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--engine-path",
    type=click.Choice(["auto", "paged", "hf"]),
    default="auto",
    show_default=True,
    help="The engine's path (docs/engine.md): auto is paged on a GPU, hf on the CPU.",
)
@click.option("--record-routing", is_flag=True, help="Record MoE routes (return_routed_experts).")
@click.option(
    "--api-key",
    default=lambda: os.environ.get("MILES_SERVE_API_KEY"),
    help="Require 'Authorization: Bearer KEY' on every endpoint but /health (default: "
    "$MILES_SERVE_API_KEY; none: the server makes a key, see docs/serve.md).",
)
@click.option(
    "--max-body-mb",
    type=float,
    default=64.0,
    show_default=True,
    help="Largest request body accepted (larger: 413).",
)
@click.option(
    "--allow-origin",
    multiple=True,
    help="A browser origin allowed to call the server (default: none; requests with any other "
    "Origin header are refused).",
)
@click.option(
    "--weight-timeout",
    type=float,
    default=300.0,
    show_default=True,
    help="Seconds a weight operation (group set-up, weight load, memory release) may take "
    "before it answers 504.",
)
@click.option(
    "--context-length",
    type=int,
    default=None,
    help="Prompt plus answer tokens a request may use (default: the model config's "
    "max_position_embeddings).",
)
@click.option(
    "--max-total-tokens",
    type=int,
    default=None,
    help="Paged path: the KV cache's size in tokens, as SGLang's flag (default: what "
    "--mem-fraction of the GPU holds; on a CPU, 65536). The served context is at most this.",
)
@click.option(
    "--page-size",
    type=int,
    default=1,
    show_default=True,
    help="Paged path: tokens per KV page, as SGLang's flag. The prefix cache reuses whole pages, "
    "so 1 (SGLang's default) reuses every shared prompt token; larger pages trade that for "
    "fewer page-table entries.",
)
@click.option(
    "--shutdown-timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="On SIGTERM, seconds to drain requests in flight; the process exits by then plus a "
    "few seconds, whatever is still running.",
)
def serve(
    target: str,
    host: str,
    port: int,
    overrides: tuple[str, ...],
    device: str | None,
    dtype: str | None,
    max_batch_size: int,
    max_queue: int,
    seed: int,
    engine_path: str,
    record_routing: bool,
    api_key: str | None,
    max_body_mb: float,
    allow_origin: tuple[str, ...],
    weight_timeout: float,
    context_length: int | None,
    max_total_tokens: int | None,
    page_size: int,
    shutdown_timeout: float,
) -> None:
    """Serve TARGET (a Hugging Face checkpoint directory, a recipe or a CONFIG.yaml) with
    Miles' torch engine behind SGLang's HTTP API (/generate, weight updates, pause/continue,
    health). Binds to 127.0.0.1 unless --host says otherwise."""
    if max_batch_size < 1 or max_queue < 1:
        raise click.BadParameter("--max-batch-size and --max-queue must be at least 1")
    if context_length is not None and context_length < 2:
        raise click.BadParameter(f"--context-length must be at least 2, got {context_length}")
    if page_size < 1:
        raise click.BadParameter(f"--page-size must be at least 1, got {page_size}")
    if max_total_tokens is not None and max_total_tokens < 2:
        raise click.BadParameter(f"--max-total-tokens must be at least 2, got {max_total_tokens}")
    for name, value in (
        ("--max-body-mb", max_body_mb),
        ("--weight-timeout", weight_timeout),
        ("--shutdown-timeout", shutdown_timeout),
    ):
        if not value > 0:
            raise click.BadParameter(f"{name} must be positive, got {value}")
    model_path = _model_path(target, list(overrides))
    # Arguments and config are checked first: a mistake is named without a torch import.
    import torch
    import uvicorn

    from miles.serve.server import ServeSettings, build_app
    from miles.sglang.serve_keys import LOOPBACK, write_key

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    click.echo(f"miles serve: loading {model_path} on {device} ({dtype})", err=True)
    engine, served_context = _load_engine(
        model_path, device, dtype, max_batch_size, seed, engine_path, record_routing,
        context_length, max_total_tokens, page_size,
    )  # fmt: skip
    # Control and weight endpoints always need a key: without --api-key the server makes one,
    # readable by this user only; generation stays open on loopback (as SGLang's is there).
    open_generation = False
    if not api_key:
        api_key, path = write_key(host, port)
        open_generation = host in LOOPBACK
        scope = "control and weight endpoints" if open_generation else "every endpoint"
        click.echo(
            f"miles serve: {scope} need the key in {path} (Authorization: Bearer KEY)", err=True
        )
    settings = ServeSettings(
        model_path=model_path,
        max_batch_size=max_batch_size,
        max_queue=max_queue,
        api_key=api_key,
        open_generation=open_generation,
        host=host,
        allowed_origins=tuple(allow_origin),
        max_body_mb=max_body_mb,
        record_routing=record_routing,
        weight_timeout_s=weight_timeout,
        max_context=served_context,
    )
    app = build_app(engine, settings, exit_deadline_s=shutdown_timeout + _EXIT_MARGIN_S)
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=math.ceil(shutdown_timeout),
    )
    # Served and shut down: leave now, without waiting on threads still blocked in a collective
    # or a load (they hold nothing that outlives the process).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _load_engine(
    model_path: str, device: str, dtype: str, max_batch_size: int, seed: int, engine_path: str,
    record_routing: bool, context_length: int | None, max_total_tokens: int | None,
    page_size: int,
) -> tuple[TorchRolloutEngine, int]:  # fmt: skip
    """The engine, loaded, and the context it serves. The paged path's KV cache and longest
    request follow the served context (not the engine's rollout default), so a request the server
    accepts is one the engine can run."""
    from miles.torch.engine.config import TorchEngineConfig
    from miles.torch.engine.engine import TorchRolloutEngine

    context = context_length or _model_context(model_path)
    on_cpu = not device.startswith("cuda")
    engine = TorchRolloutEngine(
        model_path,
        device=device,
        dtype=dtype,
        max_batch_size=max_batch_size,
        seed=seed,
        record_routing="ids" if record_routing else "off",
        path=engine_path,  # type: ignore[arg-type]  # click.Choice checked it
        paged=TorchEngineConfig(
            max_batch_size=max_batch_size,
            max_context=context,
            page_size=page_size,
            kv_cache_tokens=max_total_tokens or (_CPU_KV_TOKENS if on_cpu else None),
        ),
    )
    # A paged engine runs no request longer than its KV cache: that bounds the served context.
    kv_tokens = engine.health().get("kv_cache_tokens")
    served_context = min(context, int(kv_tokens)) if kv_tokens else context
    if served_context < context:
        click.echo(
            f"miles serve: context {served_context} tokens (the KV cache's size; the model "
            f"allows {context}: --max-total-tokens raises it)",
            err=True,
        )
    return engine, served_context


# The paged path's KV cache on a CPU, in tokens, unless --max-total-tokens says otherwise (a GPU's
# follows its free memory).
_CPU_KV_TOKENS = 65536


def _model_context(model_path: str) -> int:
    """The longest sequence the model's config allows (max_position_embeddings; of the text
    config for a multimodal one)."""
    import json

    config = json.loads((Path(model_path) / "config.json").read_text())
    text = config.get("text_config") or {}
    found = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    return int(found) if found else 1 << 20


# After the drain, the app's own shutdown (engine, groups) gets this long before the process
# exits regardless.
_EXIT_MARGIN_S = 10.0


def _model_path(target: str, overrides: list[str]) -> str:
    """A checkpoint directory as it is; a recipe or config: its model (made or converted, as
    `miles run` would, in a temporary directory)."""
    path = Path(target)
    if path.is_dir() and (path / "config.json").is_file() and not overrides:
        return str(path)
    from miles.core.config import ConfigError
    from miles.runtime.runner import RunRequest, resolve_config

    assets = Path(tempfile.mkdtemp(prefix="miles-serve-"))
    try:
        config, _, _ = resolve_config(RunRequest(target, overrides, run_dir=assets))
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if not config.model.path:
        raise click.ClickException(f"{target!r} names no model (set model.path)")
    return str(config.model.path)
