"""Every extension point of Miles, in one module.

A plugin is a module listed under the ``miles`` entry-point group that implements some of these hooks
with ``@miles.core.hookimpl``. Built-in components use the same mechanism as third-party ones.

Sections:

* **Registration** hooks return typed :class:`~miles.core.contracts.components.ComponentSpec` lists, one hook
  per kind. Two distributions registering the same kind and name is an error naming both.
* **Pick-one** hooks are ``firstresult``: the first plugin that answers wins.
* **Commands** add subcommands to the ``miles`` command line.
* **Lifecycle** hooks fan out to every plugin, for metrics and diagnostics. ``metrics`` dicts are
  mutable: a plugin may add keys, and they are logged with the step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import click
import pluggy

from miles.core.contracts.components import ComponentSpec, Kind
from miles.core.contracts.protocols import Tokenizer
from miles.core.contracts.types import RunInfo, Sample

PROJECT = "miles"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ── Registration ─────────────────────────────────────────────────────────────────────────────────
# Each hook returns the components of one kind. The factory's contract is given per hook.


@hookspec
def miles_register_rollout_backends() -> Iterable[ComponentSpec]:
    """Rollout engines (``rollout.backend``): factory(config, setup) builds one engine satisfying
    :class:`miles.core.contracts.backends.RolloutEngine` from its options and a
    :class:`~miles.core.contracts.protocols.RolloutSetup`. The spec declares capabilities and a rollout
    memory model."""


@hookspec
def miles_register_train_backends() -> Iterable[ComponentSpec]:
    """Train backends (``train.backend``): factory(config, setup) builds one rank satisfying
    :class:`miles.core.contracts.backends.TrainBackend` from its options and a
    :class:`~miles.core.contracts.protocols.TrainSetup`. The spec declares capabilities (parallelism, critic,
    colocation...) and a train memory model."""


@hookspec
def miles_register_rollout_functions() -> Iterable[ComponentSpec]:
    """Rollout functions (``rollout.function``): how a sample or a group is generated from a prompt:
    single-turn, multi-turn, agentic with tools."""


@hookspec
def miles_register_environments() -> Iterable[ComponentSpec]:
    """Environments for multi-turn rollouts: factory(config) builds a
    :class:`miles.core.contracts.protocols.Environment` (``reset`` / ``step`` over text)."""


@hookspec
def miles_register_agents() -> Iterable[ComponentSpec]:
    """Agents for rollout function ``agent`` (miles-sglang): factory(config) builds a callable
    that runs one episode against an OpenAI-compatible base URL it is handed, and returns its
    reward; the rollout function trains on the exact tokens of every call."""


@hookspec
def miles_register_rewards() -> Iterable[ComponentSpec]:
    """Reward functions (``reward.name``): score a finished sample (or a whole group) to a float."""


@hookspec
def miles_register_filters() -> Iterable[ComponentSpec]:
    """Sample filters (``filters``): keep or drop samples or groups before training."""


@hookspec
def miles_register_advantages() -> Iterable[ComponentSpec]:
    """Advantage estimators (``algorithm.advantage``): rewards of a batch to per-sample advantages."""


@hookspec
def miles_register_losses() -> Iterable[ComponentSpec]:
    """Policy and auxiliary losses (``algorithm.loss``): factory(config) returns a
    :class:`miles.core.contracts.protocols.PolicyLoss`."""


@hookspec
def miles_register_kl_estimators() -> Iterable[ComponentSpec]:
    """KL estimators (``algorithm.kl.estimator``): per-token KL from policy and reference logprobs."""


@hookspec
def miles_register_corrections() -> Iterable[ComponentSpec]:
    """Train–inference mismatch corrections (``algorithm.correction``): importance weights or masks
    from rollout and trainer logprobs."""


@hookspec
def miles_register_precisions() -> Iterable[ComponentSpec]:
    """Precisions (``precision``): factory() builds a :class:`miles.core.contracts.backends.Precision`, one
    object that converts the training model and the weights sent to rollout engines alike. The
    spec declares a precision memory model (bytes per element), and ``quantized`` for a weight
    format of its own."""


@hookspec
def miles_register_families() -> Iterable[ComponentSpec]:
    """Model families (``model.family``): adapters over transformers architectures: weight names,
    MoE routers, chat templates, parallelism hints."""


@hookspec
def miles_register_recipes() -> Iterable[ComponentSpec]:
    """Ready-to-run recipes (``miles run NAME``): factory() returns a config dict; a recipe may
    prepare local assets (a tiny model, generated data) before the run."""


@hookspec
def miles_register_metric_sinks() -> Iterable[ComponentSpec]:
    """Metric sinks (``telemetry.sinks``): receive each step's metrics (JSONL, TensorBoard, W&B...)."""


