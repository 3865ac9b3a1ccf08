"""The Ray actor around one rank of a train backend (any `TrainBackend`).

Every rank receives the same batch object (one `ray.put`) and runs every call, because FSDP-style
backends need all ranks in each collective; rank 0 alone talks to the rollout engines.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from miles.core.algorithm import (
    WithEntropyBonus,
    WithKL,
    loss_weights,
    mismatch_metrics,
    sequence_sums,
    spread_advantages,
    token_seq_index,
)
from miles.core.checksum import tensors_checksum
from miles.core.components import Kind
from miles.core.config import RunConfig
from miles.core.factory import build_component
from miles.core.runtime.placement import quantizes
from miles.core.runtime.process import flush_traces, free_port, init_actor_process, node_address
from miles.core.telemetry import attached, span
from miles.core.types import PackedBatch
from miles.core.weight_sync import SyncGroup, SyncPlan, meta_of, plan_buckets


def train_options(config: RunConfig) -> dict[str, Any]:
    """The backend's options, with what the rest of the run already decides filled in."""
    options = dict(config.train.options)
    # Train-side logprobs must use the rollout's sampling temperature (0 means greedy: use 1).
    options.setdefault("temperature", config.rollout.temperature or 1.0)
    options.setdefault("ref_model", config.algorithm.kl.coef > 0)
    options.setdefault("routing_replay", config.moe.routing_replay)
    if config.lora is not None:
        options.setdefault("lora", dataclasses.asdict(config.lora))
    if _needs_values(config):
        options.setdefault("critic", True)
    if options.get("lr_schedule", "constant") != "constant":
        options.setdefault("total_steps", config.steps + config.warmstart.steps)
    return options


def add_lora_deltas(base: Any, adapters: dict[str, torch.Tensor], scaling: float) -> Any:
    """`base` (name, tensor) pairs with scaling * B @ A added to each adapted weight."""
    for name, tensor in base:
        module = name.removesuffix(".weight")
        a, b = adapters.get(f"{module}.lora_A.weight"), adapters.get(f"{module}.lora_B.weight")
        if a is None or b is None:
            yield name, tensor
        else:
            delta = scaling * (b.float() @ a.float())  # as the engine computes it
            yield name, (tensor.float() + delta.to(tensor.device)).to(tensor.dtype)


def _needs_values(config: RunConfig) -> bool:
    """Whether the advantage estimator works from a critic's values (e.g. gae)."""
    advantage = build_component(Kind.ADVANTAGE, config.algorithm.advantage)
    return bool(getattr(advantage, "needs_values", False))


