"""Sampler: logits of the sampling positions -> one token per request, in one batch.

Greedy rows (temperature < 1e-5) take the argmax. Other rows: temperature, then top-k /
top-p / min-p masks, then an exponential race (argmax of p / q with q ~ Exp(1)), which equals
sampling from p. A seeded request draws q from its own generator, seeded by (seed, output
index), so its tokens do not depend on the batch around it nor on preemption.

Structured outputs: a constrained row comes with its grammar's allowed tokens; the others
are set to -inf before the argmax or the race, in the same batch as unconstrained rows.
Log-probabilities stay those of the model (unmasked), as vLLM's default.

min_tokens: a row whose sequence has fewer output tokens than its min_tokens cannot take
EOS (unless ignore_eos) nor its stop_token_ids (vLLM's MinTokensLogitsProcessor).

Penalties and logit shaping (runner/logit_shaping.py), in vLLM's order: allowed_token_ids
and bad_words mask with the grammar, before min_tokens; then logit_bias, the repetition,
frequency and presence penalties, before the greedy argmax and the temperature. Rows without
them take the path above unchanged.

NOTE: every SamplingParams value reaches a tensor only after it is clamped to what the tensor
holds (top_k to the vocabulary, temperature to float32's largest), and the most likely token
of a row always survives the masks, so a row with one finite logit never samples a -inf one.
"""

from __future__ import annotations

import torch

from slotserve.core.outputs import ScheduledSeq
from slotserve.runner.logit_shaping import Shaping, apply_bias_and_penalties, apply_masks
from slotserve.sampling import SamplingParams

AllowedTokens = tuple[list[int], torch.Tensor]  # (rows, (R, V) bool): see Sampler.__call__
_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, step) over 64 bits
_FLOAT32_MAX = torch.finfo(torch.float32).max


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0,
                 eos_token_ids: tuple[int, ...] = (), ops=None) -> None:
        """eos_token_ids: the model's EOS tokens (ModelRunner passes its RequestLookups'),
        which min_tokens keeps out. ops: the fused CPU kernels (their argmax_rows), or None."""
        self.device = device
        self.ops = ops
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.eos_token_ids = eos_token_ids

    def __call__(self, logits: torch.Tensor, seqs: list[ScheduledSeq],
                 allowed: AllowedTokens | None = None, shaping: Shaping | None = None
                 ) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits: (S, V) fp32, one row per sampling sequence, in `seqs` order.

        allowed: (rows, mask): mask[i] (V,) bool holds the tokens that row rows[i] may take.
        shaping: one SequenceShaping (or None) per row: its penalties and logit shaping.
        """
        params = [s.sampling_params for s in seqs]
        masked = logits if allowed is None else mask_disallowed(logits, *allowed)
        if shaping is not None:  # NOTE: in place only in a copy, never in `logits`
            masked = apply_masks(masked, shaping, in_place=masked is not logits)
        masked = mask_min_tokens(masked, seqs, self.eos_token_ids)
        if shaping is not None:
            masked = apply_bias_and_penalties(masked, shaping, in_place=masked is not logits)
        tokens = argmax_rows(masked, self.ops)  # (S,)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            tokens[rows] = self._sample(masked[rows], [seqs[i] for i in random_rows])
        token_list = tokens.tolist()
        return token_list, self._logprobs(logits, params, token_list)

    def _sample(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
        params = [s.sampling_params for s in seqs]
        temps = torch.tensor([min(p.temperature, _FLOAT32_MAX) for p in params],
                             dtype=torch.float32, device=logits.device)
        scaled = _shift_to_max(logits.float()).div_(temps[:, None])  # <= 0, the max at 0
        probs = apply_filters(scaled, params).softmax(dim=-1)  # (R, V)
        q = torch.empty_like(probs)
        for row, seq in enumerate(seqs):
            q[row].exponential_(generator=self._generator_for(seq))
        # NOTE: a q of exactly 0 would make 0 / 0 = NaN for a masked token, and NaN wins argmax.
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return argmax_rows(probs / q, self.ops)

    def _generator_for(self, seq: ScheduledSeq) -> torch.Generator:
        seed = seq.sampling_params.seed
        if seed is None:
            return self.generator
        # NOTE: Python ints, reduced into [0, 2**63): any int64 seed (negative too) fits.
        mixed = (seed * _SEED_MIX + seq.num_output_tokens) % (2**63)
        return torch.Generator(device=self.device).manual_seed(mixed)

    @staticmethod
    def _logprobs(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]
                  ) -> list[dict[int, float] | None]:
        """Top-N log-probabilities of the model's distribution, plus the sampled token."""
        wanted = [p.logprobs for p in params]
        if all(n is None for n in wanted):
            return [None] * len(params)
        logp = logits.log_softmax(dim=-1)
        top_n = max(n or 0 for n in wanted)
        top_vals, top_ids = logp.topk(max(top_n, 1), dim=-1)
        result: list[dict[int, float] | None] = []
        for row, n in enumerate(wanted):
            if n is None:
                result.append(None)
                continue
            entry = {int(t): float(v) for t, v in zip(top_ids[row, :n], top_vals[row, :n])}
            entry[tokens[row]] = float(logp[row, tokens[row]])
            result.append(entry)
        return result


