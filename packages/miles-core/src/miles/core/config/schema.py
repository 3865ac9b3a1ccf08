"""The run config: one YAML file, one typed section per component.

Top-level keys are a contract: name, seed, steps, mode, model, data, rollout, reward, filters,
algorithm, train, precision, lora, moe, async, checkpoint, telemetry (plus placement, fault, cluster,
planner, warmstart and eval).
A section that names a component (``reward: {name: exact_match, answer_key: label}``) keeps the
component's own options aside; `miles.core.registry.validation` checks them against that component's config
dataclass, before any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from miles.core.config.tools import (
    ConfigError,
    build,
    build_partial,
    closest,
    overrides_applied,
    to_dict,
)

Mode = Literal["sync", "one_step_off", "async"]
Placement = Literal["disaggregated", "colocated"]
Offload = Literal["auto", "always", "never"]
# MoE routing replay: "ids" routes every trained token through the experts the rollout engine
# chose, "ids+weights" takes their gate weights too; "off" only measures the agreement.
ReplayMode = Literal["off", "ids", "ids+weights"]


@dataclass
class ComponentRef:
    """A component by registry name (or ``package.module:attr``) plus its own options."""

    __shorthand__ = "name"
    __options__ = "options"

    name: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardSection(ComponentRef):
    """The reward component plus how the run treats its failures."""

    # mark_failed: a reward that raises, times out or returns a non-finite score marks its sample
    # failed (counted in rollout/reward_errors) and the run goes on; fail: the run stops.
    on_error: Literal["mark_failed", "fail"] = "mark_failed"
    timeout_s: float | None = None  # per call (per group for rewards that score groups)


@dataclass
class ModelConfig:
    path: str = ""  # a local Hugging Face checkpoint directory, a hub id, or a .gguf file
    family: str | None = None
    # A GGUF file inside `path` (a directory), as transformers' `gguf_file`. GGUF checkpoints are
    # converted once to a plain checkpoint (dequantised, safetensors) that the run then uses.
    gguf_file: str | None = None


@dataclass
class DataConfig:
    path: str = ""  # .jsonl, .parquet, or a hub dataset id (needs `datasets`)
    prompt_key: str = "prompt"
    split: str = "train"
    shuffle: bool = True
    chat_template: bool = True  # wrap each prompt with the tokenizer's chat template
    system_prompt: str | None = None
    # A prompt longer than the model's context: refused before launch with its file and line
    # (false), or dropped, and the count shown at launch and in the final summary (true).
    drop_long_prompts: bool = False


@dataclass
class RolloutConfig:
    """Generic rollout settings; any other key is an option of the rollout backend."""

    __options__ = "options"

    backend: str = "torch"
    function: ComponentRef = field(default_factory=lambda: ComponentRef("single_turn"))
    engines: int = 1
    gpus_per_engine: int = 1
    prompts_per_step: int = 8
    samples_per_prompt: int = 4  # the group size
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability (0: off)
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # Weight-sync bucket size; a bucket is staged whole. Large buckets keep an NCCL broadcast
    # near link speed (370 GB/s at 512 MB against 117 GB/s at 4 MB between two H200s) and
    # need fewer round trips colocated (0.6B shape: 0.090 s at 512 MB, 0.127 s at 128 MB).
    sync_bucket_mb: int = 512
    verify_weights: bool = True  # checksum engine weights against the trainer's after each sync
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("engines", "prompts_per_step", "samples_per_prompt", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be at least 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("rollout.temperature must be >= 0 and rollout.top_p in (0, 1]")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"rollout.min_p must be in [0, 1), got {self.min_p}")


@dataclass
class KLSettings:
    coef: float = 0.0  # 0 turns the reference policy off
    estimator: str = "k3"
    # "loss": coef * KL per token is added to the loss. "reward": coef * (sum of per-token KL over
    # the response) is subtracted from the sample's reward before advantages.
    mode: Literal["loss", "reward"] = "loss"


@dataclass
class AlgorithmConfig:
    advantage: ComponentRef = field(default_factory=lambda: ComponentRef("grpo"))
    loss: ComponentRef = field(default_factory=lambda: ComponentRef("ppo_clip"))
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "token_mean"
    seq_sum_normalizer: float = 1.0  # the constant of seq_mean_token_sum (Dr.GRPO: max length)
    kl: KLSettings = field(default_factory=KLSettings)
    entropy_coef: float = 0.0  # entropy bonus: coef * entropy is subtracted from the loss
    # A train-inference mismatch correction (tis, mis, icepop), or none.
    correction: ComponentRef | None = None
    # Which logprobs the loss treats as the old policy: the trainer's recomputation ("trainer"), or
    # the engine's own ("rollout"), which makes the loss itself correct for the mismatch.
    old_logprobs: Literal["trainer", "rollout"] = "trainer"
    # The critic's loss, used when the advantage estimator needs values (gae).
    value_loss: ComponentRef = field(default_factory=lambda: ComponentRef("value"))


@dataclass
class ParallelConfig:
    """How the train ranks split the model. Data parallelism is what is left:
    world_size / (tensor x pipeline x context)."""

    tensor: int = 1
    pipeline: int = 1
    expert: int = 1  # routed experts split over this many ranks (MoE models)
    context: int = 1  # long sequences split over this many ranks

    def __post_init__(self) -> None:
        if min(self.tensor, self.pipeline, self.expert, self.context) < 1:
            raise ValueError("train.parallel sizes must be >= 1")

    @property
    def model_parallel(self) -> int:
        return self.tensor * self.pipeline * self.context


@dataclass
class TrainConfig:
    """Generic train settings; any other key (lr, micro_batch_tokens...) is a backend option."""

    __options__ = "options"

    backend: str = "fsdp"
    world_size: int = 1
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class WarmstartConfig:
    """An optional SFT stage before RL, through the same train backend and an SFT loss."""

    data: str | None = None  # JSONL rows with a prompt and a response
    steps: int = 0
    loss: ComponentRef = field(default_factory=lambda: ComponentRef("sft"))
    batch_size: int = 32
    prompt_key: str = "prompt"
    response_key: str = "response"


@dataclass
class EvalConfig:
    data: str | None = None  # held-out prompts, same format as `data`
    split: str = "test"  # the split of a hub dataset (files have none)
    every: int = 0  # also evaluate every N steps; 0: only at the end
    max_prompts: int | None = None
    temperature: float = 0.0  # greedy by default
    at_start: bool = False  # also evaluate the initial weights, before the first step (logged at 0)


@dataclass
class LoRAConfig:
    """Low-rank adapters: the train backend trains them with the base weights frozen."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    # Module names (their last component) to adapt, e.g. q_proj ("q_proj" hits
    # "model.layers.3.self_attn.q_proj"); checked against the model before launch.
    targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    # merged: engines get base + adapters as plain weights; adapters: engines get only the
    # adapters (a few percent of the bytes) and apply them to the base they hold.
    sync: Literal["merged", "adapters"] = "merged"

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora.rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise ValueError("lora.targets must name at least one module")
        if self.sync not in ("merged", "adapters"):
            raise ValueError(f"lora.sync must be 'merged' or 'adapters', got {self.sync!r}")

    @property
    def scaling(self) -> float:
        """What multiplies B @ A: alpha / rank."""
        return self.alpha / self.rank


