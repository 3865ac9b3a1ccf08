"""The rollout manager actor: owns the data, the rollout function, rewards, filters and engines.

Per step it draws prompts, tokenizes each once, runs the rollout function for every group
concurrently (the dispatcher batches their requests onto the engines), scores each finished group,
filters, and returns the batch packed as arrays.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import numpy as np
import structlog

from miles.core.components import Kind
from miles.core.config import RunConfig
from miles.core.data import PromptSource, read_rows
from miles.core.factory import build_component
from miles.core.protocols import PromptGroup
from miles.core.runtime.dispatch import EngineDispatcher
from miles.core.runtime.process import init_actor_process
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


class RolloutManager:
    def __init__(self, config: RunConfig, run_dir: str | None, engines: list[Any]) -> None:
        init_actor_process(run_dir, role="rollout_manager")
        from transformers import AutoTokenizer

        self.config = config
        self.engines = engines
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        self.source = PromptSource(
            read_rows(config.data.path, config.data.split),
            seed=config.seed,
            shuffle=config.data.shuffle,
        )
        self.eval_rows = read_rows(config.eval.data) if config.eval.data else []
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
        self.dispatcher = EngineDispatcher(engines)
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

    # ── prompts ──────────────────────────────────────────────────────────────────────────────────

    def _prompt_ids(self, rows: list[dict[str, Any]], key: str) -> list[list[int]]:
        """Token ids of each row's prompt, tokenized once here (in one batched call)."""
        for row in rows:
            if key not in row:
                raise KeyError(
                    f"data row has no {key!r} field (fields: {sorted(row)}); set data.prompt_key"
                )
        texts: Any = [str(row[key]) for row in rows]
        if self.config.data.chat_template:
            system = self.config.data.system_prompt
            chats = [
                [
                    *([{"role": "system", "content": system}] if system else []),
                    {"role": "user", "content": text},
                ]
                for text in texts
            ]
            texts = self.tokenizer.apply_chat_template(
                chats, add_generation_prompt=True, tokenize=False
            )
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

    # ── one rollout ──────────────────────────────────────────────────────────────────────────────

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

    async def rollout(
        self, step: int, trace: dict[str, str]
    ) -> tuple[PackedBatch, dict[str, float]]:
        """Generates, scores and filters one step's groups."""
        with attached(trace), span("miles.rollout", step=step):
            target = self.config.rollout.prompts_per_step
            # Filters that drop whole groups (dynamic sampling) may ask for extra rounds.
            rounds = max((getattr(f, "oversample_rounds", 0) for f in self.filters), default=0)
            t0 = time.perf_counter()
            flat: list[Sample] = []
            kept_groups: list[list[Sample]] = []
            extra_rounds = -1
            while extra_rounds < rounds and len(kept_groups) < target:
                extra_rounds += 1
                rows = self.source.next(target - len(kept_groups))
                groups = self._groups_for(rows, self.config.rollout.samples_per_prompt)
                for group in await self._run_groups(groups, self.sampling):
                    flat.extend(group)
                    for f in self.filters:
                        group = f(group)
                    if group:
                        kept_groups.append(group)
            elapsed = time.perf_counter() - t0
            kept = [s for g in kept_groups for s in g]
            metrics = _rollout_metrics(flat, kept, elapsed)
            n_groups = len(flat) // max(self.config.rollout.samples_per_prompt, 1)
            metrics["rollout/dropped_group_frac"] = 1 - len(kept_groups) / max(n_groups, 1)
            metrics["rollout/oversample_rounds"] = float(extra_rounds)
            metrics["rollout/epoch"] = float(self.source.state.epoch)
            if not kept:
                log.warning("every sample of this step was filtered out", step=step)
            return PackedBatch.from_samples(kept), metrics

    async def evaluate(self, step: int, trace: dict[str, str]) -> dict[str, float]:
        """One sample per held-out prompt, at the eval temperature."""
        if not self.eval_rows:
            return {}
        with attached(trace), span("miles.eval", step=step):
            rows = self.eval_rows[: self.config.eval.max_prompts]
            sampling = replace(self.sampling, temperature=self.config.eval.temperature)
            generated = await self._run_groups(self._groups_for(rows, 1), sampling)
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

    # ── weights ──────────────────────────────────────────────────────────────────────────────────

    async def init_sync(self, host: str, port: int) -> None:
        world = len(self.engines) + 1  # rank 0 is the trainer
        await asyncio.gather(
            *(e.init_sync.remote(host, port, world, i + 1) for i, e in enumerate(self.engines))
        )

    async def receive_weights(self, plan: SyncPlan, version: int, trace: dict[str, str]) -> None:
        await asyncio.gather(
            *(e.receive_weights.remote(plan, version, trace) for e in self.engines)
        )

    async def checksums(self) -> list[str]:
        return list(await asyncio.gather(*(e.checksum.remote() for e in self.engines)))

    async def weight_versions(self) -> list[int]:
        return list(await asyncio.gather(*(e.weight_version.remote() for e in self.engines)))

    # ── checkpointed state ───────────────────────────────────────────────────────────────────────

    def get_state(self) -> dict[str, Any]:
        return {
            "data": self.source.get_state(),
            "next_sample_id": self._next_sample_id,
            "next_group_id": self._next_group_id,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self.source.set_state(state["data"])
        self._next_sample_id = int(state["next_sample_id"])
        self._next_group_id = int(state["next_group_id"])


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
