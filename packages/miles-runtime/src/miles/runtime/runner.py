"""`miles run`: resolve the config, check it, lay out the run directory, run the controller.

Every check that can fail on user input happens here, before Ray or any worker starts.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import structlog
import yaml

from miles.core.config import ConfigError, RunConfig, apply_overrides, load_yaml
from miles.core.contracts.components import ComponentConflictError, ComponentNotFoundError, Kind
from miles.core.contracts.recipe import Recipe
from miles.core.observability.logsetup import configure_logging
from miles.core.registry.plugins import get_plugin_manager
from miles.core.registry.validation import check_config
from miles.runtime.cluster.process import dump_stacks_on_sigusr1, private_ray_token
from miles.runtime.data.check import Encode, check_run_data
from miles.runtime.loop.controller import Controller
from miles.runtime.loop.interrupts import RunInterrupted
from miles.runtime.planning.gpu_memory import local_gpu_memory_gb
from miles.runtime.planning.plan_table import format_plan
from miles.runtime.planning.planner import PlanError, UnsizedModel, plan
from miles.runtime.rollout.prompts import PromptEncoder
from miles.runtime.rollout.rollout_manager import load_tokenizer
from miles.runtime.rundir import default_run_dir, list_checkpoints, write_config, write_manifest
from miles.runtime.tracing import configure_tracing, shutdown_tracing

log = structlog.get_logger(__name__)


@dataclass
class RunRequest:
    target: str
    overrides: list[str]
    run_dir: Path | None = None
    resume: bool = False
    ray_address: str | None = None
    log_format: str = "auto"
    log_level: str = "info"


def _is_file(target: str) -> bool:
    return target.endswith((".yaml", ".yml")) or Path(target).is_file()


def _load_target(target: str) -> tuple[dict[str, Any], Recipe | None]:
    if _is_file(target):
        if not Path(target).is_file():
            raise click.ClickException(f"config file not found: {target}")
        return load_yaml(target), None
    try:
        spec = get_plugin_manager().get(Kind.RECIPE, target).spec
    except ComponentNotFoundError as exc:
        raise click.ClickException(
            f"{target!r} is neither a config file nor a recipe: {exc}. Install miles-recipes "
            "for the built-in recipes."
        ) from None
    recipe = spec.factory()
    return dict(recipe.config), recipe


def resolve_config(request: RunRequest) -> tuple[RunConfig, Path, Recipe | None]:
    """The typed, validated config and its run directory. Raises ConfigError or ClickException."""
    if request.resume:
        if request.run_dir is None or not (request.run_dir / "config.yaml").is_file():
            raise click.ClickException("--resume needs --run-dir pointing at an existing run")
        data, recipe = load_yaml(request.run_dir / "config.yaml"), None
    else:
        data, recipe = _load_target(request.target)
    data = apply_overrides(data, request.overrides)
    prepare = recipe.prepare if recipe is not None else None
    hints = recipe.requires if recipe is not None else None
    # Every check the config allows before the recipe builds anything (a model, datasets): key
    # and type errors and each component's options, all in one report. What the recipe makes is
    # checked once it is made.
    config = check_config(data, hints, made_later=recipe.prepares if recipe and prepare else ())
    run_dir = request.run_dir or default_run_dir(config.name)
    if not request.resume and run_dir.exists() and any(run_dir.iterdir()):
        raise click.ClickException(
            f"run directory {run_dir} is not empty: pass another --run-dir, or --resume"
        )
    if prepare is None:
        converted = with_local_model(data)
        if converted is not data:
            config = check_config(converted, hints)
        check_memory(config)
        check_data(config)
        return config, run_dir, recipe
    created = not run_dir.exists()
    try:
        assets = run_dir / "assets"
        assets.mkdir(parents=True, exist_ok=True)
        prepared = prepare(assets, config)
        # The recipe fills in paths to what it made; the user's --set still wins.
        data = apply_overrides(data, [f"{k}={_yaml_scalar(v)}" for k, v in prepared.items()])
        data = with_local_model(apply_overrides(data, request.overrides))
        config = check_config(data, hints)
        check_memory(config)
        check_data(config)
    except BaseException:
        if created:  # a refused run leaves nothing behind
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return config, run_dir, recipe


def with_local_model(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with model.path at a local checkpoint directory where a plugin had to make one (a
    GGUF file, converted once and cached); `data` itself otherwise."""
    model = data.get("model") or {}
    path, gguf_file = str(model.get("path") or ""), model.get("gguf_file")
    hook = get_plugin_manager().pm.hook.miles_local_checkpoint
    try:
        local = hook(model_path=path, gguf_file=gguf_file)
    except (OSError, ImportError) as exc:
        raise ConfigError([f"model.path: {exc}"]) from None
    if local is None:
        if gguf_file or path.endswith(".gguf"):
            raise ConfigError(
                [
                    f"model.path: {path!r} is a GGUF checkpoint and no installed plugin reads "
                    "GGUF; install miles-torch and the gguf package (pip install gguf)"
                ]
            )
        return data
    log.info(
        "model.path: using a converted checkpoint", source=path, gguf_file=gguf_file, local=local
    )
    return apply_overrides(data, [f"model.path={_yaml_scalar(local)}", "model.gguf_file=null"])