# Which registration hook serves which kind: the plugin manager checks specs against it.
REGISTRATION_HOOKS: dict[str, Kind] = {
    "miles_register_rollout_backends": Kind.ROLLOUT_BACKEND,
    "miles_register_train_backends": Kind.TRAIN_BACKEND,
    "miles_register_rollout_functions": Kind.ROLLOUT_FUNCTION,
    "miles_register_environments": Kind.ENVIRONMENT,
    "miles_register_agents": Kind.AGENT,
    "miles_register_rewards": Kind.REWARD,
    "miles_register_filters": Kind.FILTER,
    "miles_register_advantages": Kind.ADVANTAGE,
    "miles_register_losses": Kind.LOSS,
    "miles_register_kl_estimators": Kind.KL,
    "miles_register_corrections": Kind.CORRECTION,
    "miles_register_precisions": Kind.PRECISION,
    "miles_register_families": Kind.FAMILY,
    "miles_register_recipes": Kind.RECIPE,
    "miles_register_metric_sinks": Kind.METRIC_SINK,
}


# ── Pick-one ─────────────────────────────────────────────────────────────────────────────────────


@hookspec(firstresult=True)
def miles_resolve_component(kind: Kind, name: str) -> ComponentSpec | None:
    """Resolve a name no plugin registered, e.g. an import path ``package.module:attr`` for one-off
    code. Return None to pass."""


@hookspec(firstresult=True)
def miles_local_checkpoint(model_path: str, gguf_file: str | None) -> str | None:
    """A checkpoint that Miles' loaders and planner cannot read as it is (a GGUF file), as a
    local Hugging Face checkpoint directory (converted once and cached). Return None to pass."""


@hookspec(firstresult=True)
def miles_load_tokenizer(model_path: str) -> Tokenizer | None:
    """The tokenizer of a checkpoint (a :class:`miles.core.contracts.protocols.Tokenizer`), with a chat
    template. Return None to pass."""


# ── Commands ─────────────────────────────────────────────────────────────────────────────────────


@hookspec
def miles_register_commands(cli: click.Group) -> None:
    """Adds subcommands to the ``miles`` command line (``cli.add_command(...)``)."""


# ── Lifecycle ────────────────────────────────────────────────────────────────────────────────────


@hookspec
def miles_on_run_start(run: RunInfo) -> None:
    """The run directory and resolved config exist; no worker has started yet."""


@hookspec
def miles_on_run_end(run: RunInfo, status: str, error: str | None) -> None:
    """The run finished (``status`` is ``completed``, ``failed`` or ``interrupted``)."""


@hookspec
def miles_after_rollout(
    run: RunInfo, step: int, samples: list[Sample], metrics: dict[str, Any]
) -> None:
    """Samples of this step are generated, rewarded and filtered, before training."""


@hookspec
def miles_after_train_step(run: RunInfo, step: int, metrics: dict[str, Any]) -> None:
    """The optimizer stepped; ``metrics`` holds the train metrics of this step."""


@hookspec
def miles_after_weight_sync(run: RunInfo, step: int, version: int, metrics: dict[str, Any]) -> None:
    """Every rollout engine holds weight ``version`` (verified by checksum when enabled)."""


@hookspec
def miles_after_checkpoint(run: RunInfo, step: int, path: str) -> None:
    """A checkpoint was written atomically to ``path``."""
