"""One step of the paged engine: schedule, build the step's inputs, run the model, sample.

The runner is shared by every `generate` call on the engine: each call adds its requests and
drives steps until its own have finished, so requests of concurrent calls batch together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog
import torch

from miles.core.config import ReplayMode
from miles.core.contracts.types import GenerateRequest
from miles.torch.engine.config import TorchEngineConfig
from miles.torch.engine.logits import LogitsProcessor, add_prompt_logprobs, sample_rows, take
from miles.torch.engine.paged import kv_cache
from miles.torch.engine.paged.attention import DecodeMeta, PrefillMeta
from miles.torch.engine.paged.graphs import DecodeGraphs
from miles.torch.engine.paged.model import PagedModel
from miles.torch.engine.paged.pages import PagePool
from miles.torch.engine.paged.routes import RouteCache
from miles.torch.engine.paged.scheduler import Scheduler, Step
from miles.torch.engine.paged.sequence import Sequence, Status
from miles.torch.engine.sampler import SamplingTensors

log = structlog.get_logger(__name__)


class PagedRunner:
    def __init__(
        self,
        hf_model: Any,
        settings: TorchEngineConfig,
        generator: torch.Generator,
        finish_reason: Callable[[Sequence], str | None],
        record_routing: ReplayMode = "off",
        routing_dtype: np.dtype[Any] | None = None,
        constraint_vocab: int | None = None,
    ) -> None:
        """`finish_reason(seq)` is called once per token appended to a response (see
        `stops.StopChecker`); `constraint_vocab`: what constraints' bitmasks cover (None: the
        model's vocabulary)."""
        self.settings = settings
        self.device = hf_model.device
        self.generator = generator
        self.finish_reason = finish_reason
        self.processor = LogitsProcessor(constraint_vocab or hf_model.config.vocab_size)
        self.model = PagedModel(hf_model, settings.max_context)
        self.record_routing = record_routing
        self.routing_dtype = routing_dtype if routing_dtype is not None else np.dtype(np.int32)
        if record_routing != "off" and not self.model.num_moe_layers:
            raise ValueError(f"record_routing={record_routing!r}: the model has no MoE layer")
        # Sequences whose routes are read at the end of the step: (sequence, slots, tokens).
        self._route_reads: list[tuple[Sequence, list[int], int]] = []
        self._order = 0
        self._sampling_rows: list[Sequence] = []
        self._sampling_batch: SamplingTensors | None = None
        self.kv: torch.Tensor | None = None
        self.graphs: DecodeGraphs | None = None
        self.scheduler: Scheduler | None = None
        if self.device.type == "cuda" and settings.cuda_graphs and self.model.not_graphable:
            log.info("decode runs without CUDA graphs", reason=self.model.not_graphable)
        self.allocate()

    # ── memory ──────────────────────────────────────────────────────────────────────────────────
    def allocate(self) -> None:
        s = self.settings
        pages = kv_cache.plan_pages(
            self.model,
            self.device,
            s.page_size,
            s.mem_fraction,
            s.kv_cache_tokens,
            fallback_tokens=s.max_batch_size * s.max_context,
        )
        self.kv = kv_cache.allocate(self.model, pages, s.page_size, self.device)
        if self.record_routing != "off":
            self.model.routes = RouteCache(
                pages * s.page_size,
                self.model.num_moe_layers,
                self.model.top_k,
                with_weights=self.record_routing == "ids+weights",
                index_dtype=self.routing_dtype,
                device=self.device,
            )
        self.pool = PagePool(pages, s.page_size)
        self.scheduler = Scheduler(self.pool, s.max_batch_size, s.max_prefill_tokens)
        log.info(
            "paged KV cache",
            pages=pages,
            page_size=s.page_size,
            tokens=(pages - 1) * s.page_size,
            gib=round(self.kv.numel() * self.kv.element_size() / 2**30, 2),
        )

    def release(self) -> None:
        """Drop the cache and the graphs; requests still scheduled end as "abort"."""
        if self.scheduler is not None:
            for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                self._keep_routes(seq)
            self._read_routes()
            for seq in self.scheduler.drain():
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
        self.kv = None
        self.model.routes = None
        self.graphs = None
        self.scheduler = None

    def restore(self) -> None:
        """After the model is back on the device: fuse its weights again, reallocate the cache;
        graphs are captured again at the next decode."""
        self.model.fuse()
        self.allocate()

    def weights_changed(self) -> None:
        """Cached prefixes hold K/V of the old weights: forget them."""
        self.pool.clear_cache()

    # ── requests ────────────────────────────────────────────────────────────────────────────────
    def add(self, requests: Iterable[GenerateRequest]) -> list[Sequence]:
        assert self.scheduler is not None
        seqs = []
        for request in requests:
            if (
                len(request.prompt_ids) + request.sampling.max_new_tokens
                > self.settings.max_context
            ):
                raise ValueError(
                    f"request {request.request_id}: prompt ({len(request.prompt_ids)} tokens) + "
                    f"max_new_tokens ({request.sampling.max_new_tokens}) exceed the engine's "
                    f"max_context {self.settings.max_context}: raise rollout.max_context"
                )
            seq = Sequence(request, order=self._order)
            self._order += 1
            self.scheduler.add(seq)
            seqs.append(seq)
        return seqs

    def abort(self, seqs: list[Sequence]) -> None:
        """Take unfinished `seqs` out of the schedule, their pages returned."""
        for seq in seqs:
            if self.scheduler is None:  # released: the schedule is gone already
                pass
            elif seq.status is Status.RUNNING:
                self._keep_routes(seq)
                self.scheduler.running.remove(seq)
                self.pool.release(seq)
            elif seq in self.scheduler.waiting:
                self._keep_routes(seq)
                self.scheduler.waiting.remove(seq)
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
        self._read_routes()

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the KV cache holds at most (page 0 is the padding page)."""
        return (self.pool.num_pages - 1) * self.pool.page_size

    @property
    def prefix_hit_rate(self) -> float:
        return self.pool.hits / self.pool.lookups if self.pool.lookups else 0.0

    # ── one step ────────────────────────────────────────────────────────────────────────────────
    def step(self) -> None:
        """Run one prefill step, or one decode step (with CUDA graphs, a burst of several);
        finished sequences get status FINISHED (and their routing records)."""
        self._step()
        self._read_routes()

    def _step(self) -> None:
        assert self.scheduler is not None and self.kv is not None
        step = self.scheduler.schedule()
        if not step.seqs:
            return
        if not step.is_prefill:
            burst = self._burst_length(step.seqs)
            if burst > 1:
                self._decode_burst(step.seqs, burst)
                return
        sampled = step.sampled()
        logits = self._prefill(step) if step.is_prefill else self._decode_rows(step.seqs)
        for seq, n in zip(step.seqs, step.chunks, strict=True):
            seq.num_computed += n
        if any(not s.request.sampling.max_new_tokens for s in sampled):
            # Requests that only wanted their prompt logprobs: done, nothing sampled.
            keep = [i for i, s in enumerate(sampled) if s.request.sampling.max_new_tokens]
            for seq in sampled:
                if not seq.request.sampling.max_new_tokens:
                    self._finish(seq, "length")
            sampled, logits = [sampled[i] for i in keep], logits[keep]
        if not sampled:
            return
        params = self._sampling(sampled)
        counters = self._counters(sampled, params)
        _, packed = sample_rows(logits, sampled, params, self.processor, self.generator, counters)
        drawn = packed.cpu().numpy()  # one transfer, one wait
        for j, seq in enumerate(sampled):
            self._take(seq, drawn, j)

    def _take(self, seq: Sequence, drawn: npt.NDArray[np.float64], j: int) -> bool:
        """Append the token sampled for `seq` (column `j` of `pack`'s output on the host); True
        (and the sequence finished) when it ends the request."""
        take(seq, drawn, j)
        reason = self.finish_reason(seq)
        if reason is None:
            return False
        self._finish(seq, reason)
        return True

    def _finish(self, seq: Sequence, reason: str) -> None:
        assert self.scheduler is not None
        self.pool.register(seq, seq.num_computed)  # for a later turn of the conversation
        self._keep_routes(seq)
        self.scheduler.finish(seq, reason)

    def _keep_routes(self, seq: Sequence) -> None:
        """Note where `seq`'s computed tokens' routes are, before its pages go back."""
        if self.model.routes is None:
            return
        self._route_reads.append((seq, self.pool.slots(seq, seq.num_computed), len(seq)))

    def _read_routes(self) -> None:
        """Copy the noted sequences' routing records to the host, all in one transfer."""
        if self.model.routes is None or not self._route_reads:
            return
        reads, self._route_reads = self._route_reads, []
        records = self.model.routes.read([(slots, total) for _, slots, total in reads])
        for (seq, _, _), (indices, weights) in zip(reads, records, strict=True):
            seq.routing, seq.routing_weights = indices, weights

    @property
    def _graphed(self) -> bool:
        return (
            self.device.type == "cuda"
            and self.settings.cuda_graphs
            and self.model.not_graphable is None
        )

    def _burst_length(self, seqs: list[Sequence]) -> int:
        """How many decode steps to run before the host looks at the tokens: up to
        `decode_burst`, no more than any row may still make, and only while pages last. Rows
        with penalties or a constraint need the host between tokens: no burst."""
        params = self._sampling(seqs)
        if params.penalized or params.constrained:
            return 1
        room = min(s.request.sampling.max_new_tokens - len(s.response) for s in seqs)
        burst = min(self.settings.decode_burst, room)
        if burst <= 1:
            return 1
        needed = sum(self.pool.pages_for(len(s) + burst - 1) - len(s.pages) for s in seqs)
        if needed > self.pool.num_free:
            return 1
        for seq in seqs:
            self.pool.grow(seq, len(seq) + burst - 1)
        return burst

    def _decode_burst(self, seqs: list[Sequence], burst: int) -> None:
        """`burst` decode steps back to back on the device: each step's sampled tokens feed the
        next through the graphs' input buffer, and the host waits once, at the end. Tokens a
        row sampled after its stop are dropped (their K/V sit in pages the row then returns)."""
        params = self._sampling(seqs)
        counters = self._counters(seqs, params)
        steps = []
        logits = self._decode_rows(seqs)
        for i in range(burst):
            sampled, packed = sample_rows(
                logits,
                seqs,
                params,
                self.processor,
                self.generator,
                None if counters is None else counters + i,
            )
            steps.append(packed)
            if i + 1 < burst:
                logits = self._advance(seqs, sampled, step=i + 1)
        drawn = torch.stack(steps).cpu().numpy()  # [burst, 2 + 2k, rows]
        for j, seq in enumerate(seqs):
            for i in range(burst):
                seq.num_computed += 1  # the token fed at step i
                if self._take(seq, drawn[i], j):
                    break

    def _sampling(self, rows: list[Sequence]) -> SamplingTensors:
        """The rows' sampling tensors, rebuilt only when the rows change (not every step)."""
        same = len(rows) == len(self._sampling_rows) and all(
            a is b for a, b in zip(rows, self._sampling_rows, strict=True)
        )
        if not same:
            params = [s.request.sampling for s in rows]
            self._sampling_batch = SamplingTensors.from_params(params, self.device)
            self._sampling_rows = list(rows)
        assert self._sampling_batch is not None
        return self._sampling_batch

    def _counters(self, rows: list[Sequence], params: SamplingTensors) -> torch.Tensor | None:
        """Each row's response length, which seeded rows hash with their seed (None: no seeds)."""
        if not params.seeded:
            return None
        return torch.tensor([len(s.response) for s in rows], device=self.device)

    def _prefill(self, step: Step) -> torch.Tensor:
        """Run the step's chunks; the next-token logits of the rows that sample after it (their
        chunk ends their tokens), and the prompt logprobs of the rows that asked."""
        assert self.kv is not None
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        key_slots: list[int] = []
        cu_q, cu_k, last = [0], [0], []
        keep: list[int] = []  # packed tokens whose logits the forward returns
        sampled: list[int] = []  # the sampling rows among them
        prompt_rows: list[tuple[Sequence, int, int, int]] = []  # (seq, position, count, at)
        for seq, n in zip(step.seqs, step.chunks, strict=True):
            start, end = seq.num_computed, seq.num_computed + n
            seq_slots = self.pool.slots(seq, end)
            ids += seq.tokens[start:end]
            positions += range(start, end)
            slots += seq_slots[start:end]
            key_slots += seq_slots
            if seq.needs_prompt_logprobs:
                # Positions start .. predict prompt tokens start + 1 ..; computed in order, from 0.
                assert start == len(seq.prompt_logprobs), "prompt logprobs skipped a position"
                count = min(end, len(seq.request.prompt_ids) - 1) - start
                prompt_rows.append((seq, start, count, len(keep)))
                keep += range(cu_q[-1], cu_q[-1] + count)
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + end)
            last.append(cu_q[-1] - 1)
            if seq.num_uncomputed == n:
                sampled.append(len(keep))
                keep.append(last[-1])
        device = self.device
        meta = PrefillMeta(
            slots=torch.tensor(slots, device=device),
            key_slots=torch.tensor(key_slots, device=device),
            cu_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
            cu_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
            max_q=max(step.chunks),
            max_k=max(c - p for c, p in zip(cu_k[1:], cu_k, strict=False)),
            q_lens=list(step.chunks),
            k_lens=[c - p for c, p in zip(cu_k[1:], cu_k, strict=False)],
            last=torch.tensor(last, device=device),
        )
        logits = self.model.forward(
            torch.tensor(ids, device=device),
            torch.tensor(positions, device=device),
            self.kv,
            meta,
            last=meta.last if keep in (last, []) else torch.tensor(keep, device=device),
        )
        for seq, start, count, at in prompt_rows:
            add_prompt_logprobs(seq, logits[at : at + count], start)
        return logits if len(sampled) == len(keep) else logits[sampled]

    def _decode_rows(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits of one decode step of `seqs` (each feeds its last token)."""
        input_ids = [s.tokens[-1] for s in seqs]
        if self._graphed:
            if self.graphs is None:
                self.graphs = self._capture()
            positions = [len(s) - 1 for s in seqs]
            return self.graphs.run(input_ids, positions, [s.pages for s in seqs])
        return self._eager_decode(seqs, torch.tensor(input_ids, device=self.device), step=0)

    def _advance(self, seqs: list[Sequence], tokens: torch.Tensor, step: int) -> torch.Tensor:
        """Logits of the burst's next decode step: each row feeds `tokens` `step` positions
        after its last token."""
        if self._graphed:
            assert self.graphs is not None
            return self.graphs.advance(tokens)
        return self._eager_decode(seqs, tokens, step)

    def _eager_decode(self, seqs: list[Sequence], tokens: torch.Tensor, step: int) -> torch.Tensor:
        """One decode step without graphs: row b feeds tokens[b] `step` positions after its
        last token."""
        assert self.kv is not None
        width = max(len(s.pages) for s in seqs)
        table = [s.pages + [0] * (width - len(s.pages)) for s in seqs]
        pos = torch.tensor([len(s) - 1 + step for s in seqs], device=self.device)
        meta = DecodeMeta(
            pos,
            torch.tensor(table, dtype=torch.int32, device=self.device),
            (pos + 1).to(torch.int32),
            self.settings.page_size,
        )
        return self.model.forward(tokens, pos, self.kv, meta)

    def _capture(self) -> DecodeGraphs:
        assert self.kv is not None
        s = self.settings
        max_pages = -(-s.max_context // s.page_size)
        return DecodeGraphs(self.model, self.kv, s.max_batch_size, max_pages, s.page_size)
