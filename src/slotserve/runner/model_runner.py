"""ModelRunner: SchedulerOutput -> tensors -> one forward -> sampled tokens."""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import torch

from slotserve.attention import kv_int8
from slotserve.attention.metadata import build_metadata
from slotserve.config import CacheConfig, ModelConfig, SlotKind
from slotserve.core.outputs import RunnerOutput, ScheduledSeq, SchedulerOutput
from slotserve.model.kernels import DTYPES, KernelSet, resolve_dtype, resolve_kernels
from slotserve.model.registry import build_model
from slotserve.runner.decode_graphs import DecodeGraphs
from slotserve.runner.heap import keep_freed_memory
from slotserve.runner.lookups import NO_LOOKUPS, RequestLookups
from slotserve.runner.prompt_logprobs import compute_prompt_logprobs
from slotserve.runner.sampler import AllowedTokens, Sampler
from slotserve.sampling import SamplingParams
from slotserve.spec.verify import (
    accept_greedy,
    accept_sampled,
    acceptance_generator,
    rows_within,
    shaping_for_rows,
    target_probs,
)
from slotserve.structured.grammar import (
    GrammarMatcher,
    allocate_bitmask,
    fill_bitmasks,
    unpack_bitmask,
)

__all__ = ["DTYPES", "ModelRunner", "kv_block_bytes", "resolve_dtype"]

# The KV pool's dtypes that numpy's lazily zeroed pages can hold (as their bytes).
LAZY_ZEROS_DTYPES = {torch.float32, torch.bfloat16, torch.int8}
PAGE_BYTES, HUGE_PAGE_BYTES = 4096, 2 << 20


