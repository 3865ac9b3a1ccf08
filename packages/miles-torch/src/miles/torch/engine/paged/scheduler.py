"""What the engine runs next: a prefill of newly admitted requests, or one decode step.

Requests are admitted, oldest first, while their pages fit, the batch has a free row and the
step's token budget lasts; a prompt longer than the budget is prefilled in chunks. A decode step
needs one more slot per row; when the pool has none left, the newest running request is
preempted: its pages go back and it waits, first in line, to be computed again from its tokens.
The engine never runs out of memory mid-step, it only gets slower.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from miles.torch.engine.paged.pages import PagePool
from miles.torch.engine.paged.sequence import Sequence, Status


@dataclass
class Step:
    """One forward: rows in order, each computing `chunks[i]` tokens from its `num_computed`."""

    seqs: list[Sequence]
    chunks: list[int]
    is_prefill: bool

    def sampled(self) -> list[Sequence]:
        """The rows that sample a token after this step: those whose tokens are all computed."""
        return [s for s, n in zip(self.seqs, self.chunks, strict=True) if s.num_uncomputed == n]


class Scheduler:
    def __init__(self, pool: PagePool, max_batch_size: int, max_prefill_tokens: int) -> None:
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._order = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> Step:
        prefill = self._prefill_step()
        if prefill is not None:
            return prefill
        return self._decode_step()

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.running.remove(seq)
        self.pool.release(seq)

    def drain(self) -> list[Sequence]:
        """Every unfinished request, in admission order, their pages returned (for an abort)."""
        seqs = sorted(self.running, key=lambda s: s.order) + list(self.waiting)
        for seq in self.running:
            self.pool.release(seq)
        self.running, self.waiting = [], deque()
        return seqs

    def _prefill_step(self) -> Step | None:
        seqs: list[Sequence] = []
        chunks: list[int] = []
        budget = self.max_prefill_tokens
        # Rows partly prefilled by an earlier chunk go first.
        for seq in self.running:
            if seq.num_uncomputed > 1 and budget > 0:
                seqs.append(seq)
                chunks.append(min(seq.num_uncomputed, budget))
                budget -= chunks[-1]
                self.pool.register(seq, seq.num_computed + chunks[-1])
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if not self.pool.can_admit(seq):
                if not self.running:
                    raise RuntimeError(
                        f"request {seq.request.request_id} needs {self.pool.pages_for(len(seq))} "
                        f"KV pages of {self.pool.page_size} tokens; the cache has "
                        f"{self.pool.num_pages - 1}: raise rollout.mem_fraction or lower "
                        "the request's length"
                    )
                break
            self.waiting.popleft()
            self.pool.admit(seq)
            seq.status, seq.order = Status.RUNNING, self._order
            self._order += 1
            self.running.append(seq)
            seqs.append(seq)
            chunks.append(min(seq.num_uncomputed, budget))
            budget -= chunks[-1]
            self.pool.register(seq, seq.num_computed + chunks[-1])
        if not seqs:
            return None
        return Step(seqs, chunks, is_prefill=True)

    def _decode_step(self) -> Step:
        rows = sorted(self.running, key=lambda s: s.order)
        for seq in list(rows):
            if seq not in self.running:  # preempted for an older row below
                continue
            while self.pool.pages_for(len(seq)) > len(seq.pages) and not self.pool.num_free:
                victim = max(self.running, key=lambda s: s.order)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                self.pool.grow(seq, len(seq))
        rows = [s for s in rows if s in self.running]
        return Step(rows, [1] * len(rows), is_prefill=False)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1
