"""The rollout manager actor: owns the data, the rollout function, rewards, filters and engines.

It produces step batches into a buffer: for each step it draws prompts, tokenizes each once, runs
the rollout function for every group concurrently (the dispatcher batches their requests onto the
engines), scores each finished group and filters. When a batch may start, and how old a sample may
be when the trainer takes it, is the buffer policy's call (`buffer.BufferPolicy`); that policy is
all that differs between the sync, one_step_off and async modes.

Every sample has an id, and each id ends in exactly one place, written to `samples.jsonl`:
trained, filtered, or stale (dropped for being too old).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from miles.core.components import Kind
from miles.core.config import RunConfig
from miles.core.data import PromptSource, read_rows
from miles.core.factory import build_component
from miles.core.protocols import PromptGroup
from miles.core.runtime.buffer import BufferPolicy, StepBatch
from miles.core.runtime.dispatch import EngineDispatcher
from miles.core.runtime.engine_pool import EngineLauncher, EnginePool
from miles.core.runtime.process import flush_traces, init_actor_process
from miles.core.runtime.scoring import RewardScorer
from miles.core.telemetry import attached, span
from miles.core.types import PackedBatch, Sample, SampleStatus, SamplingParams
from miles.core.weight_sync import SyncPlan

log = structlog.get_logger(__name__)


class _Context:
    """The `RolloutContext` handed to rollout functions."""

    def __init__(self, dispatcher: EngineDispatcher, sampling: SamplingParams, tokenizer: Any):
        self._dispatcher, self._sampling, self._tokenizer = dispatcher, sampling, tokenizer

    @property
    def sampling(self) -> SamplingParams:
        return self._sampling

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    async def generate(self, requests: list[Any]) -> list[Any]:
        return await self._dispatcher.generate(requests)


def _messages(prompt: Any) -> list[dict[str, str]]:
    """A prompt field as chat messages: a string is one user message; a list of
    {"role", "content"} messages (as in many RL datasets) is taken as it is."""
    if not isinstance(prompt, list):
        return [{"role": "user", "content": str(prompt)}]
    if all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in prompt):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    raise ValueError(
        f"data prompt must be a string or a list of {{role, content}} messages, got "
        f"{str(prompt)[:80]!r}"
    )


def _plain_text(prompt: Any) -> str:
    if not isinstance(prompt, list):
        return str(prompt)
    raise ValueError(
        "data.chat_template: false needs prompts that are strings; this one is a list of "
        "messages: set data.chat_template: true"
    )


class RolloutManager:
    def __init__(
        self,
        config: RunConfig,
        run_dir: str | None,
        engines: list[Any],
        launcher: EngineLauncher | None = None,
    ) -> None:
        init_actor_process(run_dir, role="rollout_manager")
        from miles.core.family import load_tokenizer

        self.config = config
        self.tokenizer = load_tokenizer(config.model.path)
        self.source = PromptSource(
            read_rows(config.data.path, config.data.split),
            seed=config.seed,
            shuffle=config.data.shuffle,
        )
        self.eval_rows = read_rows(config.eval.data, config.eval.split) if config.eval.data else []
        self.rollout_fn = build_component(
            Kind.ROLLOUT_FUNCTION, config.rollout.function, path="rollout.function"
        )
        self.scorer = RewardScorer(
            build_component(Kind.REWARD, config.reward, path="reward"),
            config.reward.name,
            self.tokenizer,
            on_error=config.reward.on_error,
            timeout_s=config.reward.timeout_s,
        )
        self.filters = [
            build_component(Kind.FILTER, f, path=f"filters[{i}]")
            for i, f in enumerate(config.filters)
        ]
        self.pool = EnginePool(launcher, engines, config.fault, on_change=self._on_pool_change)
        self.dispatcher = EngineDispatcher(
            self.pool,
            request_timeout_s=config.fault.request_timeout_s,
            on_weight_update=config.async_.on_weight_update,
        )
        self.policy = BufferPolicy.from_config(config)
        r = config.rollout
        self.sampling = SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=tuple(r.stop_token_ids),
            stop_strings=tuple(r.stop),
        )
        self._sft_source: PromptSource | None = None
        self._next_sample_id = 0  # unique over the run, and checkpointed
        self._next_group_id = 0
        # The buffer: step -> its batch, in flight (a task) or finished.
        self._batches: dict[int, asyncio.Future[StepBatch]] = {}
        self._restored: dict[int, StepBatch] = {}  # finished batches read from a checkpoint
        self._next_step = 0  # the next batch to start
        self._synced_through = -1  # the engines hold the weights made by this step
        self._version = 0  # ... which have this weight version
        self._started = False  # no RL batch before `start`
        self._trace: dict[str, str] = {}
        self._open = True  # colocated runs close generation while the trainer holds the GPU
        self._frozen = 0  # > 0 while a checkpoint waits for the batches in flight
        self._sync_members: list[int] = []  # engine indexes in the current weight-sync group
        self._ledger = Path(run_dir) / "samples.jsonl" if run_dir else None
        self._counts = {"created": 0, "trained": 0, "filtered": 0, "stale": 0}
        self._since = time.perf_counter()  # for the idle fraction, since the last take
        self._busy_at_take = 0.0
        self._requeued_at_take = 0

    # ── prompts ──────────────────────────────────────────────────────────────────────────────────

    def _prompt_ids(self, rows: list[dict[str, Any]], key: str) -> list[list[int]]:
        """Token ids of each row's prompt, tokenized once here (in one batched call)."""
        for row in rows:
            if key not in row:
                raise KeyError(
                    f"data row has no {key!r} field (fields: {sorted(row)}); set data.prompt_key"
                )
        prompts = [row[key] for row in rows]
        if self.config.data.chat_template:
            system = self.config.data.system_prompt
            chats = [
                [
                    *([{"role": "system", "content": system}] if system else []),
                    *_messages(prompt),
                ]
                for prompt in prompts
            ]
            texts: Any = self.tokenizer.apply_chat_template(
                chats, add_generation_prompt=True, tokenize=False
            )
        else:
            texts = [_plain_text(prompt) for prompt in prompts]
        # The rendered template already holds every special token it wants.
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def _groups_for(self, rows: list[dict[str, Any]], n: int) -> list[PromptGroup]:
        prompts = self._prompt_ids(rows, self.config.data.prompt_key)
        return [
            PromptGroup(
                group_id=self._take_ids(1, "group")[0],
                prompt_ids=ids,
                row=row,
                sample_ids=self._take_ids(n, "sample"),
            )
            for row, ids in zip(rows, prompts, strict=True)
        ]

    def _take_ids(self, n: int, kind: str) -> list[int]:
        if kind == "group":
            start, self._next_group_id = self._next_group_id, self._next_group_id + n
        else:
            start, self._next_sample_id = self._next_sample_id, self._next_sample_id + n
        return list(range(start, start + n))

    # ── producing step batches ───────────────────────────────────────────────────────────────────

    async def _run_groups(
        self, groups: list[PromptGroup], sampling: SamplingParams
    ) -> list[list[Sample]]:
        ctx = _Context(self.dispatcher, sampling, self.tokenizer)

        async def run_one(group: PromptGroup) -> list[Sample]:
            with span("miles.rollout_group", group=group.group_id):
                samples = await self.rollout_fn(ctx, group)
            with span("miles.reward", group=group.group_id):
                await self.scorer.score(samples)
            return list(samples)

        return list(await asyncio.gather(*(run_one(g) for g in groups)))

    def _filter(self, group: list[Sample]) -> list[Sample]:
        for f in self.filters:
            group = f(group)
        return group

    def _maybe_start(self) -> None:
        """Starts every batch the buffer policy allows now."""
        per_step = self.config.rollout.prompts_per_step
        while (
            self._started
            and self._open
            and not self._frozen
            and self._next_step < self.config.steps
        ):
            step = self._next_step
            held = per_step * len(self._batches)
            if not self.policy.may_start(step, self._synced_through, held, per_step):
                return
            self._next_step += 1
            # Prompts are drawn (and ids handed out) now, in step order: the data order does not
            # depend on how the batches in flight interleave.
            groups = self._groups_for(
                self.source.next(per_step), self.config.rollout.samples_per_prompt
            )
            self._counts["created"] += sum(len(g.sample_ids) for g in groups)
            self._batches[step] = asyncio.ensure_future(self._produce(step, groups))

    async def _produce(self, step: int, groups: list[PromptGroup]) -> StepBatch:
        with attached(self._trace), span("miles.rollout", step=step):
            target = len(groups)
            # Filters that drop whole groups (dynamic sampling) may ask for extra rounds.
            rounds = max((getattr(f, "oversample_rounds", 0) for f in self.filters), default=0)
            batch = StepBatch(step)
            t0 = time.perf_counter()
            while True:
                for group, samples in zip(
                    groups, await self._run_groups(groups, self.sampling), strict=True
                ):
                    batch.generated += samples
                    kept = self._filter(samples)
                    kept_ids = {s.sample_id for s in kept}
                    batch.filtered += [s for s in samples if s.sample_id not in kept_ids]
                    if kept:
                        batch.kept.append((group, kept))
                missing = target - len(batch.kept)
                if missing <= 0 or batch.extra_rounds >= rounds:
                    break
                batch.extra_rounds += 1
                groups = self._groups_for(
                    self.source.next(missing), self.config.rollout.samples_per_prompt
                )
                self._counts["created"] += sum(len(g.sample_ids) for g in groups)
            batch.seconds = time.perf_counter() - t0
            return batch

    # ── the trainer's side ───────────────────────────────────────────────────────────────────────

    async def take(self, step: int, trace: dict[str, str]) -> tuple[PackedBatch, dict[str, float]]:
        """Batch `step`, once finished; samples too old for the policy are dropped or made again."""
        with attached(trace), span("miles.take", step=step):
            self._maybe_start()
            if step not in self._batches:
                raise RuntimeError(
                    f"rollout batch {step} has not started (the engines hold the weights of step "
                    f"{self._synced_through}); the controller and the rollout manager disagree"
                )
            held = self.config.rollout.prompts_per_step * len(self._batches)
            batch = await self._wait(self._batches[step])
            del self._batches[step]
            stale_groups = [
                (g, samples)
                for g, samples in batch.kept
                if any(self.policy.is_stale(s, self._version) for s in samples)
            ]
            regenerated = 0
            if stale_groups:
                batch.kept = [k for k in batch.kept if k not in stale_groups]
                stale = [s for _, samples in stale_groups for s in samples]
                if self.policy.stale == "regenerate":
                    regenerated = len(stale)
                    groups = [g for g, _ in stale_groups]
                    for group, samples in zip(
                        groups, await self._run_groups(groups, self.sampling), strict=True
                    ):
                        batch.generated += samples
                        kept = self._filter(samples)
                        if kept:
                            batch.kept.append((group, kept))
                        else:
                            batch.filtered += samples
                else:
                    self._record(stale, step, "stale")
                    self._counts["stale"] += len(stale)
            kept = [s for _, samples in batch.kept for s in samples]
            self._record(kept, step, "trained")
            self._record(batch.filtered, step, "filtered")
            self._counts["trained"] += len(kept)
            self._counts["filtered"] += len(batch.filtered)
            metrics = self._metrics(batch, kept, held, len(stale_groups), regenerated)
            if not kept:
                log.warning("every sample of this step was filtered out", step=step)
            self._maybe_start()
            return PackedBatch.from_samples(kept), metrics

    async def _wait(self, future: asyncio.Future[StepBatch]) -> StepBatch:
        """Waits for a batch, failing the run as soon as an engine is past its restart budget."""
        while True:
            done, _ = await asyncio.wait({future}, timeout=1.0)
            if done:
                return future.result()
            self.pool.check()

    def _metrics(
        self, batch: StepBatch, kept: list[Sample], held: int, stale: int, regenerated: int
    ) -> dict[str, float]:
        metrics = _rollout_metrics(batch.generated, kept, batch.seconds)
        generated_groups = len(batch.generated) // max(self.config.rollout.samples_per_prompt, 1)
        metrics["rollout/dropped_group_frac"] = 1 - len(batch.kept) / max(generated_groups, 1)
        metrics["rollout/oversample_rounds"] = float(batch.extra_rounds)
        metrics["rollout/epoch"] = float(self.source.state.epoch)
        metrics["perf/rollout_s"] = batch.seconds  # generating it; the trainer may wait less
        now = time.perf_counter()
        busy = self.dispatcher.busy_s - self._busy_at_take
        wall = max(now - self._since, 1e-9)
        self._since, self._busy_at_take = now, self.dispatcher.busy_s
        staleness = [self.policy.staleness(s, self._version) for s in kept]
        metrics.update(
            {
                "async/staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
                "async/staleness_max": float(max(staleness, default=0)),
                "async/buffer_fill": held / self.policy.capacity,
                "async/stale_groups": float(stale),
                "async/stale_regenerated": float(regenerated),
                "async/requeued": float(self.dispatcher.requeued - self._requeued_at_take),
                "perf/rollout_idle_frac": min(max(1.0 - busy / wall, 0.0), 1.0),
                "fault/engine_restarts": float(self.pool.restarts_total),
                **{f"samples/{k}": float(v) for k, v in self._counts.items()},
            }
        )
        self._requeued_at_take = self.dispatcher.requeued
        return metrics

    def _record(self, samples: list[Sample], step: int, fate: str) -> None:
        """One line per sample in samples.jsonl: where each id ended."""
        if self._ledger is None or not samples:
            return
        with self._ledger.open("a") as f:
            for s in samples:
                versions = (
                    s.weight_version if isinstance(s.weight_version, list) else [s.weight_version]
                )
                f.write(
                    json.dumps(
                        {
                            "sample_id": s.sample_id,
                            "group_id": s.group_id,
                            "step": step,
                            "fate": fate,
                            "reward": s.reward,
                            "weight_versions": [min(versions, default=0), max(versions, default=0)],
                        }
                    )
                    + "\n"
                )

    # ── evaluation and warm-start ────────────────────────────────────────────────────────────────

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
                for i, (row, ids) in enumerate(
                    zip(rows, self._prompt_ids(rows, self.config.data.prompt_key), strict=True)
                )
            ]
            generated = await self._run_groups(groups, sampling)
            samples = [s for g in generated for s in g]
            rewards = [s.reward or 0.0 for s in samples]
            return {
                "eval/reward_mean": float(np.mean(rewards)),
                "eval/response_len_mean": float(np.mean([len(s.response_ids) for s in samples])),
                "eval/prompts": float(len(samples)),
            }

    def sft_batch(self, batch_size: int) -> PackedBatch:
        """The next warm-start batch: prompt (chat-templated like RL prompts) plus the response
        tokens and EOS, trained on the response only."""
        ws = self.config.warmstart
        if self._sft_source is None:
            assert ws.data is not None
            self._sft_source = PromptSource(read_rows(ws.data), seed=self.config.seed)
        rows = self._sft_source.next(batch_size)
        prompts = self._prompt_ids(rows, ws.prompt_key)
        responses = self.tokenizer(
            [str(r[ws.response_key]) for r in rows], add_special_tokens=False
        )["input_ids"]
        eos = self.tokenizer.eos_token_id
        samples = [
            Sample(prompt_ids=p, response_ids=[*r, *([int(eos)] if eos is not None else [])])
            for p, r in zip(prompts, responses, strict=True)
        ]
        return PackedBatch.from_samples(samples)

    # ── the run's start, weights and memory ──────────────────────────────────────────────────────

    async def start(self, first_step: int, version: int, trace: dict[str, str]) -> None:
        """RL begins at `first_step`, with the engines at weight `version`: start producing.
        Batches start in the background, under the run's trace (`trace`)."""
        self._trace = trace
        self._synced_through, self._version = first_step - 1, version
        self._next_step = max(self._next_step, first_step)
        for step, batch in sorted(self._restored.items()):  # finished before the checkpoint
            future: asyncio.Future[StepBatch] = asyncio.get_running_loop().create_future()
            future.set_result(batch)
            self._batches[step] = future
        self._restored = {}
        self._since = time.perf_counter()
        self._started = True
        self.pool.start_health_checks()
        self._maybe_start()

    def engine_handles(self) -> list[Any]:
        """The engines in the weight-sync group, in rank order."""
        return [self.pool.slots[i].handle for i in self._sync_members]

    def alive_handles(self) -> list[Any]:
        """Colocated (IPC) sync: engine i's handle at index i (it shares train rank i's GPU), None
        where an engine is down."""
        self._sync_members = [s.index for s in self.pool.alive()]
        return [s.handle if s.state != "down" else None for s in self.pool.slots]

    def reset_sync_group(self) -> None:
        """The trainer side of the group is new (a train-group restart): rebuild before use."""
        self._sync_members = []

    async def begin_update(self, finish_batches: bool = True) -> bool:
        """Readies the engines for new weights; returns whether the sync group must be rebuilt
        (an engine was restarted since it was built).

        A policy without partial rollouts first lets the batches in flight finish (unless
        `finish_batches` is False: a re-send that brings restarted engines in); then the
        dispatcher holds new requests, the engines pause (handing back what they were doing),
        and this returns once nothing is running on any engine.
        """
        self.pool.check()
        if finish_batches and not self.policy.interrupt_on_update:
            for future in list(self._batches.values()):
                await self._wait(future)
        self.dispatcher.hold()
        alive = self.pool.alive()
        await asyncio.gather(*(_quietly(s.handle.pause.remote()) for s in alive))
        await self.dispatcher.drained()
        return [s.index for s in self.pool.alive()] != self._sync_members

    def sync_world(self) -> int:
        """Fixes the members of the next weight-sync group (the alive engines); its world size."""
        self._sync_members = [s.index for s in self.pool.alive()]
        return len(self._sync_members) + 1  # rank 0 is the trainer

    async def init_sync(self, host: str, port: int) -> None:
        """The members join the new group (as the trainer does, at the same time)."""
        world = len(self._sync_members) + 1
        await asyncio.gather(
            *(
                h.init_sync.remote(host, port, world, r + 1)
                for r, h in enumerate(self.engine_handles())
            )
        )

    async def receive_weights(self, plan: SyncPlan, version: int, trace: dict[str, str]) -> None:
        await asyncio.gather(
            *(h.receive_weights.remote(plan, version, trace) for h in self.engine_handles())
        )

    async def end_update(self, version: int, synced_through: int) -> None:
        """The engines hold `version`, made by step `synced_through`: resume generating."""
        self._version, self._synced_through = version, synced_through
        self.pool.mark_synced()
        await asyncio.gather(*(_quietly(h.resume.remote()) for h in self.engine_handles()))
        self.dispatcher.release()
        self._maybe_start()

    async def sync_failed(self) -> None:
        """A weight sync broke off: find the engines that died in it, and let the rest go on."""
        for slot in self.pool.ready() + self.pool.stale():
            try:
                await asyncio.wait_for(_await(slot.handle.health.remote()), 30)
            except Exception as exc:
                self.pool.fail(slot, f"died during a weight sync: {exc!r}")
        self._sync_members = []  # rebuild the group before the next try

    def needs_recovery(self) -> bool:
        """Requests are waiting but no engine can take them until a weight sync (every engine
        is stale after a restart)."""
        self.pool.check()
        return not self.pool.ready() and bool(self.pool.stale())

    async def release_memory(self) -> None:
        """Colocated: the trainer is about to use the GPUs. Generation closes until `open`."""
        self._open = False
        for future in list(self._batches.values()):
            await self._wait(future)
        await asyncio.gather(*(h.release_memory.remote() for h in self._all_handles()))

    async def resume_memory(self) -> None:
        await asyncio.gather(*(h.resume_memory.remote() for h in self._all_handles()))

    def open(self) -> None:
        self._open = True
        self._maybe_start()

    def _all_handles(self) -> list[Any]:
        return [s.handle for s in self.pool.alive()]

    def _on_pool_change(self) -> None:
        self.dispatcher.kick()

    async def flush(self) -> None:
        """Sends the buffered spans of this process and of every live engine on."""
        flush_traces()
        await asyncio.gather(*(_quietly(s.handle.flush.remote()) for s in self.pool.alive()))

    async def checksums(self) -> list[str]:
        return list(await asyncio.gather(*(h.checksum.remote() for h in self._all_handles())))

    async def weight_versions(self) -> list[int]:
        return list(await asyncio.gather(*(h.weight_version.remote() for h in self._all_handles())))

    # ── checkpointed state ───────────────────────────────────────────────────────────────────────

    async def get_state(self) -> dict[str, Any]:
        """Data position, ids, the engines' RNG states and the buffer. Batches in flight are
        finished first and saved with it, so none is lost or generated twice on resume."""
        self._frozen += 1
        try:
            for future in list(self._batches.values()):
                await self._wait(future)
            buffer = [f.result().to_json() for f in self._batches.values()]
            rng = await asyncio.gather(*(s.handle.get_rng_state.remote() for s in self.pool.slots))
            return {
                "data": self.source.get_state(),
                "next_sample_id": self._next_sample_id,
                "next_group_id": self._next_group_id,
                "next_step": self._next_step,
                "counts": dict(self._counts),
                "engine_rng": list(rng),
                "buffer": buffer,
            }
        finally:
            self._frozen -= 1

    async def set_state(self, state: dict[str, Any]) -> None:
        self.source.set_state(state["data"])
        self._next_sample_id = int(state["next_sample_id"])
        self._next_group_id = int(state["next_group_id"])
        self._next_step = int(state.get("next_step", 0))
        self._counts.update(state.get("counts", {}))
        self._restored = {int(b["step"]): StepBatch.from_json(b) for b in state.get("buffer", [])}
        rng = state.get("engine_rng", [])
        if len(rng) == len(self.pool.slots):
            await asyncio.gather(
                *(
                    s.handle.set_rng_state.remote(r)
                    for s, r in zip(self.pool.slots, rng, strict=True)
                )
            )
        elif rng:
            log.warning(
                "engine count changed since the checkpoint; engines keep their own seeds",
                saved=len(rng),
                now=len(self.pool.slots),
            )