def check_memory(config: RunConfig) -> None:
    """Refuses a layout whose memory plan does not fit the GPUs, showing the plan. Runs when the
    GPU memory is known (planner.gpu_mem_gb, or this machine's GPU) and the model can be sized."""
    if not config.planner.check:
        return
    gpu_mem = config.planner.gpu_mem_gb or local_gpu_memory_gb()
    if gpu_mem is None:
        return  # a CPU run
    try:
        result = plan(config, gpu_mem_gb=gpu_mem)
    except UnsizedModel as exc:
        log.info("memory plan skipped", reason=str(exc))
        return
    except PlanError as exc:
        raise ConfigError([f"train/rollout layout: {exc}"]) from None
    if result.fits is False:
        raise ConfigError(
            [
                "the run does not fit in GPU memory (planner.check: false skips this check):\n"
                + format_plan(result)
            ]
        )
    log.info(
        "memory plan",
        peak_gb=round(result.peak / 1e9, 2),
        usable_gb=round((result.usable or 0) / 1e9, 2),
    )


def check_data(config: RunConfig) -> None:
    """Every bad row of the run's JSONL files, before anything starts (`data_check`); logs the
    rows `data.drop_long_prompts` will drop."""
    encoder: PromptEncoder | None = None

    def encode_for(key: str) -> Encode:
        def encode(rows: list[dict[str, Any]]) -> list[list[int]]:
            nonlocal encoder
            if encoder is None:  # only where a prompt may be too long
                try:
                    encoder = PromptEncoder(load_tokenizer(config.model.path), config.data)
                except Exception as exc:
                    raise ConfigError(
                        [
                            f"data: a prompt needs tokenizing to check that it fits the model's "
                            f"context, and the tokenizer of {config.model.path!r} does not "
                            f"load: {exc}"
                        ]
                    ) from None
            return encoder.encode(rows, key)

        return encode

    for path, count in check_run_data(config, encode_for).items():
        log.warning(
            "data.drop_long_prompts: rows dropped (prompts longer than the model's context)",
            file=path,
            rows=count,
        )


def _stopped_at_once(run_dir: Path, steps_done: int, steps: int) -> None:
    """A second Ctrl-C (or one before the first step): what was lost and what to do now."""
    saved = list_checkpoints(run_dir)
    log.warning(
        "run interrupted",
        steps_done=steps_done,
        steps=steps,
        checkpoint=str(saved[-1][1]) if saved else None,
        at_once=True,
    )
    click.echo("", err=True)  # off the progress bar's line
    if steps_done == 0:
        said = "stopped at once, before the first step finished"
    else:
        said = f"stopped at once after step {steps_done} of {steps}"
        if steps_done < steps:
            said += f"; step {steps_done + 1} was in flight and is lost"
    click.secho(said, fg="yellow", err=True)
    if saved:
        click.echo(
            f"resume with: miles run --resume --run-dir {run_dir} (from {saved[-1][1].name})",
            err=True,
        )
    else:
        click.echo(
            f"no checkpoint was saved: start again with another --run-dir (or delete {run_dir})",
            err=True,
        )


def _yaml_scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...")


