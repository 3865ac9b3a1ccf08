"""The contracts of the backends: what the run tells a train or rollout backend (its setup),
and every call the runtime makes on one, typed. A precision travels in the setup.

Optional abilities are declared as `Capability` members in the backend's spec, never probed with
hasattr: a train backend declaring `critic` implements `CriticBackend`. Tensors are torch tensors,
named only for type checkers: miles-core itself never imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from miles.core.config import LoRAConfig, ParallelConfig, ReplayMode
from miles.core.contracts.protocols import PolicyLoss
from miles.core.contracts.types import GenerateRequest, GenerateResult, PackedBatch
from miles.core.contracts.weight_sync import SyncPlan

if TYPE_CHECKING:
    import torch

F32 = npt.NDArray[np.float32]


# ── precision ────────────────────────────────────────────────────────────────────────────────────


class Precision(Protocol):
    """One object converts the training model and the weights sent to engines alike."""

    @property
    def rollout_dtype(self) -> str:
        """What engines hold and compute in, e.g. "bfloat16" (a torch dtype's name)."""
        ...

    def convert_model(self, model: torch.nn.Module) -> int:
        """Swaps the training model's layers for the format's own (a quantized precision's
        training linears) before the backend shards it; returns how many. A plain dtype
        precision converts nothing: the backend's compute dtype decides training numerics."""
        ...

    def convert_for_rollout(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The trainer's full-precision weights as engines receive them."""
        ...

    def rollout_decoder(self, dtype: torch.dtype) -> RolloutDecoder | None:
        """For an engine without the format's kernels: turns what `convert_for_rollout` sent
        back into plain `dtype` weights. None when nothing needs decoding."""
        ...


class RolloutDecoder(Protocol):
    @property
    def report(self) -> str:
        """What the engine does with the format, for its logs and health."""
        ...

    def __call__(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]: ...


# ── backends ─────────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class TrainSetup:
    """What the run decides for one rank of any train backend (its own options come in its
    config section)."""

    model_path: str
    rank: int
    world_size: int
    master_addr: str  # the rendezvous of the train group's own process group
    master_port: int
    device: str  # "cpu" or "cuda"
    seed: int
    precision: Precision
    # The precision declares Capability.QUANTIZED: it must convert training layers to its format.
    quantized: bool = False
    temperature: float = 1.0  # logprobs are of log_softmax(logits / temperature), as sampled
    total_steps: int = 0  # optimizer steps the run plans (warm-start + RL), for LR schedules
    reference: bool = False  # keep the initial policy for reference logprobs (a KL term)
    critic: bool = False  # train a value model too (an advantage estimator needs values)
    routing_replay: ReplayMode = "off"
    lora: LoRAConfig | None = None
    sync_timeout_s: float = 600.0  # a weight-sync peer silent this long has failed
    cpu_threads: int | None = None  # on CPU: this rank's share of the machine's cores
    verify_weights: bool = True  # the run compares engine checksums with this trainer's
    # How the ranks split the model (`train.parallel`); data parallelism is what is left.
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


@dataclass(frozen=True)
class RolloutSetup:
    """What the run decides for one rollout engine of any backend."""

    model_path: str
    device: str
    seed: int
    precision: Precision
    record_routing: ReplayMode = "off"  # "ids": record each token's experts, "ids+weights" too
    lora: LoRAConfig | None = None  # set with lora.sync: adapters (only adapters arrive)
    sync_timeout_s: float = 600.0
    cpu_threads: int | None = None  # on CPU: this engine's share of the machine's cores
    index: int = 0  # this engine's place among the run's (an attached backend's server by it)
    run_dir: str | None = None  # where the engine may keep files of its own (a server's log)


@dataclass
class LogprobResult:
    """Per-token arrays aligned with `batch.tokens` (0 at each sequence's first token)."""

    logprobs: F32
    entropy: F32
    ref_logprobs: F32 | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. moe/routing_agreement


class EngineUnavailable(RuntimeError):
    """Raised by a rollout engine that cannot reach what it runs on (e.g. its server is gone):
    the run treats the engine as failed (its requests move, it is restarted or dropped), not the
    request."""


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses for token-id prompts and takes new weights from the trainer."""

    @property
    def weight_version(self) -> int: ...

    def generate(self, requests: list[GenerateRequest]) -> Iterator[list[GenerateResult]]:
        """Yields results as soon as their sequences finish (a stream, not a batch); those that
        finish together come as one list, which crosses to the rollout manager as one message."""
        ...

    def pause(self) -> None:
        """A running `generate` stops at its next step and yields every unfinished request with
        finish_reason "abort" and its tokens so far."""
        ...

    def resume(self) -> None: ...

    def release_memory(self) -> None:
        """Frees the GPU for a colocated trainer (`Capability.COLOCATE`)."""
        ...

    def resume_memory(self) -> None: ...

    def health(self) -> dict[str, Any]:
        """At least {"ok": bool, "paused": bool, "dtype": str}."""
        ...

    def get_rng_state(self) -> str:
        """The sampling RNG's state, as text (it goes into checkpoints' JSON)."""
        ...

    def set_rng_state(self, state: str) -> None: ...

    # Weight sync: a broadcast group with the trainer (rank 0), or buckets handed over in place.

    def join_weight_sync(self, host: str, port: int, world_size: int, rank: int) -> None:
        """Joins a new weight-sync group (leaving the previous one)."""
        ...

    def leave_weight_sync(self) -> None:
        """Tears the weight-sync group down (a sync lost a member): a receive blocked on it
        returns with an error. Called from another thread than the receive."""
        ...

    def receive_weights(self, plan: SyncPlan, version: int) -> None:
        """Takes one sync's buckets from the group, in plan order; then holds `version`."""
        ...

    def load_bucket(self, plan: SyncPlan, index: int, handle: Any) -> None:
        """Colocated: copies bucket `index` from a handle to the trainer's memory (CUDA IPC)
        before returning; `set_weight_version` ends the sync."""
        ...

    def set_weight_version(self, version: int) -> None: ...

    def weights_checksum(self) -> str:
        """A hash of every weight, equal to the trainer's `weights_checksum(dtype)`."""
        ...


@runtime_checkable
class TrainBackend(Protocol):
    """One rank of a training group. Every call but `sleep`/`wake` is collective: all ranks make
    it, in the same order, with the same batch."""

    def logprobs(self, batch: PackedBatch) -> LogprobResult:
        """The current policy's logprobs (and the reference's, with `TrainSetup.reference`)."""
        ...

    def train_step(self, batch: PackedBatch, loss: PolicyLoss) -> dict[str, float]:
        """One optimizer step; "train/loss", "train/grad_norm", "train/lr" and the loss's
        metrics, the same on every rank."""
        ...

    def profiled(self, path: str) -> AbstractContextManager[None]:
        """What runs inside, under the backend's profiler, written to files whose names start
        with `path` (`telemetry.profile_steps`). Optional: a backend without it is not profiled."""
        ...

    def weight_sync_plan(self, bucket_bytes: int) -> SyncPlan:
        """Names, shapes and dtypes of what engines receive, in buckets."""
        ...

    def join_weight_sync(self, host: str, port: int, world_size: int) -> None:
        """Rank 0 joins a new weight-sync group with the engines, as its rank 0."""
        ...

    def leave_weight_sync(self) -> None:
        """Tears the weight-sync group down (a sync lost a member); the next sync joins anew."""
        ...

    def send_weights(self, plan: SyncPlan) -> int:
        """Rank 0 broadcasts the weights in plan order (the others help gather); bytes sent."""
        ...

    def send_weights_in_place(self, plan: SyncPlan, deliver: BucketDelivery | None) -> int:
        """Colocated: hands each bucket to `deliver(index, handle)`, which returns once the
        engine has copied it; bytes handed over. None: no engine shares this rank's GPU, and the
        rank only takes part in gathering the full tensors."""
        ...

    def weights_checksum(self, dtype: str | None) -> str:
        """The hash engines of weight dtype `dtype` must report after a sync."""
        ...

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...

    def sleep(self) -> None:
        """Colocated: weights and optimizer state off the GPU (`Capability.COLOCATE`)."""
        ...

    def wake(self) -> None: ...


class BucketDelivery(Protocol):
    def __call__(self, index: int, handle: Any) -> None: ...


class CriticBackend(TrainBackend, Protocol):
    """A train backend that declares `Capability.CRITIC`."""

    def values(self, batch: PackedBatch) -> F32:
        """The critic's value before each token, aligned with `batch.tokens`."""
        ...

    def train_value_step(self, batch: PackedBatch, loss: PolicyLoss) -> dict[str, float]: ...
