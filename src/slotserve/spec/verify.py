"""Verification: which of a sequence's k draft tokens are accepted, and the token after them.

A verified sequence's forward gives k + 1 rows of logits: row i is the target distribution
of output position num_output_tokens + i given the drafts before it. The rows go through the
same sampler as every row (so min_tokens and the sampling filters hold per position), then:

- greedy: draft i is accepted while it is row i's argmax; the token after the accepted
  drafts is the argmax of the first row whose draft was rejected (or of the last row): the
  tokens greedy decoding without drafts would produce, one per row.
- sampled (a point-mass proposal, q = 1 at the draft): draft i is accepted with probability
  p_i(draft); at the first rejection the token is sampled from p_i without the draft,
  renormalized (max(p - q, 0) / (1 - p(draft))); after k acceptances the bonus token is
  row k's ordinary sample. Each output position's token is then distributed as p_i, so the
  output keeps the distribution sampling without drafts gives (Leviathan et al. 2023).

p_i is the sampler's own distribution (`target_probs`: the grammar's mask, logit shaping's
masks, min_tokens' masks, logit_bias and the penalties, temperature, top-k / top-p / min-p,
in the sampler's order). What depends on the output so far sees the output plus the drafts
before row i: the penalties and bad words (`shaping_for_rows`), a structured output's
grammar (the runner's masks per row). A seeded request draws its acceptance and
residual numbers from a generator seeded by (seed, output position), salted apart from the
sampler's, so its tokens do not depend on the batch.
"""

from __future__ import annotations

import copy

import torch

from slotserve.core.outputs import ScheduledSeq
from slotserve.runner.logit_shaping import (
    SequenceShaping,
    Shaping,
    TokenCounts,
    apply_bias_and_penalties,
    apply_masks,
)
from slotserve.runner.sampler import (
    _FLOAT32_MAX,
    _SEED_MIX,
    AllowedTokens,
    _shift_to_max,
    apply_filters,
    mask_disallowed,
    mask_min_tokens,
)

_ACCEPT_SALT = 0x5DEECE66D  # keeps the acceptance draws apart from the sampler's


def accept_greedy(drafts: list[int], targets: list[int]) -> tuple[int, int]:
    """(accepted drafts, the token after them); targets: each row's argmax (k + 1)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return accepted, targets[accepted]


def accept_sampled(drafts: list[int], probs: torch.Tensor, bonus: int,
                   generators: list[torch.Generator]) -> tuple[int, int]:
    """(accepted drafts, the token after them) by point-mass rejection sampling.

    probs: (k + 1, V) the target distribution of each row; bonus: row k's own sample (taken
    when every draft is accepted); generators: one per draft row (the same one may repeat).
    """
    for i, draft in enumerate(drafts):
        p = probs[i]
        u = torch.rand((), generator=generators[i], device=p.device, dtype=torch.float64)
        p_draft = float(p[draft])
        if float(u) < p_draft:
            continue
        residual = p.clone()
        residual[draft] = 0.0
        total = float(residual.sum())
        if not total > 0.0:  # NOTE: p is the draft's alone (up to rounding): take it
            continue
        token = torch.multinomial(residual / total, 1, generator=generators[i])
        return i, int(token)
    return len(drafts), bonus


def shaping_for_rows(base: SequenceShaping | None, drafts: list[int]) -> Shaping:
    """The shaping of a drafted sequence's k + 1 rows: row i sees the output followed by
    the first i drafts (penalties' counts, bad words' prefixes); row 0 is `base` itself.

    NOTE: each row's view counts its tokens afresh (O(output) per row, k rows), and never
    changes `base` nor its output list.
    """
    if base is None:
        return [None] * (len(drafts) + 1)
    rows: Shaping = [base]
    for i in range(1, len(drafts) + 1):
        view = copy.copy(base)
        view.outputs = [*base.outputs, *drafts[:i]]
        if base.counts is not None:
            view.counts = TokenCounts(base.counts.known)
        rows.append(view)
    return rows


def target_probs(logits: torch.Tensor, rows: list[ScheduledSeq],
                 eos_token_ids: tuple[int, ...], shaping: Shaping | None = None,
                 allowed: AllowedTokens | None = None) -> torch.Tensor:
    """(R, V): the distribution the sampler samples each row from, built in the sampler's
    order: the grammar's allowed tokens (`allowed`: rows among these R and their masks),
    logit shaping's masks, min_tokens', bias and penalties, temperature, the filters."""
    masked = logits if allowed is None else mask_disallowed(logits, *allowed)
    if shaping is not None:
        masked = apply_masks(masked, shaping, in_place=masked is not logits)
    masked = mask_min_tokens(masked, rows, eos_token_ids)
    if shaping is not None:
        masked = apply_bias_and_penalties(masked, shaping, in_place=masked is not logits)
    params = [r.sampling_params for r in rows]
    temps = torch.tensor([min(max(p.temperature, 1e-30), _FLOAT32_MAX) for p in params],
                         dtype=torch.float32, device=logits.device)
    scaled = _shift_to_max(masked.float()).div_(temps[:, None])
    return apply_filters(scaled, params).softmax(dim=-1)


def acceptance_generator(seq: ScheduledSeq, row: int, shared: torch.Generator,
                         device: torch.device) -> torch.Generator:
    """The generator of a draft row's acceptance draws: seeded by (seed, output position)
    for a seeded request, else the runner's shared one."""
    seed = seq.sampling_params.seed
    if seed is None:
        return shared
    mixed = ((seed * _SEED_MIX + seq.num_output_tokens + row) ^ _ACCEPT_SALT) % (2**63)
    return torch.Generator(device=device).manual_seed(mixed)


def rows_within(allowed: AllowedTokens | None, first: int, count: int
                ) -> AllowedTokens | None:
    """The masks of rows first .. first + count - 1, renumbered from 0 (None: none masked)."""
    if allowed is None:
        return None
    picked = [(row - first, i) for i, row in enumerate(allowed[0]) if first <= row < first + count]
    if not picked:
        return None
    return [r for r, _ in picked], allowed[1][[i for _, i in picked]]
