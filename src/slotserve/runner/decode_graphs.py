"""DecodeGraphs: decode-only iterations on a GPU as CUDA graphs, one per padded batch size.

On a GPU a small batch's decode step is decided by launch overhead, not by the weight read:
a 16-layer model launches ~200 kernels per step from Python. vLLM captures the decode
forward as CUDA graphs at a few batch sizes and replays the smallest that fits; so does
this. The CPU's counterpart is the C++ decode stack (one call for all layers).

Per step: the sequences' ids, positions, cache slots, context lengths and block tables are
written into one pinned host buffer, copied to the device in one copy (rows beyond the
batch are padding: slot -1, so no K/V is written, and a context of one position of block
0), and the graph of the smallest captured size >= the batch is replayed.

NOTE: a graph replays the kernels captured with it, on the same buffers: the static inputs
and the KV pool keep their addresses for the runner's life, and the block tables have one
width (max_model_len's blocks), so the decode attention's split count never changes.
`capture=False` runs the same padded forward eagerly (on the CPU too: the tests' path).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from slotserve.attention.metadata import AttentionMetadata, DecodeGroup
from slotserve.core.outputs import ScheduledSeq

logger = logging.getLogger("slotserve.runner")

# The padded batch sizes captured (up to max_num_seqs, which is captured too).
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# The scalar inputs' columns of the staging buffer, before the block tables.
IDS, POSITIONS, SLOTS, CONTEXT_LENS = range(4)
NUM_SCALARS = 4


def batch_sizes(max_num_seqs: int) -> list[int]:
    """The sizes captured: BATCH_SIZES up to max_num_seqs, and max_num_seqs itself."""
    return sorted({b for b in BATCH_SIZES if b < max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    """Replays captured decode forwards; `runs(seqs)` says whether an iteration fits.

    model: the LlamaForCausalLM (its forward over AttentionMetadata); kv_caches: the pool's
    per-layer (K, V) views; tables_width: blocks of the longest sequence (max_model_len).
    """

    def __init__(self, model: nn.Module, kv_caches: list, block_size: int, max_num_seqs: int,
                 tables_width: int, device: torch.device, capture: bool = True) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.sizes = batch_sizes(max_num_seqs)
        self.tables_width = tables_width
        rows = self.sizes[-1]
        # NOTE: one host buffer and its device twin, int64: the scalars (NUM_SCALARS, rows),
        # each input a contiguous row, then the block tables (rows, tables_width)
        pinned = device.type == "cuda"
        self.host = torch.zeros(NUM_SCALARS * rows + rows * tables_width, dtype=torch.int64,
                                pin_memory=pinned)
        self.device_buffer = torch.zeros_like(self.host, device=device)
        self.host_scalars = self.host[:NUM_SCALARS * rows].view(NUM_SCALARS, rows).numpy()
        self.host_tables = self.host[NUM_SCALARS * rows:].view(rows, tables_width).numpy()
        self.rows = rows
        self.outputs: dict[int, torch.Tensor] = {}  # batch size -> its hidden states
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture = capture
        if capture:
            self._capture_all()

    def runs(self, seqs: list[ScheduledSeq]) -> bool:
        """Every sequence decodes one token, they fit the largest size and the tables."""
        return (0 < len(seqs) <= self.rows
                and all(s.is_one_token_decode for s in seqs)
                and max(len(s.block_table) for s in seqs) <= self.tables_width)

    def forward(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """The hidden states (D, H) of one decode-only iteration of D sequences."""
        size = next(b for b in self.sizes if b >= len(seqs))
        self._stage(seqs, size)
        if not self.capture:
            return self._run(size)[:len(seqs)]
        self.graphs[size].replay()
        return self.outputs[size][:len(seqs)]

    def _stage(self, seqs: list[ScheduledSeq], size: int) -> None:
        """The inputs of `seqs` into the host buffer, padded to `size` rows; one copy."""
        n, scalars, tables = len(seqs), self.host_scalars, self.host_tables
        positions = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=n)
        for row, seq in enumerate(seqs):
            tables[row, :len(seq.block_table)] = seq.block_table
        scalars[IDS, :n] = np.fromiter((s.token_ids[0] for s in seqs), dtype=np.int64,
                                       count=n)
        scalars[POSITIONS, :n] = positions
        blocks = tables[np.arange(n), positions // self.block_size]
        scalars[SLOTS, :n] = blocks * self.block_size + positions % self.block_size
        scalars[CONTEXT_LENS, :n] = positions + 1
        # padding rows: token 0 at position 0, no K/V written, one position of block 0 read
        scalars[IDS:CONTEXT_LENS, n:size] = 0
        scalars[SLOTS, n:size] = -1
        scalars[CONTEXT_LENS, n:size] = 1
        # NOTE: past a row's own blocks the tables hold earlier steps' ids: the kernel reads
        # no block past a row's context, and every id written here is one of the pool's
        tables[n:size, 0] = 0  # a padding row reads position 0 of block 0
        # NOTE: all scalars and the tables' first `size` rows: one host-to-device copy
        end = NUM_SCALARS * self.rows + size * self.tables_width
        self.device_buffer[:end].copy_(self.host[:end], non_blocking=True)

    def _inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Views of the device buffer as the model's inputs at batch `size`."""
        rows = self.rows
        scalars = self.device_buffer[:NUM_SCALARS * rows].view(NUM_SCALARS, rows)
        tables = self.device_buffer[NUM_SCALARS * rows:].view(rows, self.tables_width)
        group = DecodeGroup(rows=torch.arange(size, device=tables.device),
                            block_tables=tables[:size], context_lens=scalars[CONTEXT_LENS, :size],
                            mask=None)
        meta = AttentionMetadata(scalars[SLOTS, :size], [], [group], self.block_size)
        return scalars[IDS, :size], scalars[POSITIONS, :size], meta

    def _run(self, size: int) -> torch.Tensor:
        input_ids, positions, meta = self._inputs(size)
        return self.model(input_ids, positions, self.kv_caches, meta)  # (size, H)

    def _capture_all(self) -> None:
        """Capture every size, largest first (the smaller ones reuse its memory pool).

        NOTE: each size runs once eagerly first (Triton compiles its kernels then, outside
        the capture), on padding rows only: slot -1 writes no K/V.
        """
        pool = None
        self.host_scalars[:] = 0
        self.host_scalars[SLOTS] = -1
        self.host_scalars[CONTEXT_LENS] = 1
        self.host_tables[:] = 0
        self.device_buffer.copy_(self.host)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in self.sizes:
                self._run(size)
        torch.cuda.current_stream().wait_stream(stream)
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._run(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("CUDA graphs captured for decode batches of %s", self.sizes)