def run_from_cli(request: RunRequest) -> int:
    dump_stacks_on_sigusr1()
    if not request.ray_address:
        # The local Ray this run starts requires Ray's auth token on every connection, whatever
        # the environment says (RAY_AUTH_MODE=disabled would open it to anyone who reaches the
        # port). Ray reads the mode once, on import: set it before anything imports ray.
        if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
            click.secho(
                f"error: RAY_AUTH_MODE={os.environ['RAY_AUTH_MODE']}: the Ray a local run starts "
                "always requires its token; unset RAY_AUTH_MODE (or join a Ray of your own with "
                "--ray-address)",
                fg="red",
                err=True,
            )
            return 2
        os.environ["RAY_AUTH_MODE"] = "token"
        private_ray_token()
    try:
        get_plugin_manager().require_no_conflicts()
        config, run_dir, recipe = resolve_config(request)
    except (ConfigError, ComponentConflictError) as exc:
        click.secho(f"error: {exc}", fg="red", err=True)
        return 2

    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(run_dir, config.to_dict())
    manager = get_plugin_manager()
    configure_logging(request.log_format, request.log_level, events_path=run_dir / "events.jsonl")  # type: ignore[arg-type]
    configure_tracing(run_dir, service_name="miles.controller")
    try:
        controller = Controller(
            config, run_dir, ray_address=request.ray_address, resume=request.resume
        )
    except FileNotFoundError as exc:  # --resume without a usable checkpoint
        click.secho(f"error: {exc}", fg="red", err=True)
        return 2
    write_manifest(
        run_dir,
        run_id=controller.info.run_id,
        seed=config.seed,
        plugins=[r.to_json() for r in manager.records.values()],
    )
    log.info("run started", run_dir=str(run_dir), run_id=controller.info.run_id)
    try:
        result = controller.run()
    except RunInterrupted as stop:
        click.secho(
            f"interrupted after step {stop.steps_done} of {stop.steps}; checkpoint saved: "
            f"{stop.checkpoint}",
            fg="yellow",
            err=True,
        )
        click.echo(f"resume with: miles run --resume --run-dir {run_dir}", err=True)
        return 130
    except KeyboardInterrupt:
        _stopped_at_once(run_dir, controller.done_through + 1, config.steps)
        return 130
    except Exception as exc:
        # The error is reported here, once: results the failed run left unread would each print
        # theirs again (Ray's "Unhandled error") as they are dropped.
        os.environ["RAY_IGNORE_UNHANDLED_ERRORS"] = "1"
        cause = getattr(exc, "cause", None) or exc  # a worker's own exception, not Ray's wrapper
        # One line for the console; Ray's wrapper and its traceback go to events.jsonl only.
        log.error("run failed", error=f"{type(cause).__name__}: {cause}", exc_info=exc)
        click.secho(f"error: the run failed: {type(cause).__name__}: {cause}", fg="red", err=True)
        click.secho(f"details: {run_dir / 'events.jsonl'}", err=True)
        return 1
    finally:
        shutdown_tracing()
        _shutdown_ray()
    summary = {
        k: round(v, 4)
        for k, v in result.final_metrics.items()
        if k.startswith(("eval/", "rollout/reward_mean", "weights/version", "data/"))
    }
    resumed = []
    for skipped in controller.skipped_checkpoints:
        assert controller.resume_from is not None
        lost = skipped.step - controller.resume_from[0]
        resumed.append(
            f"resumed from step_{controller.resume_from[0]}, skipping {skipped.path.name} "
            f"({skipped.problem}): {lost} step{'' if lost == 1 else 's'} trained again"
        )
    faults = faults_survived(result.final_metrics)
    notes = recipe.summary_notes(config) if recipe is not None and recipe.summary_notes else []
    # The summary is the run's result: stdout (the log lines are on stderr).
    if _json_logs(request.log_format):
        record = {"event": "run finished", "run_dir": str(run_dir), "metrics": summary}
        click.echo(json.dumps({**record, "faults": faults, "resumed": resumed, "notes": notes}))
        return 0
    click.echo(f"run finished: {run_dir}")
    for key, value in sorted(summary.items()):
        click.echo(f"  {key}: {value}")
    click.echo(f"  {faults}")
    for line in resumed:
        click.echo(f"  {line}")
    for note in notes:
        click.echo(f"  note: {note}")
    return 0


def _json_logs(log_format: str) -> bool:
    return log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())


# (metric, what one of it is called) of the faults a run survives
_FAULTS = (
    ("fault/engine_restarts", "engine restart"),
    ("fault/engines_dropped", "engine dropped"),
    ("fault/train_restarts", "train restart"),
)


def faults_survived(metrics: dict[str, float]) -> str:
    """One line for the final summary: how many faults the run survived, of which kinds."""
    parts = []
    for key, name in _FAULTS:
        n = int(metrics.get(key, 0))
        if n:
            parts.append(f"{n} {name}" + ("s" if n > 1 and name.endswith("restart") else ""))
    redone = int(metrics.get("fault/steps_redone", 0))
    if redone:
        parts.append(f"{redone} step{'s' if redone > 1 else ''} redone")
    return "faults survived: " + (", ".join(parts) if parts else "none")


def _shutdown_ray() -> None:
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()
