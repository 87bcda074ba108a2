"""Sampler: logits of the sampling positions -> one token per request, in one batch.

Greedy rows take the argmax. Other rows: temperature, then top-k / top-p / min-p masks,
then an exponential race (argmax of p / q with q ~ Exp(1)), which equals sampling from p.
A seeded request draws q from its own generator, seeded by (seed, output index), so its
tokens do not depend on the batch around it nor on preemption.
"""

from __future__ import annotations

import torch

from slotserve.core.outputs import ScheduledSeq
from slotserve.sampling import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, step) over 64 bits


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[ScheduledSeq]
                 ) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits: (S, V) fp32, one row per sampling sequence, in `seqs` order."""
        params = [s.sampling_params for s in seqs]
        tokens = argmax_rows(logits)  # (S,)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            tokens[rows] = self._sample(logits[rows], [seqs[i] for i in random_rows])
        token_list = tokens.tolist()
        return token_list, self._logprobs(logits, params, token_list)

    def _sample(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
        params = [s.sampling_params for s in seqs]
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        probs = apply_filters(logits / temps[:, None], params).softmax(dim=-1)  # (R, V)
        q = torch.empty_like(probs)
        for row, seq in enumerate(seqs):
            q[row].exponential_(generator=self._generator_for(seq))
        return argmax_rows(probs / q)

    def _generator_for(self, seq: ScheduledSeq) -> torch.Generator:
        seed = seq.sampling_params.seed
        if seed is None:
            return self.generator
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


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """(S, V) -> (S,) int64: each row's argmax (the first one on ties or NaN, as torch's).

    NOTE: on the CPU numpy's vectorised argmax took 4 us for one 49,152-wide row and 0.5 ms
    for 64 rows here, torch 2.13's 90 us and 3.9 ms.
    """
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (set to -inf) tokens outside each row's top-k, top-p and min-p sets."""
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    vocab = logits.shape[-1]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p, vocab)
    if any(m > 0 for m in min_p):
        probs = logits.softmax(dim=-1)
        threshold = torch.tensor(min_p, device=logits.device)[:, None] * probs.amax(-1, True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _top_k_top_p(logits, top_k: list[int], top_p: list[float], vocab: int) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (R, V)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=logits.device)
    remove = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
    p = torch.tensor(top_p, device=logits.device)[:, None]
    remove |= mass_before >= p  # NOTE: the top token always stays (mass_before == 0 < p)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
