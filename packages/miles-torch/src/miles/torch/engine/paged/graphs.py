"""Decode steps captured as CUDA graphs, one per batch-size bucket.

A graph replays a whole decode forward (every layer, attention included) as one launch, which
is what makes small-batch decode fast: the many small kernels of a step cost their launch time
otherwise. Inputs live in static buffers; a batch of n rows runs the smallest bucket >= n, with
its padding rows pointed at the scratch page. Each size is captured when first needed, and all
are dropped when the engine releases its memory.
"""

from __future__ import annotations

import time

import structlog
import torch

from miles.torch.engine.paged.attention import DecodeMeta
from miles.torch.engine.paged.model import PagedModel
from miles.torch.engine.paged.pages import SCRATCH_PAGE

log = structlog.get_logger(__name__)


def buckets(max_batch_size: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    chosen = [s for s in sizes if s < max_batch_size]
    return [*chosen, max_batch_size]


class DecodeGraphs:
    def __init__(
        self,
        model: PagedModel,
        kv: torch.Tensor,
        max_batch_size: int,
        max_pages: int,
        page_size: int,
    ) -> None:
        device = kv.device
        self.model, self.kv, self.page_size = model, kv, page_size
        # Inputs: token ids and positions in one buffer, filled by one copy from pinned memory.
        self.inputs = torch.zeros((2, max_batch_size), dtype=torch.int64, device=device)
        self.block_table = torch.full(
            (max_batch_size, max_pages), SCRATCH_PAGE, dtype=torch.int32, device=device
        )
        self.host_inputs = torch.zeros((2, max_batch_size), dtype=torch.int64).pin_memory()
        self.host_table = torch.zeros((max_batch_size, max_pages), dtype=torch.int32).pin_memory()
        self._host_inputs, self._host_table = self.host_inputs.numpy(), self.host_table.numpy()
        self.sizes = buckets(max_batch_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_s = 0.0  # time spent capturing so far
        self._rows = self._size = 0  # the rows and graph of the last `run`
        self._pool = torch.cuda.graph_pool_handle()  # one memory pool shared by every graph

    def capture(self, size: int) -> None:
        """Capture the decode graph of `size` rows (each size when first needed: a run that
        keeps 64 rows busy captures one graph, not every bucket)."""
        start = time.perf_counter()
        self._forward(size)  # warm-up (Triton compiles, cuBLAS picks kernels) outside capture
        torch.cuda.synchronize(self.kv.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.outputs[size] = self._forward(size)
        self.graphs[size] = graph
        took = time.perf_counter() - start
        self.capture_s += took
        log.info("decode graph captured", rows=size, seconds=round(took, 3))

    def _forward(self, size: int) -> torch.Tensor:
        ids, positions = self.inputs[0, :size], self.inputs[1, :size]
        seq_lens = (positions + 1).to(torch.int32)  # inside the graph: one input fewer
        meta = DecodeMeta(positions, self.block_table[:size], seq_lens, self.page_size)
        return self.model.forward(ids, positions, self.kv, meta)

    def run(
        self, input_ids: list[int], positions: list[int], pages: list[list[int]]
    ) -> torch.Tensor:
        """Logits [rows, vocab] of one decode step: row b feeds `input_ids[b]` at `positions[b]`
        over its `pages`. Padding rows feed token 0 at position 0 of the scratch page."""
        rows = len(input_ids)
        size = next(s for s in self.sizes if s >= rows)
        host, table = self._host_inputs, self._host_table  # numpy views of the pinned buffers
        host[:, rows:size] = 0
        host[0, :rows] = input_ids
        host[1, :rows] = positions
        table[:size] = SCRATCH_PAGE
        for b, row in enumerate(pages):
            table[b, : len(row)] = row
        self.inputs[:, :size].copy_(self.host_inputs[:, :size], non_blocking=True)
        self.block_table[:size].copy_(self.host_table[:size], non_blocking=True)
        if size not in self.graphs:
            self.capture(size)
        self._rows, self._size = rows, size
        self.graphs[size].replay()
        return self.outputs[size][:rows]

    def advance(self, tokens: torch.Tensor) -> torch.Tensor:
        """The next decode step of the rows `run` last fed: each feeds its `tokens` [rows]
        (on the device) one position further, over the pages it already had."""
        rows, size = self._rows, self._size
        self.inputs[0, :rows].copy_(tokens)
        self.inputs[1, :rows] += 1
        self.graphs[size].replay()
        return self.outputs[size][:rows]
