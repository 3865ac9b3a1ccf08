"""The rollout manager actor: turns the prompt dataset into step batches for the trainer.

It composes small parts, each with one job: the prompt source and encoder, the sample ledger
(ids and where each ends), the producer (rollout function, reward, filters over the engines,
through the dispatcher) and the batch buffer (which step may start when: the only thing that
differs between sync, one_step_off and async). The engines themselves belong to the engine group,
which tells the dispatcher which are ready.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, TypeAlias, cast

import numpy as np
import ray
import structlog
from ray.actor import ActorProxy

from miles.core.config import RunConfig
from miles.core.contracts.components import Capability, Kind
from miles.core.contracts.protocols import OversamplingFilter, PromptGroup, Tokenizer
from miles.core.contracts.types import PackedBatch, Sample, SamplingParams
from miles.core.observability.telemetry import attached, span
from miles.core.registry.factory import build_component
from miles.core.registry.plugins import get_plugin_manager
from miles.runtime.cluster.process import flush_traces, init_actor_process
from miles.runtime.data.check import model_context, too_long
from miles.runtime.data.source import PromptSource, read_rows
from miles.runtime.rollout.buffer import BatchBuffer, BufferPolicy, StepBatch
from miles.runtime.rollout.dispatch import EngineDispatcher, EngineSupervisor, Routes
from miles.runtime.rollout.ledger import SampleLedger
from miles.runtime.rollout.producer import RolloutProducer
from miles.runtime.rollout.prompts import PromptEncoder
from miles.runtime.rollout.rollout_metrics import rollout_metrics
from miles.runtime.rollout.scoring import RewardScorer

log = structlog.get_logger(__name__)


class RolloutManager:
    def __init__(
        self, config: RunConfig, run_dir: str | None, engine_group: ActorProxy[EngineSupervisor]
    ) -> None:
        init_actor_process(run_dir, role="rollout_manager")
        self.config = config
        r = config.rollout
        tokenizer = load_tokenizer(config.model.path)
        self.prompts = PromptEncoder(tokenizer, config.data)
        rows = read_rows(config.data.path, config.data.split)
        eval_rows = read_rows(config.eval.data, config.eval.split) if config.eval.data else []
        self.dropped_long_prompts = 0
        if config.data.drop_long_prompts:  # the rows the pre-launch check counted
            rows, eval_rows = self._fitting(rows), self._fitting(eval_rows)
        self.source = PromptSource(rows, seed=config.seed, shuffle=config.data.shuffle)
        self.eval_rows = eval_rows
        self._sft_source: PromptSource | None = None
        self.ledger = SampleLedger(Path(run_dir) / "samples.jsonl" if run_dir else None)
        self.dispatcher = EngineDispatcher(
            lambda index, generation, reason: engine_group.engine_failed.remote(
                index, generation, reason
            ),
            request_timeout_s=config.fault.request_timeout_s,
            on_weight_update=config.async_.on_weight_update,
        )
        self.producer = _producer(config, self.dispatcher, tokenizer)
        self.policy = BufferPolicy.from_config(config)
        self.buffer = BatchBuffer(
            self.policy,
            steps=config.steps,
            groups_per_step=r.prompts_per_step,
            start=self._start_batch,
            check=self.dispatcher.check,
        )
        self.sampling = SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            min_p=r.min_p,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=tuple(r.stop_token_ids),
            stop_strings=tuple(r.stop),
        )
        self._trace: dict[str, str] = {}
        self._since = time.perf_counter()  # for the idle fraction, since the last take
        self._busy_at_take = 0.0
        self._requeued_at_take = 0
        self._cached_at_take = self._prompt_at_take = 0

    # ── the engine group's side ──────────────────────────────────────────────────────────────────

    @ray.method
    def set_routes(self, routes: Routes) -> None:
        self.dispatcher.set_routes(routes)

    @ray.method
    async def hold(self, routes: Routes) -> None:
        """A weight update begins: `routes` hold requests; returns once none is on an engine."""
        self.dispatcher.set_routes(routes)
        await self.dispatcher.drained()

    # ── producing step batches ───────────────────────────────────────────────────────────────────

    def _new_groups(self, n: int) -> list[PromptGroup]:
        rows = self.source.next(n)
        prompts = self.prompts.encode(rows)
        return self.ledger.new_groups(rows, prompts, self.config.rollout.samples_per_prompt)

    def _start_batch(self, step: int) -> Coroutine[Any, Any, StepBatch]:
        groups = self._new_groups(self.config.rollout.prompts_per_step)  # drawn now, in order
        return self._produce(step, groups)

    async def _produce(self, step: int, groups: list[PromptGroup]) -> StepBatch:
        with attached(self._trace), span("miles.rollout", step=step + 1):
            return await self.producer.produce(step, groups, self.sampling, self._new_groups)

    @ray.method
    async def start(self, first_step: int, version: int, trace: dict[str, str]) -> None:
        """RL begins at `first_step`, with the engines at weight `version`: start producing.
        Batches start in the background, under the run's trace (`trace`)."""
        self._trace = trace
        self._since = time.perf_counter()
        self.buffer.begin(first_step, version)

    @ray.method
    async def take(self, step: int, trace: dict[str, str]) -> tuple[PackedBatch, dict[str, float]]:
        """Batch `step`, once finished; samples too old for the policy are dropped or made again."""
        with attached(trace), span("miles.take", step=step + 1):
            self.buffer.fill()
            held = self.buffer.groups_held
            batch = await self.buffer.take(step)
            version = self.buffer.version
            stale = [k for k in batch.kept if any(self.policy.is_stale(s, version) for s in k[1])]
            regenerated = 0
            if stale:
                batch.kept = [k for k in batch.kept if k not in stale]
                stale_samples = [s for _, samples in stale for s in samples]
                if self.policy.stale == "regenerate":
                    regenerated = len(stale_samples)
                    await self.producer.regenerate(batch, [g for g, _ in stale], self.sampling)
                else:
                    self.ledger.record(stale_samples, step, "stale")
            kept = [s for _, samples in batch.kept for s in samples]
            self.ledger.record(kept, step, "trained")
            self.ledger.record(batch.filtered, step, "filtered")
            metrics = self._metrics(batch, kept, held, len(stale), regenerated)
            if not kept:
                log.warning("every sample of this step was filtered out", step=step + 1)
            self.buffer.fill()
            return PackedBatch.from_samples(kept), metrics

    def _metrics(
        self, batch: StepBatch, kept: list[Sample], held: int, stale: int, regenerated: int
    ) -> dict[str, float]:
        metrics = rollout_metrics(batch, kept, self.config.rollout.samples_per_prompt)
        metrics["rollout/epoch"] = float(self.source.state.epoch)
        if self.config.data.drop_long_prompts:
            metrics["data/dropped_long_prompts"] = float(self.dropped_long_prompts)
        now, dispatcher = time.perf_counter(), self.dispatcher
        busy = dispatcher.busy_s - self._busy_at_take
        wall = max(now - self._since, 1e-9)
        staleness = [self.policy.staleness(s, self.buffer.version) for s in kept]
        metrics.update(
            {
                "async/staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
                "async/staleness_max": float(max(staleness, default=0)),
                "async/buffer_fill": held / self.policy.capacity,
                "async/stale_groups": float(stale),
                "async/stale_regenerated": float(regenerated),
                "async/requeued": float(dispatcher.requeued - self._requeued_at_take),
                # Share of the step's prompt tokens whose KV an engine had cached (a group's
                # shared prompt, an earlier turn); 0 for engines that cache none.
                "rollout/prefix_hit_rate": (dispatcher.cached_tokens - self._cached_at_take)
                / max(dispatcher.prompt_tokens - self._prompt_at_take, 1),
                "perf/rollout_idle_frac": min(max(1.0 - busy / wall, 0.0), 1.0),
                "fault/engine_restarts": float(dispatcher.routes.restarts),
                "fault/engines_dropped": float(dispatcher.routes.dropped),
                **self.ledger.metrics(),
            }
        )
        self._since, self._busy_at_take = now, dispatcher.busy_s
        self._requeued_at_take = dispatcher.requeued
        self._cached_at_take = dispatcher.cached_tokens
        self._prompt_at_take = dispatcher.prompt_tokens
        return metrics

    @ray.method
    async def finish_in_flight(self) -> None:
        """Before a weight update that does not interrupt generation: let batches finish."""
        await self.buffer.finish_in_flight()

    @ray.method
    def weights_updated(self, version: int, synced_through: int) -> None:
        """The engines hold `version`, made by step `synced_through`."""
        self.buffer.weights_updated(version, synced_through)

    @ray.method
    async def close(self) -> None:
        """Colocated: the trainer is about to take the GPUs; generation stops until `open`."""
        await self.buffer.close()

    @ray.method
    def open(self) -> None:
        self.buffer.open()

    # ── evaluation and warm-start ────────────────────────────────────────────────────────────────

    @ray.method
    async def evaluate(self, step: int, trace: dict[str, str]) -> dict[str, float]:
        """One sample per held-out prompt, at the eval temperature."""
        if not self.eval_rows:
            return {}
        with attached(trace), span("miles.eval", step=step):
            rows = self.eval_rows[: self.config.eval.max_prompts]
            sampling = replace(self.sampling, temperature=self.config.eval.temperature)
            # Eval samples take ids of their own range (negative), outside the training ledger.
            groups = [
                PromptGroup(group_id=-1 - i, prompt_ids=ids, row=row, sample_ids=[-1 - i])
                for i, (row, ids) in enumerate(zip(rows, self.prompts.encode(rows), strict=True))
            ]
            samples = [s for g in await self.producer.run_groups(groups, sampling) for s in g]
            rewards = [s.reward or 0.0 for s in samples]
            return {
                "eval/reward_mean": float(np.mean(rewards)),
                "eval/response_len_mean": float(np.mean([len(s.response_ids) for s in samples])),
                "eval/prompts": float(len(samples)),
            }

    @ray.method
    def sft_batch(self, batch_size: int) -> PackedBatch:
        """The next warm-start batch."""
        ws = self.config.warmstart
        if self._sft_source is None:
            assert ws.data is not None
            self._sft_source = PromptSource(read_rows(ws.data), seed=self.config.seed)
        return self.prompts.sft_batch(self._sft_source.next(batch_size), ws)

    # ── checkpointed state ───────────────────────────────────────────────────────────────────────

    @ray.method
    async def get_state(self) -> dict[str, object]:
        """Data position, ids and the buffer. Batches in flight are finished first and saved
        with it, so none is lost or generated twice on resume."""
        buffer = await self.buffer.snapshot()
        return {
            "data": self.source.get_state(),
            **self.ledger.get_state(),
            "next_step": self.buffer.next_step,
            "buffer": buffer,
        }

    @ray.method
    def set_state(self, state: dict[str, Any]) -> None:
        self.source.set_state(state["data"])
        self.ledger.set_state(state)
        self.buffer.next_step = int(state.get("next_step", 0))
        self.buffer.restore(state.get("buffer", []))

    @ray.method
    def flush(self) -> None:
        """Sends this process's buffered spans on."""
        flush_traces()

    def _fitting(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`rows` without those whose prompt is longer than the model's context."""
        context = model_context(self.config)
        if context is None or not rows:
            return rows
        key = self.config.data.prompt_key
        extra = len((self.config.data.system_prompt or "").encode("utf-8"))
        long = too_long(rows, key, partial(self.prompts.encode, key=key), context, extra)
        self.dropped_long_prompts += len(long)
        return [row for i, row in enumerate(rows) if i not in long]


# What `ray.remote(RolloutManager)...remote(...)` returns: the handle the controller (and the
# engine group) call it by.
RolloutHandle: TypeAlias = "ActorProxy[RolloutManager]"


def load_tokenizer(model_path: str) -> Tokenizer:
    """The checkpoint's tokenizer, from whichever plugin loads tokenizers (miles-torch)."""
    tokenizer = get_plugin_manager().pm.hook.miles_load_tokenizer(model_path=model_path)
    if tokenizer is None:
        raise RuntimeError(
            f"no installed plugin loads the tokenizer of {model_path!r}; install a backend "
            "package that does (miles-torch)"
        )
    return cast(Tokenizer, tokenizer)


def _producer(
    config: RunConfig, dispatcher: EngineDispatcher, tokenizer: Tokenizer
) -> RolloutProducer:
    """The run's rollout function, reward and filters, each built once."""
    manager = get_plugin_manager()
    reward_spec = manager.get(Kind.REWARD, config.reward.name).spec
    scorer = RewardScorer(
        build_component(Kind.REWARD, config.reward, path="reward"),
        config.reward.name,
        tokenizer,
        groups=reward_spec.has(Capability.SCORES_GROUPS),
        on_error=config.reward.on_error,
        timeout_s=config.reward.timeout_s,
    )
    filters, rounds = [], 0
    for i, ref in enumerate(config.filters):
        built = build_component(Kind.FILTER, ref, path=f"filters[{i}]")
        if manager.get(Kind.FILTER, ref.name).spec.has(Capability.OVERSAMPLES):
            rounds = max(rounds, cast(OversamplingFilter, built).oversample_rounds)
        filters.append(built)
    rollout_fn = build_component(
        Kind.ROLLOUT_FUNCTION, config.rollout.function, path="rollout.function"
    )
    return RolloutProducer(
        rollout_fn, scorer, filters, dispatcher, tokenizer, oversample_rounds=rounds
    )