class TrainActor:
    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        config: RunConfig,
        run_dir: str | None,
        device: str,
        num_threads: int | None,
    ) -> None:
        init_actor_process(run_dir, role=f"train{rank}", num_threads=num_threads)
        self.rank, self.config, self.device = rank, config, device
        self.precision = build_component(Kind.PRECISION, config.precision, path="precision")
        converter = getattr(self.precision, "convert_model", None)
        extra = {"model_converter": converter} if quantizes(self.precision) else {}
        self.backend = build_component(
            Kind.TRAIN_BACKEND,
            config.train.backend,
            config.model.path,
            options=train_options(config),
            path="train",
            rank=rank,
            world_size=world_size,
            master_addr=master_addr,
            master_port=master_port,
            device=device,
            seed=config.seed,
            **extra,
        )
        algo = config.algorithm
        self.advantage = build_component(Kind.ADVANTAGE, algo.advantage, path="algorithm.advantage")
        self.loss = build_component(Kind.LOSS, algo.loss, path="algorithm.loss")
        self.kl = None
        if algo.kl.coef:
            self.kl = build_component(Kind.KL, algo.kl.estimator, path="algorithm.kl.estimator")
            if algo.kl.mode == "loss":
                self.loss = WithKL(self.loss, self.kl, algo.kl.coef)
        if algo.entropy_coef:
            self.loss = WithEntropyBonus(self.loss, algo.entropy_coef)
        self.value_loss = None
        if getattr(self.advantage, "needs_values", False):
            self.value_loss = build_component(
                Kind.LOSS, algo.value_loss, path="algorithm.value_loss"
            )
        self.correction = None
        if algo.correction is not None:
            self.correction = build_component(
                Kind.CORRECTION, algo.correction, path="algorithm.correction"
            )
        self._sft_loss: Any = None
        self._sync: SyncGroup | None = None

    # ── training ─────────────────────────────────────────────────────────────────────────────────

    def train(self, batch: PackedBatch, step: int, trace: dict[str, str]) -> dict[str, float]:
        """Advantages and loss weights (every rank computes the same), old and reference
        logprobs, then one optimizer step with the RL loss."""
        with attached(trace), span("miles.train_step", step=step, rank=self.rank):
            algo = self.config.algorithm
            with span("miles.logprobs", step=step, rank=self.rank):
                out = self.backend.logprobs(batch)
                routing: dict[str, float] = getattr(self.backend, "routing_metrics", dict)()
            trainer_lp = out["logprobs"].astype(np.float32)
            batch.ref_logprobs = out.get("ref_logprobs")
            # Before the update: how far the engine's view of the sampled tokens is from the
            # trainer's. 0 up to float error when both run the same weights and numerics.
            metrics = mismatch_metrics(trainer_lp, batch.rollout_logprobs, batch.loss_mask)
            metrics.update(routing)
            token_penalty = None
            if self.kl is not None and algo.kl.mode == "reward":
                kl = self.kl(torch.from_numpy(trainer_lp), torch.from_numpy(batch.ref_logprobs))
                token_penalty = algo.kl.coef * kl.numpy() * batch.loss_mask
                metrics["train/kl_reward_penalty"] = float(
                    sequence_sums(token_penalty, batch).mean()
                )
            if self.value_loss is not None:
                self._token_advantages(batch, token_penalty, step, metrics)
            else:
                rewards = batch.rewards
                if token_penalty is not None:
                    rewards = (rewards - sequence_sums(token_penalty, batch)).astype(np.float32)
                advantages = np.asarray(self.advantage(rewards, batch.group_ids), np.float32)
                spread_advantages(batch, advantages)
                metrics["train/advantage_abs_mean"] = float(np.abs(advantages).mean())
            is_weights = self._correct(batch, trainer_lp, metrics)
            batch.loss_weights = loss_weights(batch, algo.aggregation, algo.seq_sum_normalizer)
            if is_weights is not None:
                batch.loss_weights = (batch.loss_weights * is_weights).astype(np.float32)
            batch.old_logprobs = trainer_lp if algo.old_logprobs == "trainer" else None
            if batch.old_logprobs is None:
                batch.old_logprobs = batch.rollout_logprobs
            metrics.update(self.backend.train_step(batch, self.loss))
            if self.value_loss is not None:
                metrics.update(self.backend.train_value_step(batch, self.value_loss))
            return metrics

    def _token_advantages(
        self,
        batch: PackedBatch,
        token_penalty: npt.NDArray[np.float64] | None,
        step: int,
        metrics: dict[str, float],
    ) -> None:
        """PPO with a critic: per-token advantages and return targets from the critic's values."""
        with span("miles.values", step=step, rank=self.rank):
            values = np.asarray(self.backend.values(batch), np.float32)
        advantages, returns = self.advantage.token_advantages(
            batch.rewards, values, batch.offsets, batch.loss_mask, token_penalty
        )
        batch.advantages, batch.values, batch.returns = advantages, values, returns
        trained = batch.loss_mask > 0
        metrics["train/advantage_abs_mean"] = float(np.abs(advantages[trained]).mean())
        metrics["critic/values_mean"] = float(values[trained].mean())

    def _correct(
        self, batch: PackedBatch, trainer_lp: npt.NDArray[np.float32], metrics: dict[str, float]
    ) -> npt.NDArray[np.float32] | None:
        """Applies the mismatch correction: tokens it drops leave the loss mask (and so the
        aggregation's denominator); its importance weights scale each token's loss weight."""
        if self.correction is None:
            metrics["train/is_clipfrac"] = 0.0
            return None
        weights, keep, extra = self.correction(
            torch.from_numpy(trainer_lp),
            torch.from_numpy(batch.rollout_logprobs),
            torch.from_numpy(batch.loss_mask),
            torch.from_numpy(token_seq_index(batch)),
        )
        metrics.update({k: float(v) for k, v in extra.items()})
        batch.loss_mask = (batch.loss_mask * keep.numpy()).astype(np.float32)
        return np.asarray(weights.detach().numpy(), np.float32)

    def sft(self, batch: PackedBatch, step: int, trace: dict[str, str]) -> dict[str, float]:
        """One supervised step (the warm-start stage) with the `sft` loss, token mean."""
        if self._sft_loss is None:
            self._sft_loss = build_component(Kind.LOSS, "sft")
        batch.loss_weights = loss_weights(batch, "token_mean")
        with attached(trace), span("miles.sft_step", step=step, rank=self.rank):
            return dict(self.backend.train_step(batch, self._sft_loss))

    # ── weights ──────────────────────────────────────────────────────────────────────────────────

    def _rollout_weights(self) -> Any:
        return self.precision.convert_for_rollout(self.backend.named_weights())

    def sync_plan(self, bucket_bytes: int) -> SyncPlan:
        """Names, shapes and dtypes of what engines receive (collective: all ranks call it)."""
        return plan_buckets((meta_of(n, t) for n, t in self._rollout_weights()), bucket_bytes)

    def sync_address(self) -> tuple[str, int]:
        return node_address(), free_port()

    def init_sync(self, host: str, port: int, world_size: int) -> None:
        if self.rank == 0:
            if self._sync is not None:
                self._sync.close()
            timeout = self.config.fault.request_timeout_s
            self._sync = SyncGroup(host, port, world_size, 0, device=self.device, timeout_s=timeout)

    def send_weights(self, plan: SyncPlan, version: int, trace: dict[str, str]) -> int:
        """Streams weights to the engines (collective over ranks; rank 0 broadcasts)."""
        with attached(trace), span("miles.weight_sync.send", version=version, rank=self.rank):
            if self.rank == 0:
                assert self._sync is not None, "init_sync first"
                return self._sync.send(plan, self._rollout_weights())
            for _ in self._rollout_weights():
                pass  # other ranks join the all-gathers that materialise each full tensor
            return 0

    def send_weights_ipc(
        self, plan: SyncPlan, version: int, engines: list[Any], trace: dict[str, str]
    ) -> int:
        """Colocated: rank r hands each bucket to engine r on its own GPU (CUDA IPC), one round
        trip per bucket (collective over ranks: every rank materialises every full tensor)."""
        import ray

        from miles.core import ipc

        engine = engines[self.rank] if self.rank < len(engines) else None
        device = (
            torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else "cpu"
        )
        sent = 0
        with attached(trace), span("miles.weight_sync.ipc", version=version, rank=self.rank):
            tensors = iter(self._rollout_weights())
            for index, bucket in enumerate(plan.buckets):
                flat = ipc.pack_bucket(bucket, tensors, device)
                if engine is not None:
                    ray.get(engine.load_bucket.remote(plan, index, ipc.share(flat)))
                    sent += flat.numel() * flat.element_size()
                del flat  # only now: the engine has copied out of it
            if next(tensors, None) is not None:
                raise RuntimeError("weight sync: the trainer has more tensors than the sync plan")
            if engine is not None:
                ray.get(engine.set_weight_version.remote(version))
        return sent

    def sleep(self) -> None:
        """Colocated: weights and optimizer state to host memory while the engines generate."""
        self.backend.sleep()

    def wake(self) -> None:
        self.backend.wake()

    def checksum(self, dtype: str | None = None) -> str:
        """Hash of the weights as engines should hold them, cast to the engines' `dtype` when
        the rollout runs in another one (collective; rank 0's is used)."""
        decoder = None
        if quantizes(self.precision):  # what a dequantizing engine will hold
            decoder = self.precision.rollout_decoder(getattr(torch, dtype or "float32"))
        lora = self.config.lora
        if lora is not None and lora.sync == "adapters" and decoder is not None:
            # The engine converted its own base to the format and adds the adapters to it.
            base = decoder(
                self.precision.convert_for_rollout(self.backend.named_weights(base=True))
            )
            adapters = dict(self._rollout_weights())  # as sent: in the engines' dtype
            weights = add_lora_deltas(base, adapters, lora.alpha / lora.rank)
        else:
            # What engines hold: with LoRA adapters synced alone, base + adapters.
            weights = self.precision.convert_for_rollout(self.backend.named_weights(merged=True))
            if decoder is not None:
                weights = decoder(weights)
        if dtype is not None:
            cast = getattr(torch, dtype)
            weights = ((n, t.to(cast) if t.is_floating_point() else t) for n, t in weights)
        return tensors_checksum(weights)

    # ── checkpoints ──────────────────────────────────────────────────────────────────────────────

    def save(self, path: str, trace: dict[str, str]) -> None:
        with attached(trace), span("miles.checkpoint.train", rank=self.rank):
            self.backend.save(path)

    def load(self, path: str) -> None:
        self.backend.load(path)

    def flush(self) -> None:
        flush_traces()