async def _await(ref: Any) -> Any:
    return await ref


async def _quietly(ref: Any) -> None:
    """A call to an engine that may have just died: its failure is the pool's business."""
    try:
        await ref
    except Exception as exc:
        log.warning("engine call failed", error=repr(exc))


def _rollout_metrics(flat: list[Sample], kept: list[Sample], seconds: float) -> dict[str, float]:
    rewards = [s.reward for s in flat if s.reward is not None]
    lengths = [len(s.response_ids) for s in flat]
    tokens = sum(lengths)
    return {
        "rollout/reward_mean": float(np.mean(rewards)) if rewards else 0.0,
        "rollout/reward_std": float(np.std(rewards)) if rewards else 0.0,
        "rollout/response_len_mean": float(np.mean(lengths)) if lengths else 0.0,
        "rollout/truncated_frac": float(np.mean([s.status is SampleStatus.TRUNCATED for s in flat]))
        if flat
        else 0.0,
        "rollout/reward_errors": float(sum(1 for s in flat if s.metadata.get("reward_error"))),
        "rollout/failed": float(sum(1 for s in flat if s.status is SampleStatus.FAILED)),
        "rollout/samples": float(len(flat)),
        "rollout/kept_samples": float(len(kept)),
        "rollout/filtered_frac": 1.0 - len(kept) / len(flat) if flat else 0.0,
        "rollout/tokens": float(tokens + sum(len(s.prompt_ids) for s in kept)),
        "rollout/tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
    }