@dataclass
class MoEConfig:
    routing_replay: ReplayMode = "off"


@dataclass
class AsyncConfig:
    """How far rollout may run ahead of training (modes one_step_off and async)."""

    # The oldest weights a trained sample may come from, in weight versions behind the trainer's.
    # In async mode it is also how many steps ahead rollout may start.
    max_staleness: int = 1
    # Finished groups the buffer holds, at most; 0: two steps' worth (2 x prompts_per_step).
    buffer_size: int = 0
    # A sample older than max_staleness when the trainer takes it: dropped, or generated again.
    stale: Literal["drop", "regenerate"] = "drop"
    # Requests in flight when new weights arrive: finished with the new weights from where they
    # stopped ("continue": a partial rollout, each token keeps its weight version), or started
    # again from the prompt ("requeue").
    on_weight_update: Literal["continue", "requeue"] = "continue"

    def __post_init__(self) -> None:
        if self.max_staleness < 0 or self.buffer_size < 0:
            raise ValueError("async.max_staleness and async.buffer_size must be >= 0")


@dataclass
class FaultConfig:
    """Supervision of the actors: health checks, time-outs, restarts with capped back-off."""

    health_check_s: float = 10.0  # how often each engine is asked for its health
    request_timeout_s: float = 300.0  # an engine silent this long inside generate is hung
    start_timeout_s: float = 600.0  # a (re)started engine must load its model within this
    max_engine_restarts: int = 3  # per engine; past it the engine is dropped (the last: fail)
    max_train_restarts: int = 2  # restarts of the train group (from a snapshot or checkpoint)
    backoff_s: float = 1.0  # the first retry waits this long, each next one twice as long,
    backoff_max_s: float = 30.0  # up to this
    # A lost node's train ranks and engines start again once Ray has re-placed their bundles on
    # the nodes left (or on one that joins); past this many seconds without a place, the run
    # fails and says what is missing.
    node_wait_s: float = 300.0
    # A host-memory copy of the train state every N steps, which a restarted train group
    # resumes from (redoing the steps since). "auto": every step while a snapshot costs at most
    # a quarter of a train step, else as often as that allows; 0: never (checkpoints only).
    snapshot_every: int | Literal["auto"] = "auto"
    snapshot_dir: str = ""  # "": /dev/shm (host memory); one the train ranks all see
    # With no snapshot or checkpoint to resume from, a lost train group fails the run, unless
    # "base": it starts again from model.path (its training so far is lost).
    train_restart_from: Literal["latest", "base"] = "latest"

    def __post_init__(self) -> None:
        if min(self.health_check_s, self.request_timeout_s, self.start_timeout_s,
               self.node_wait_s) <= 0:  # fmt: skip
            raise ValueError(
                "fault.health_check_s, request_timeout_s, start_timeout_s and node_wait_s must "
                "be > 0"
            )
        if min(self.max_engine_restarts, self.max_train_restarts) < 0:
            raise ValueError("fault.max_engine_restarts and max_train_restarts must be >= 0")
        if self.snapshot_every != "auto" and self.snapshot_every < 0:
            raise ValueError("fault.snapshot_every must be >= 0 or auto (0: no snapshots)")


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N steps; 0: only at the end
    keep_last: int = 2  # the newest N checkpoints are kept; 0: all
    keep_every: int = 0  # also keep, for good, each checkpoint step_k whose k is a multiple of N
    at_end: bool = True

    def __post_init__(self) -> None:
        if min(self.every, self.keep_last, self.keep_every) < 0:
            raise ValueError("checkpoint.every, keep_last and keep_every must be >= 0")