def staggered_stride(region_bytes: int, count: int) -> int:
    """Bytes between the starts of `count` regions of `region_bytes` each in one buffer, so
    that their starts fall at `count` different offsets within a 2 MB huge page (4 KB
    aligned).

    NOTE: numpy backs a large buffer with transparent huge pages (it madvises them), so the
    first write past a 2 MB boundary of a region faults in and zeroes a whole 2 MB page.
    Regions a whole number of huge pages apart cross those boundaries at the same block: the
    iteration that first wrote such a block paid every layer's K and V page at once
    (SmolLM2, 4096 blocks = 12 x 2 MB a region: 60 faults, a 200-370 ms step on the 2-core
    Xeon, every ~341 blocks of a fresh pool). Staggered, the pages come one at a time.
    """
    step = max(PAGE_BYTES, HUGE_PAGE_BYTES // max(count, 1) // PAGE_BYTES * PAGE_BYTES)
    base = -(-region_bytes // PAGE_BYTES) * PAGE_BYTES
    return base + (step - base % HUGE_PAGE_BYTES) % HUGE_PAGE_BYTES


def kv_head_row(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cached head row (a token's K or V of one KV head): hd, or an int8
    cache's hd codes + their fp32 scales' bytes (attention/kv_int8.py)."""
    return kv_int8.row_bytes(head_dim) if dtype == torch.int8 else head_dim


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block: K and V of block_size positions in every layer (an int8 cache's
    scales included)."""
    row = kv_head_row(cfg.head_dim, dtype)
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * row * dtype.itemsize
    return per_token * block_size


class ModelRunner:
    """Owns the model weights, the preallocated KV pool and the sampler.

    kernels: the KernelSet the model runs (model/kernels.py); default: resolved from
    device and dtype with kernels="auto" and fp32 weights.
    kv_cache_dtype: the KV pool's element type (default: the model's dtype); torch.int8:
    attention/kv_int8.py's rows (CPU only).
    lookups: what the runner asks the engine about a running request (its grammar matcher,
    logit shaping, prompt-logprobs accumulator) and the EOS ids min_tokens masks
    (runner/lookups.py); default: none, every request unconstrained.
    """

    def __init__(self, model_config: ModelConfig, weights: dict[str, torch.Tensor],
                 cache_config: CacheConfig, num_blocks: int, device: str = "cpu",
                 dtype: str | None = None, seed: int = 0, *,
                 kernels: KernelSet | None = None,
                 kv_cache_dtype: torch.dtype | None = None,
                 lookups: RequestLookups = NO_LOOKUPS) -> None:
        self.config = model_config
        self.device = torch.device(device)
        self.dtype = resolve_dtype(device, dtype)
        self.kv_cache_dtype = kv_cache_dtype or self.dtype
        if self.kv_cache_dtype == torch.int8 and self.device.type != "cpu":
            raise ValueError(f"kv_cache_dtype='int8' runs on the CPU only; got device {device!r}")
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        self.kernels = kernels or resolve_kernels(device=device, dtype=dtype)
        with torch.device(self.device):  # NOTE: a GPU's model never takes host memory
            self.model = build_model(model_config, self.kernels)
        # NOTE: the model may run less (no decode stack for some families: KernelSet.for_model)
        self.kernels = getattr(self.model, "kernels", self.kernels)
        self.model.to(device=self.device, dtype=self.dtype).eval()
        self.model.rotary.float()  # NOTE: RoPE tables stay fp32 whatever the weights' dtype
        # NOTE: after .to(): it builds the kernels (GGUF blocks dequantized unless they run them)
        self.model.load_hf_weights(weights)
        self.kernels = self.kernels.loaded(self.model)  # the start-up line's bytes per step
        self.kv_caches = self._allocate_kv_cache()
        if self.device.type == "cpu":
            keep_freed_memory()  # NOTE: once loaded: no step faults its tensors in (heap.py)
        # NOTE: fixed at construction; the engine's per-request state is only read through it
        self._lookups = lookups
        self.sampler = Sampler(self.device, seed, eos_token_ids=lookups.eos_token_ids,
                               ops=self.kernels.layer_ops)
        self._mask_worker: ThreadPoolExecutor | None = None
        # Decode-only iterations through CUDA graphs, once capture_decode_graphs ran.
        self.decode_graphs: DecodeGraphs | None = None

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture the decode-only forward as CUDA graphs at a few padded batch sizes up to
        max_num_seqs (runner/decode_graphs.py), on CUDA with the Triton kernels; nothing
        elsewhere (the CPU's decode stack is its one call per iteration)."""
        if self.device.type != "cuda" or not self.kernels.fused_layers:
            return
        tables_width = -(-max_model_len // self.block_size)
        self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size,
                                          max_num_seqs, tables_width, self.device)

    @property
    def lookups(self) -> RequestLookups:
        """What the runner asks the engine about its requests (given at construction)."""
        return self._lookups

    @property
    def linear_kernel(self) -> str:
        """The linear layers' kernel, the fused ops and the decode stack, in words."""
        return self.kernels.describe_linears()

    @property
    def fused_cpu_ops(self) -> bool:
        """Whether norms, RoPE, KV writes and decode attention run the fused CPU kernels."""
        return self.kernels.fused_layers

    @property
    def short_chunks_as_rows(self) -> bool:
        """Whether an iteration of decodes and short prefill chunks (`runs_as_rows`) runs
        as rows of one decode group: with the fused C++ CPU kernels (on the decode stack, or
        layer by layer through the same decode attention where a model's family has no
        stack: the same sums). Elsewhere, the Triton kernels on CUDA included (not timed
        so), `paged_attention` attends each chunk on its own."""
        return self.fused_cpu_ops and hasattr(self.kernels.ops, "DecodeStack")

    def _allocate_kv_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """NOTE: preallocated once; blocks are only ever indexed, never reallocated.

        Zeros, not garbage: attention reads whole blocks and masks the tail, and a NaN
        bit pattern there would survive the mask (0 * NaN). On the CPU, numpy's calloc gives
        zero pages lazily, so a large pool costs nothing until its blocks are used.
        """
        cfg = self.config
        # NOTE: one (blocks, block_size, nkv, hd) region per layer's K and per layer's V
        shape = (self.num_blocks, self.block_size, cfg.num_key_value_heads,
                 kv_head_row(cfg.head_dim, self.kv_cache_dtype))
        regions = self._zeros(2 * cfg.num_hidden_layers, shape)
        return [(regions[2 * i], regions[2 * i + 1]) for i in range(cfg.num_hidden_layers)]

    def _zeros(self, count: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
        """`count` zeroed, contiguous tensors of `shape` in the KV dtype. On the CPU, views
        of one lazily zeroed numpy buffer, `staggered_stride` bytes apart."""
        dtype = self.kv_cache_dtype
        if self.device.type != "cpu" or dtype not in LAZY_ZEROS_DTYPES:
            pool = torch.zeros((count, *shape), dtype=dtype, device=self.device)
            return [pool[i] for i in range(count)]
        region = math.prod(shape) * dtype.itemsize
        stride = staggered_stride(region, count)
        buffer = np.zeros(stride * (count - 1) + region, dtype=np.uint8)
        return [torch.from_numpy(buffer[i * stride:i * stride + region]).view(dtype)
                .view(shape) for i in range(count)]

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run one iteration: all scheduled tokens in one forward, then sample."""
        seqs = plan.seqs
        sampling = [s for s in seqs if s.sample]
        # NOTE: computed on a worker during the forward; with drafts, one row per draft too
        drafted = any(s.spec_token_ids for s in sampling)
        masks = self._start_masks_verified(sampling) if drafted else self._start_masks(sampling)
        try:
            hidden, sample_rows = self._forward(plan)  # (T, H), (S,)
        finally:
            allowed = None if masks is None else masks.result()  # (raises what the worker did)
        self._fill_prompt_logprobs(seqs, hidden)  # NOTE: before hidden keeps only sample rows
        if not sampling:
            return RunnerOutput(sampled={})
        if drafted:  # speculative decoding: verify the drafts
            return self._sample_verified(seqs, hidden, allowed)
        if len(sample_rows) < len(hidden):  # NOTE: the rows ascend: all of them is every row
            hidden = hidden[sample_rows]
        logits = self.model.compute_logits(hidden)  # (S, V), only where sampling
        shaping = [self._lookups.shaping_of(s.request_id) for s in sampling]
        extra = {} if all(s is None for s in shaping) else {"shaping": shaping}
        if allowed is None:  # NOTE: the sampler's two-argument form when nothing is masked
            tokens, logprobs = self.sampler(logits, sampling, **extra)
        else:
            tokens, logprobs = self.sampler(logits, sampling, allowed, **extra)
        ids = [s.request_id for s in sampling]
        return RunnerOutput(
            sampled=dict(zip(ids, tokens)),
            logprobs={i: lp for i, lp in zip(ids, logprobs) if lp is not None})

    def _sample_verified(self, seqs: list[ScheduledSeq], hidden: torch.Tensor,
                         allowed: AllowedTokens | None) -> RunnerOutput:
        """Sampling when some sequences carry draft tokens (spec/verify.py): logits at each of
        a drafted sequence's 1 + k last rows, all rows through the sampler in one batch (row
        i of a drafted sequence as output position num_output_tokens + i), then each drafted
        sequence accepts a prefix of its drafts and takes the token after it.

        allowed: the grammar masks of `_start_masks_verified`, by row. Logit shaping and
        grammars apply to every row, row i of a drafted sequence seeing its first i drafts
        as output.
        """
        ends = np.cumsum([s.num_tokens for s in seqs]) - 1
        rows: list[int] = []
        row_seqs: list[ScheduledSeq] = []
        first_row: dict[str, int] = {}  # sampling sequence -> its first row among `rows`
        for end, seq in zip(ends.tolist(), seqs):
            if not seq.sample:
                continue
            k = len(seq.spec_token_ids)
            first_row[seq.request_id] = len(rows)
            rows += range(end - k, end + 1)
            row_seqs += [replace(seq, num_output_tokens=seq.num_output_tokens + i) if i else seq
                         for i in range(k + 1)]
        logits = self.model.compute_logits(
            hidden[torch.tensor(rows, device=hidden.device)])  # (R, V)
        sampling = [s for s in seqs if s.sample]
        last_row = [first_row[s.request_id] + len(s.spec_token_ids) for s in sampling]
        extra: dict = {} if allowed is None else {"allowed": allowed}
        shaping: list = [None] * len(rows)
        for s in sampling:
            first = first_row[s.request_id]
            shaping[first:first + len(s.spec_token_ids) + 1] = shaping_for_rows(
                self._lookups.shaping_of(s.request_id), s.spec_token_ids)
        if any(x is not None for x in shaping):
            extra["shaping"] = shaping
        tokens, logprobs = self.sampler(logits, row_seqs, **extra)
        out = RunnerOutput(sampled={}, logprobs={})
        for s, row in zip(sampling, last_row):
            if not s.spec_token_ids:
                out.sampled[s.request_id] = tokens[row]
                if logprobs[row] is not None:
                    out.logprobs[s.request_id] = logprobs[row]
                continue
            self._verify_drafts(s, first_row[s.request_id], logits, row_seqs, tokens, out,
                                shaping, allowed)
        return out

    def _verify_drafts(self, seq: ScheduledSeq, first: int, logits: torch.Tensor,
                       row_seqs: list[ScheduledSeq], tokens: list[int],
                       out: RunnerOutput, shaping: list,
                       allowed: AllowedTokens | None) -> None:
        """Accept a prefix of one sequence's drafts (rows first .. first + k) into `out`."""
        drafts = seq.spec_token_ids
        k = len(drafts)
        span = slice(first, first + k + 1)
        if seq.sampling_params.greedy:
            num_accepted, token = accept_greedy(drafts, tokens[span])
        else:
            probs = target_probs(logits[span], row_seqs[span], self.sampler.eos_token_ids,
                                 shaping[span] if shaping[first] is not None else None,
                                 rows_within(allowed, first, k + 1))
            gens = [acceptance_generator(seq, i, self.sampler.generator, self.device)
                    for i in range(k)]
            num_accepted, token = accept_sampled(drafts, probs, tokens[first + k], gens)
        chosen = [*drafts[:num_accepted], token]
        out.sampled[seq.request_id] = token
        out.accepted[seq.request_id] = list(drafts[:num_accepted])
        if seq.sampling_params.logprobs is not None:
            params = [seq.sampling_params] * len(chosen)
            entries = Sampler._logprobs(logits[first:first + len(chosen)], params, chosen)
            out.logprobs[seq.request_id] = entries[-1]
            out.accepted_logprobs[seq.request_id] = entries[:-1]

    def _start_masks_verified(self, sampling: list[ScheduledSeq]
                              ) -> Future[AllowedTokens] | None:
        """`_start_masks` for an iteration with drafts: the allowed tokens of every row of a
        constrained sequence (row i: after its first i drafts), by row of `_sample_verified`'s
        layout (each sampling sequence's 1 + k rows in order). None if nothing is masked."""
        entries = []
        row = 0
        for seq in sampling:
            matcher = self._lookups.grammar_of(seq.request_id)
            if matcher is not None:
                entries.append((matcher, row, list(seq.spec_token_ids)))
            row += len(seq.spec_token_ids) + 1
        if not entries:
            return None
        if self._mask_worker is None:
            self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="slotserve-masks")
        return self._mask_worker.submit(self._compute_masks_verified, entries)

    def _compute_masks_verified(self, entries: list[tuple[GrammarMatcher, int, list[int]]]
                                ) -> AllowedTokens:
        """Each constrained sequence's rows: its matcher, then copies of it that consumed its
        first 1, 2, ... drafts (the engine proposed only drafts its grammar accepts).

        NOTE: the sequence's own matcher is only read (deep-copied), as `_start_masks` reads
        it: the engine advances it after the step.
        """
        rows: list[tuple[GrammarMatcher, int]] = []
        for matcher, first, drafts in entries:
            rows.append((matcher, first))
            current = matcher.ll_matcher
            for i, token in enumerate(drafts):
                current = current.deep_copy()
                if not current.consume_token(token):
                    raise ValueError(f"the grammar rejects draft token {token} (row {first + i})")
                rows.append((GrammarMatcher(current, matcher.spec), first + i + 1))
        return self._compute_masks(rows)

    def _fill_prompt_logprobs(self, seqs: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        """The prompt rows' logprobs of the completions that ask for them (runner/
        prompt_logprobs.py); nothing for the others, whose prompt rows get no logits."""
        rows = []
        chunk_row = 0
        for s in seqs:
            acc = (self._lookups.prompt_logprobs_of(s.request_id)
                   if s.sampling_params.prompt_logprobs is not None else None)
            if acc is not None:
                offsets = acc.rows_to_compute(s.start_pos, s.num_tokens)
                if offsets:
                    rows.append((acc, chunk_row, offsets))
            chunk_row += s.num_tokens
        if rows:
            compute_prompt_logprobs(hidden, rows, self.model.compute_logits)

    @torch.inference_mode()
    def score(self, token_ids: list[int], block_table: list[int]) -> torch.Tensor:
        """Teacher-forced logits (L, V) of every position of `token_ids` in one prefill.

        block_table: KV blocks that cover the L positions, borrowed from the pool by the
        caller (LLMEngine.score); the pass writes their K/V and nothing else.
        """
        seq = ScheduledSeq("__score__", list(token_ids), 0, list(block_table), True,
                           SamplingParams(), 0, SlotKind.PREFILL)
        meta = build_metadata([seq], self.block_size, self.device)
        ids = torch.tensor(token_ids, device=self.device)
        positions = torch.arange(len(token_ids), device=self.device)
        hidden = self.model(ids, positions, self.kv_caches, meta)  # (L, H)
        return self.model.compute_logits(hidden)  # (L, V)

    def _start_masks(self, sampling) -> Future[AllowedTokens] | None:
        """Start computing the allowed tokens of the constrained rows; None if there are none.

        NOTE: the grammar engine releases the GIL, so the masks are computed while the forward
        runs; the matchers are only read here (the engine advances them after the step).
        Measured with SmolLM2 on a loaded 2-core CPU: a step's masks took 0.27 ms (1 row) to
        0.6 ms (8 rows) at the median, the wait for them after the forward 0.02 ms.
        """
        grammar_of = self._lookups.grammar_of
        rows = [(m, i) for i, m in enumerate(grammar_of(s.request_id) for s in sampling)
                if m is not None]
        if not rows:
            return None
        if self._mask_worker is None:
            self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="slotserve-masks")
        return self._mask_worker.submit(self._compute_masks, rows)

    def _compute_masks(self, rows: list[tuple[GrammarMatcher, int]]) -> AllowedTokens:
        bitmask = allocate_bitmask(len(rows), self.config.vocab_size)
        fill_bitmasks([(m, k) for k, (m, _) in enumerate(rows)], bitmask)
        allowed = unpack_bitmask(bitmask, self.config.vocab_size)
        empty = np.flatnonzero(~allowed.any(axis=1))
        if empty.size:  # NOTE: fails the iteration; fault isolation narrows it to this row
            raise ValueError(f"the grammar allows no next token (row {rows[empty[0]][1]})")
        return [i for _, i in rows], torch.from_numpy(allowed)

    def _forward(self, plan: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden states of every scheduled token (T, H) and the rows sampled (S,): a
        decode-only iteration through the captured CUDA graphs where they run it, else one
        eager forward."""
        seqs = plan.seqs
        if self.decode_graphs is not None and self.decode_graphs.runs(seqs):
            hidden = self.decode_graphs.forward(seqs)  # (D, H)
            return hidden, torch.from_numpy(np.flatnonzero([s.sample for s in seqs]))
        input_ids, positions, sample_rows = self._prepare_inputs(plan)
        # NOTE: the fused decode kernel reads only each sequence's own blocks: no padding to
        # avoid, so all decodes go in one group (one call per layer); without a prefill
        # kernel, an iteration of short chunks too with the C++ CPU kernels.
        meta = build_metadata(seqs, self.block_size, self.device,
                              group_decodes=not self.fused_cpu_ops,
                              short_chunks_as_rows=self.short_chunks_as_rows)
        return self.model(input_ids, positions, self.kv_caches, meta), sample_rows

    def _prepare_inputs(self, plan: SchedulerOutput):
        """Flat token ids (T,), positions (T,) and the rows whose logits are sampled."""
        seqs = plan.seqs
        input_ids = np.fromiter((t for s in seqs for t in s.token_ids), dtype=np.int64)
        if len(input_ids) == len(seqs):  # one token each (decodes): no ranges to build
            positions = np.fromiter((s.start_pos for s in seqs), dtype=np.int64)
            sample_rows = np.flatnonzero([s.sample for s in seqs])
        else:
            positions = np.concatenate([np.arange(s.start_pos, s.context_len) for s in seqs])
            ends = np.cumsum([s.num_tokens for s in seqs]) - 1
            sample_rows = ends[[i for i, s in enumerate(seqs) if s.sample]]
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)
        return to(input_ids), to(positions), to(sample_rows)

