"""Decode steps captured as CUDA graphs, one per batch-size bucket.

A graph replays a whole decode forward (every layer, attention included) as one launch, which
is what makes small-batch decode fast: the many small kernels of a step cost their launch time
otherwise. Inputs live in static buffers; a batch of n rows runs the smallest bucket >= n, with
its padding rows pointed at the scratch page. Graphs are captured lazily, on the first decode,
and dropped when the engine releases its memory.
"""

from __future__ import annotations

import torch

from miles.torch.engine.paged.attention import DecodeMeta
from miles.torch.engine.paged.model import PagedModel
from miles.torch.engine.paged.pages import SCRATCH_PAGE


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
        self.input_ids = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        self.block_table = torch.full(
            (max_batch_size, max_pages), SCRATCH_PAGE, dtype=torch.int32, device=device
        )
        self.seq_lens = torch.ones(max_batch_size, dtype=torch.int32, device=device)
        self.sizes = buckets(max_batch_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        for size in reversed(self.sizes):  # the largest first, so the smaller reuse its pool
            self._forward(size)  # warm-up (Triton compiles, cuBLAS picks kernels) outside capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph

    def _forward(self, size: int) -> torch.Tensor:
        meta = DecodeMeta(
            self.positions[:size], self.block_table[:size], self.seq_lens[:size], self.page_size
        )
        return self.model.forward(self.input_ids[:size], self.positions[:size], self.kv, meta)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [rows, vocab] of one decode step (the inputs as for `DecodeMeta`)."""
        rows, width = block_table.shape
        size = next(s for s in self.sizes if s >= rows)
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.seq_lens[:rows].copy_(seq_lens)
        self.block_table[:rows, :width].copy_(block_table)
        self.block_table[:rows, width:].fill_(SCRATCH_PAGE)
        if size > rows:  # padding rows: one token at position 0 of the scratch page
            self.input_ids[rows:size].zero_()
            self.positions[rows:size].zero_()
            self.seq_lens[rows:size].fill_(1)
            self.block_table[rows:size].fill_(SCRATCH_PAGE)
        self.graphs[size].replay()
        return self.outputs[size][:rows]