@dataclass
class PlannerConfig:
    """The memory planner (`miles recipes plan`), which `miles run` also runs before launch."""

    # Memory of one GPU; null: read from this machine's GPU at launch (no check without one).
    gpu_mem_gb: float | None = None
    usable_fraction: float = 0.9  # of gpu_mem_gb: the rest goes to the CUDA context, NCCL...
    prompt_tokens: int = 1024  # the prompt length the KV cache is sized for (plus max_new_tokens)
    check: bool = True  # false: `miles run` skips the pre-launch memory check

    def __post_init__(self) -> None:
        if not 0 < self.usable_fraction <= 1 or self.prompt_tokens < 1:
            raise ValueError("planner: usable_fraction in (0, 1] and prompt_tokens >= 1")
        if self.gpu_mem_gb is not None and self.gpu_mem_gb <= 0:
            raise ValueError("planner.gpu_mem_gb must be > 0")


@dataclass
class ClusterConfig:
    """How the run uses the Ray cluster's nodes (docs/cluster.md)."""

    # A Ray node label naming each node's group (rack, switch, NVLink domain), e.g. "rack" for
    # nodes started with `ray start --labels='{"rack": "r1"}'`. Train ranks fill one group's
    # nodes before the next, and engines take the places nearest rank 0. None: nodes only.
    topology_label: str | None = None
    # Whether train ranks and engines get GPUs. auto: when the Ray cluster has GPUs (asked of the
    # cluster, never the driver). cuda: the same, but a cluster without GPUs is an error rather
    # than a run on CPUs. cpu: never, even on a GPU cluster.
    device: Literal["auto", "cuda", "cpu"] = "auto"


@dataclass
class TelemetryConfig:
    progress: bool = True
    sinks: list[ComponentRef] = field(default_factory=lambda: [ComponentRef("jsonl")])
    # Steps whose train call (old logprobs, batch preparation, train step) each train rank runs
    # under its backend's profiler (`TrainBackend.profiled`), into run_dir/profiles/.
    profile_steps: list[int] = field(default_factory=list)


@dataclass
class RunConfig:
    name: str = "miles"
    seed: int = 0
    steps: int = 10
    mode: Mode = "sync"
    # disaggregated: trainer and engines on separate GPUs. colocated: each engine shares a train
    # rank's GPU, and the two take turns holding their memory.
    placement: Placement = "disaggregated"
    # Colocated hand-over: always, the trainer moves its weights and optimizer state to host
    # memory while the engines generate, and the engines release weights and KV cache while it
    # trains; never, both stay on the GPU and the hand-over is a pause and a resume; auto, the
    # memory plan decides (offload only when trainer and engines do not fit on a GPU together).
    offload: Offload = "auto"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardSection = field(default_factory=lambda: RewardSection("exact_match"))
    filters: list[ComponentRef] = field(default_factory=list)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: ComponentRef = field(default_factory=lambda: ComponentRef("fp32"))
    lora: LoRAConfig | None = None
    moe: MoEConfig = field(default_factory=MoEConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig, metadata={"key": "async"})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict[str, Any]:
        return dict(to_dict(self))


# ── loading ──────────────────────────────────────────────────────────────────────────────────────


def load_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: the top level must be a mapping of sections"])
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``a.b=c`` sets data[a][b] to c, parsed as YAML; see `configtools.apply_overrides`."""
    return overrides_applied(RunConfig, data, overrides)


def parse(data: dict[str, Any]) -> RunConfig:
    """The typed run config, or ConfigError naming every bad key path."""
    return build(RunConfig, data)


def parse_partial(data: dict[str, Any]) -> tuple[RunConfig, list[str]]:
    """The run config with every bad value at its default, and the problems: enough to go on
    checking the rest (component options) and report every mistake at once."""
    config, problems = build_partial(RunConfig, data)
    return config or RunConfig(), problems


__all__ = [
    "ComponentRef",
    "ConfigError",
    "LoRAConfig",
    "RunConfig",
    "apply_overrides",
    "closest",
    "load_yaml",
    "parse",
    "parse_partial",
]
