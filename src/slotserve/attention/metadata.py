"""AttentionMetadata: where each token of a ragged batch reads and writes K/V.

Built once per iteration from the scheduler's plan, then shared by every layer. A layer with
a sliding window (HF's: the query at position i sees key j iff j <= i and i - j < window)
asks for its window's view (`PrefillSeq.keys`, `DecodeGroup.windowed`): the blocks that hold
the window and a mask over them, built by the first layer that asks and reused by the rest.
NOTE: no view reads a block before its window, so such blocks may hold anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from slotserve.core.outputs import ScheduledSeq, runs_as_rows


@dataclass(frozen=True)
class KeyView:
    """The keys a prefill's queries read under one window: the blocks from block
    key_start / block_size of its table on, and which of their positions each query sees.

    block_table: (nblocks,) int64; key_start: position of the first key; mask:
    (num_queries, context_len - key_start) bool.
    """

    block_table: torch.Tensor
    key_start: int
    mask: torch.Tensor


@dataclass
class PrefillSeq:
    """A sequence with more than one new token (or a first token): attended on its own."""

    query_start: int  # row of its first new token in the flat batch
    num_queries: int
    start_pos: int  # position of its first new token
    context_len: int  # start_pos + num_queries
    block_table: torch.Tensor  # (nblocks,) int64
    mask: torch.Tensor  # (num_queries, context_len) bool: causal, offset by the cached prefix
    block_size: int = 0  # of the table's blocks (needed by windowed views only)
    _views: dict = field(default_factory=dict, repr=False, compare=False)

    def keys(self, window: int | None) -> KeyView:
        """What the queries read with a sliding window of `window` positions (None: all).

        NOTE: built once per window and iteration (the first layer that asks), as the masks.
        """
        if window is None or window >= self.context_len:
            return KeyView(self.block_table, 0, self.mask)
        if window not in self._views:
            self._views[window] = self._windowed(window)
        return self._views[window]

    def _windowed(self, window: int) -> KeyView:
        first_block = max(0, self.start_pos - window + 1) // self.block_size
        key_start = first_block * self.block_size
        mask = window_mask(np.arange(self.start_pos, self.context_len),
                           np.arange(key_start, self.context_len), window)
        return KeyView(self.block_table[first_block:], key_start,
                       torch.from_numpy(mask).to(self.mask.device))


@dataclass
class DecodeGroup:
    """Decode sequences attended as one padded batch.

    rows (d,): their rows in the flat batch (ascending); block_tables (d, maxb): their
    tables padded with block 0; context_lens (d,); mask (d, maxb * block_size): which
    gathered positions are real (the first context_len of each row), for the torch path's
    gather; None where the kernel reads each sequence's own blocks (group_decodes=False).
    """

    rows: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    mask: torch.Tensor | None
    _views: dict = field(default_factory=dict, repr=False, compare=False)

    def windowed(self, window: int | None, block_size: int) -> DecodeGroup:
        """This group as the torch path reads it with a sliding window (None: itself): each
        table cut to the blocks that hold its last `window` positions (so a long context costs
        no more than its window), the mask over them. A group without a mask (the fused
        kernel's, which skips the blocks itself) is returned as it is.

        NOTE: built once per window and iteration, by the first layer that asks.
        """
        if window is None or self.mask is None:
            return self
        if window not in self._views:
            self._views[window] = self._windowed(window, block_size)
        return self._views[window]

    def _windowed(self, window: int, block_size: int) -> DecodeGroup:
        tables = self.block_tables.cpu().numpy()
        lens = self.context_lens.cpu().numpy()
        first = np.maximum(lens - window, 0) // block_size  # (d,) each row's first block read
        last = (lens - 1) // block_size
        width = int((last - first).max()) + 1
        cols = first[:, None] + np.arange(width)[None, :]  # (d, width) table columns
        # NOTE: a row shorter than the widest is padded with its own last block (masked): no
        # view ever gathers a block outside its row's window
        cut = np.take_along_axis(tables, np.minimum(cols, last[:, None]), axis=1)
        key_positions = (cols[:, :, None] * block_size
                         + np.arange(block_size)).reshape(len(lens), -1)  # (d, width * bs)
        mask = window_mask(lens - 1, key_positions, window)
        device = self.block_tables.device
        return DecodeGroup(self.rows, torch.from_numpy(cut).to(device), self.context_lens,
                           torch.from_numpy(mask).to(device))


@dataclass
class AttentionMetadata:
    """slot_mapping: (T,) flat cache slot of each new token.

    Prefills (more than one new token, a first token, or a one-token chunk that samples
    nothing) are attended one by one; decodes (`ScheduledSeq.is_one_token_decode`) in a few
    groups of similar context length. With group_decodes=False an iteration of decodes only,
    some verified with draft tokens, is one group of a row per token (`_one_decode_group`).
    NOTE: masks are built here, once per iteration, not in each layer.
    """

    slot_mapping: torch.Tensor
    prefills: list[PrefillSeq]
    decode_groups: list[DecodeGroup]
    block_size: int

    @property
    def decode_only(self) -> bool:
        """Every token is a decode row and all are one group, rows 0..T-1 in order."""
        return not self.prefills and len(self.decode_groups) == 1

    @property
    def num_decodes(self) -> int:
        return sum(int(g.rows.numel()) for g in self.decode_groups)


# NOTE: a decode group pads every table to its longest, so one long sequence would make each
# short one gather (and attend over) as many blocks. Sequences are grouped by length: a group
# keeps tables at least 1/GROUP_LENGTH_RATIO as long as its longest, unless keeping the rest
# too would pad fewer than GROUP_MIN_SAVED_BLOCKS blocks (another group costs a few small
# ops per layer, worth it only when it saves more gathering than that).
GROUP_LENGTH_RATIO = 2
GROUP_MIN_SAVED_BLOCKS = 64


def build_metadata(seqs: list[ScheduledSeq], block_size: int, device: torch.device,
                   group_decodes: bool = True, short_chunks_as_rows: bool = False
                   ) -> AttentionMetadata:
    """Compute slots and per-sequence views for one iteration (numpy, no per-token Python).

    group_decodes=False puts all decodes in one group: for a kernel that reads only each
    sequence's own context, padding costs nothing and one group is one call per layer; an
    iteration of decodes only is then one group of a row per token (`_one_decode_group`,
    the decode stack's shape), and with short_chunks_as_rows (ops without a prefill kernel,
    whose prefills are attended one at a time) so is one of decodes and short prefill
    chunks (`runs_as_rows`).
    """
    to = lambda a: torch.from_numpy(a).to(device)
    if not group_decodes and seqs and (runs_as_rows(seqs) if short_chunks_as_rows
                                       else all(s.is_decode for s in seqs)):
        return _one_decode_group(seqs, block_size, to)
    lengths = np.array([s.num_tokens for s in seqs], dtype=np.int64)
    query_starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    slot_mapping = np.concatenate([_slots(s, block_size) for s in seqs])
    prefills, decode_idx = [], []
    for i, seq in enumerate(seqs):
        if seq.is_one_token_decode:  # NOTE: ScheduledSeq.is_decode, the one definition
            decode_idx.append(i)
        else:
            prefills.append(PrefillSeq(
                int(query_starts[i]), seq.num_tokens, seq.start_pos, seq.context_len,
                torch.tensor(seq.block_table, dtype=torch.int64, device=device),
                to(_causal_mask(seq.start_pos, seq.context_len)), block_size))
    table_lens = np.array([len(seqs[i].block_table) for i in decode_idx], dtype=np.int64)
    groups = []
    members_of_groups = (group_by_length(table_lens) if group_decodes
                         else [np.arange(len(decode_idx))] if decode_idx else [])
    for members in members_of_groups:
        chosen = [decode_idx[m] for m in members]
        tables, context_lens = _padded_tables([seqs[i] for i in chosen])
        key_positions = np.arange(tables.shape[1] * block_size)
        mask = key_positions[None, :] < context_lens[:, None] if group_decodes else None
        groups.append(DecodeGroup(
            rows=to(query_starts[chosen].astype(np.int64)), block_tables=to(tables),
            context_lens=to(context_lens), mask=None if mask is None else to(mask)))
    return AttentionMetadata(to(slot_mapping), prefills, groups, block_size)


def _one_decode_group(seqs: list[ScheduledSeq], block_size: int, to) -> AttentionMetadata:
    """build_metadata of an iteration of rows (`runs_as_rows`) in one group without a mask,
    in a few array operations (the decode stack's every step).

    A decode verified with k draft tokens, or a prefill chunk of n tokens, is k + 1 (n) rows
    of the group: the row at position p reads the sequence's table up to p (context_len
    p + 1). NOTE: that is exact causal attention over the chunk because every layer writes
    all rows' K/V before any row attends (`paged_attention`, the decode stack), so
    speculative decoding's iterations and a burst's short prompts (a prefix-cache hit
    leaves a few tokens each) run on the decode stack too: a prefill chunk attended on its
    own costs a gather and an SDPA call per layer (W's burst at 64 slots, SmolLM2: 40
    prompts of ~7 tokens took ~225 ms on the general path).
    """
    tables, context_lens = _padded_tables(seqs)
    counts = np.array([s.num_tokens for s in seqs], dtype=np.int64)
    if int(counts.sum()) == len(seqs):  # one token each: no rows to repeat
        positions = context_lens - 1  # of each sequence's one new token
    else:
        owner = np.repeat(np.arange(len(seqs)), counts)  # (T,) each row's sequence
        positions = np.concatenate([np.arange(s.start_pos, s.context_len) for s in seqs])
        tables, context_lens = tables[owner], positions + 1
    slots = tables[np.arange(len(positions)), positions // block_size] * block_size
    group = DecodeGroup(rows=to(np.arange(len(positions))), block_tables=to(tables),
                        context_lens=to(context_lens), mask=None)
    return AttentionMetadata(to(slots + positions % block_size), [], [group], block_size)


def group_by_length(table_lens: np.ndarray) -> list[np.ndarray]:
    """Indices of table_lens split into groups of similar length, each in ascending order."""
    order = np.argsort(-table_lens, kind="stable")  # longest first
    groups, start = [], 0
    while start < len(order):
        longest = table_lens[order[start]]
        rest = table_lens[order[start:]]
        if int((longest - rest).sum()) < GROUP_MIN_SAVED_BLOCKS:
            end = len(order)
        else:
            end = start + int((rest * GROUP_LENGTH_RATIO >= longest).sum())
        groups.append(np.sort(order[start:end]))
        start = end
    return groups


def _slots(seq: ScheduledSeq, block_size: int) -> np.ndarray:
    positions = np.arange(seq.start_pos, seq.context_len)
    table = np.asarray(seq.block_table, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


def window_mask(query_positions: np.ndarray, key_positions: np.ndarray,
                window: int) -> np.ndarray:
    """Which keys each query sees with a sliding window (HF's
    `sliding_window_causal_mask_function`): key j iff j <= i and i - j < window.

    query_positions (n,); key_positions (m,) shared by all queries, or (n, m) one row each
    -> (n, m) bool.
    """
    if key_positions.ndim == 1:
        key_positions = key_positions[None, :]
    behind = query_positions[:, None] - key_positions
    return (behind >= 0) & (behind < window)


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
