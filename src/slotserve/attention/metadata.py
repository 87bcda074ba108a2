"""AttentionMetadata: where each token of a ragged batch reads and writes K/V.

Built once per iteration from the scheduler's plan, then shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slotserve.core.outputs import ScheduledSeq


@dataclass
class PrefillSeq:
    """A sequence with more than one new token (or a first token): attended on its own."""

    query_start: int  # row of its first new token in the flat batch
    num_queries: int
    start_pos: int  # position of its first new token
    context_len: int  # start_pos + num_queries
    block_table: torch.Tensor  # (nblocks,) int64
    mask: torch.Tensor  # (num_queries, context_len) bool: causal, offset by the cached prefix


@dataclass
class AttentionMetadata:
    """slot_mapping: (T,) flat cache slot of each new token.

    Decode sequences (one new token after cached context) are attended as one batch:
    decode_rows (D,) are their rows in the flat batch, decode_block_tables (D, maxb) their
    tables padded with block 0, decode_context_lens (D,) their lengths, decode_mask
    (D, maxb * block_size) which gathered positions are real. NOTE: masks are built here,
    once per iteration, not in each layer.
    """

    slot_mapping: torch.Tensor
    prefills: list[PrefillSeq]
    decode_rows: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    decode_mask: torch.Tensor
    block_size: int

    @property
    def num_decodes(self) -> int:
        return int(self.decode_rows.numel())


def build_metadata(seqs: list[ScheduledSeq], block_size: int, device: torch.device
                   ) -> AttentionMetadata:
    """Compute slots and per-sequence views for one iteration (numpy, no per-token Python)."""
    to = lambda a: torch.from_numpy(a).to(device)
    lengths = np.array([s.num_tokens for s in seqs], dtype=np.int64)
    query_starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    slot_mapping = np.concatenate([_slots(s, block_size) for s in seqs])
    prefills, decode_idx = [], []
    for i, seq in enumerate(seqs):
        if seq.num_tokens == 1 and seq.start_pos > 0:
            decode_idx.append(i)
        else:
            prefills.append(PrefillSeq(
                int(query_starts[i]), seq.num_tokens, seq.start_pos, seq.context_len,
                torch.tensor(seq.block_table, dtype=torch.int64, device=device),
                to(_causal_mask(seq.start_pos, seq.context_len))))
    tables, context_lens = _padded_tables([seqs[i] for i in decode_idx])
    key_positions = np.arange(tables.shape[1] * block_size)
    return AttentionMetadata(
        slot_mapping=to(slot_mapping),
        prefills=prefills,
        decode_rows=to(query_starts[decode_idx].astype(np.int64)),
        decode_block_tables=to(tables),
        decode_context_lens=to(context_lens),
        decode_mask=to(key_positions[None, :] < context_lens[:, None]),
        block_size=block_size,
    )


def _slots(seq: ScheduledSeq, block_size: int) -> np.ndarray:
    positions = np.arange(seq.start_pos, seq.context_len)
    table = np.asarray(seq.block_table, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


def _causal_mask(start_pos: int, context_len: int) -> np.ndarray:
    query_positions = np.arange(start_pos, context_len)
    return np.arange(context_len)[None, :] <= query_positions[:, None]  # (n, L)


def _padded_tables(seqs: list[ScheduledSeq]) -> tuple[np.ndarray, np.ndarray]:
    max_blocks = max((len(s.block_table) for s in seqs), default=0)
    tables = np.zeros((len(seqs), max_blocks), dtype=np.int64)
    for row, seq in enumerate(seqs):
        tables[row, :len(seq.block_table)] = seq.block_table
    context_lens = np.array([s.context_len for s in seqs], dtype=np.int64)
    return tables, context_lens