def mask_disallowed(logits: torch.Tensor, rows: list[int], allowed: torch.Tensor
                    ) -> torch.Tensor:
    """A copy of logits with -inf at the tokens rows[i] may not take (allowed[i] False).

    NOTE: every constrained row must allow a token (the runner checks): a row of -inf only
    would make argmax take token 0.
    """
    if allowed.shape != (len(rows), logits.shape[-1]):
        raise ValueError(f"allowed-token mask of shape {tuple(allowed.shape)} for "
                         f"{len(rows)} rows of {logits.shape[-1]} logits")
    out = logits.clone()
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    out[index] = out[index].masked_fill(~allowed.to(logits.device), float("-inf"))
    return out


def mask_min_tokens(logits: torch.Tensor, seqs: list[ScheduledSeq],
                    eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """`logits`, or a copy with -inf at the stop tokens of each row whose sequence has fewer
    output tokens than its min_tokens: its stop_token_ids, and EOS unless ignore_eos.

    NOTE: a row that would have no token left (its grammar allows only those tokens, or the
    stop tokens cover the vocabulary) keeps its logits: a row of -inf only would sample
    token 0, which nothing allowed.
    """
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    for row, seq in enumerate(seqs):
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            continue
        # NOTE: stop_token_ids may lie past the vocab; an id twice (EOS among them) is
        # harmless (set to -inf twice), so no set is built per step
        ids = [t for t in params.stop_token_set if t < vocab]
        if not params.ignore_eos:
            ids += [t for t in eos_token_ids if t < vocab]
        rows += [row] * len(ids)
        cols += ids
    if not rows:
        return logits
    out = logits.clone()
    out[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = (
        float("-inf"))
    emptied = (out == float("-inf")).all(dim=-1)
    if bool(emptied.any()):
        out[emptied] = logits[emptied]
    return out


def argmax_rows(logits: torch.Tensor, ops=None) -> torch.Tensor:
    """(S, V) -> (S,) int64: each row's argmax (the first one on ties or NaN, as torch's).

    ops: the fused CPU kernels, whose argmax_rows runs the rows on every thread.
    NOTE: on the CPU numpy's vectorised argmax took 4 us for one 49,152-wide row and 0.5 ms
    for 64 rows here, torch 2.13's 90 us and 3.9 ms; inside a 64-sequence step (the logits
    just written by the LM head) numpy's took 2.6 ms.
    """
    if (logits.device.type == "cpu" and logits.dtype == torch.float32
            and hasattr(ops, "argmax_rows")):  # NOTE: the Triton kernels have none
        return ops.argmax_rows(logits)
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def _shift_to_max(logits: torch.Tensor) -> torch.Tensor:
    """Each row minus its max (a new tensor), so that dividing by a tiny temperature cannot
    overflow: the max becomes 0, the rest <= 0.

    Rows whose max is not finite (a NaN, a +inf, all -inf) take the slow way: NaN logits count
    as -inf, entries equal to the row's max become 0 (inf - inf would be NaN), so a +inf row
    keeps only its +inf tokens and an all -inf row becomes uniform.
    """
    row_max = logits.amax(dim=-1, keepdim=True)  # NaN where the row holds a NaN
    if bool(row_max.isfinite().all()):
        return logits - row_max
    logits = logits.masked_fill(logits.isnan(), float("-inf"))
    row_max = logits.amax(dim=-1, keepdim=True)
    return (logits - row_max).masked_fill(logits == row_max, 0.0)


def apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (set to -inf) tokens outside each row's top-k, top-p and min-p sets.

    NOTE: each row's most likely token always stays (top_k >= 1, rank 0 is exempt from top_p,
    and min_p <= 1 keeps the max), so a row with a finite logit keeps a finite one.
    """
    vocab = logits.shape[-1]
    top_k = [k if 0 < k < vocab else vocab for k in (p.top_k for p in params)]  # clamped
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p, vocab)
    if any(m > 0 for m in min_p):
        probs = logits.softmax(dim=-1)
        threshold = torch.tensor(min_p, device=logits.device)[:, None] * probs.amax(-1, True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _top_k_top_p(logits, top_k: list[int], top_p: list[float], vocab: int) -> torch.Tensor:
    """top_k: each in [1, vocab] (the caller clamps it)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (R, V)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.tensor(top_k, dtype=torch.int64, device=logits.device)
    remove = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
    p = torch.tensor(top_p, dtype=torch.float32, device=logits.device)[:, None]
    # NOTE: rank 0 always stays: a top_p below float32's smallest (1e-50) rounds to 0, and
    # mass_before (0) >= 0 would mask every token.
    remove |= (mass_before >= p) & (ranks > 0)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
