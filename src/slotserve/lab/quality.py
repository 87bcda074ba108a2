"""Greedy agreement of a candidate engine (e.g. int8) with a reference engine (fp32).

Two measures over the reference's greedy continuations of the same prompts:
- teacher-forced: the candidate reads prompt + the reference's tokens in one forward and
  its argmax at each position is compared with the reference's token there (the usual
  "token agreement": one early disagreement does not spoil the rest);
- free-running: both generate greedily on their own; the share of positions with the same
  token (strict: after a first divergence the texts usually part ways).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from slotserve.engine.llm_engine import LLMEngine
from slotserve.sampling import SamplingParams


@dataclass
class Agreement:
    prompts: int
    tokens: int
    teacher_forced: float  # share of positions where the candidate's argmax agrees
    free_running: float  # share of positions with the same token, generating alone
    first_divergence_median: float  # tokens generated before the first difference

    def to_dict(self) -> dict:
        return asdict(self)


def greedy_agreement(reference: LLMEngine, candidate: LLMEngine, prompts: list[list[int]],
                     max_tokens: int) -> Agreement:
    """Compare greedy outputs of two engines on the same prompt token ids."""
    ref_out = greedy_continuations(reference, prompts, max_tokens)
    cand_out = greedy_continuations(candidate, prompts, max_tokens)
    forced_hits = free_hits = total = 0
    first_divergence = []
    for prompt, ref, cand in zip(prompts, ref_out, cand_out):
        predicted = teacher_forced_argmax(candidate, prompt, ref)
        forced_hits += sum(int(p == r) for p, r in zip(predicted, ref))
        free_hits += sum(int(c == r) for c, r in zip(cand, ref))
        total += len(ref)
        first_divergence.append(next((i for i, (c, r) in enumerate(zip(cand, ref)) if c != r),
                                     len(ref)))
    first_divergence.sort()
    return Agreement(len(prompts), total, forced_hits / total, free_hits / total,
                     float(first_divergence[len(first_divergence) // 2]))


def greedy_continuations(engine: LLMEngine, prompts: list[list[int]], max_tokens: int
                         ) -> list[list[int]]:
    """Each prompt's greedy continuation of exactly max_tokens tokens (ignore_eos)."""
    from slotserve.engine.llm import LLM

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in LLM(engine=engine).generate(prompts, params,
                                                                 use_tqdm=False)]


def teacher_forced_agreement(engine: LLMEngine, prompts: list[list[int]],
                             continuations: list[list[int]]) -> float:
    """Share of the continuations' tokens that are the engine's own greedy choice there,
    reading prompt + continuation in one pass each (the teacher-forced measure above)."""
    hits = total = 0
    for prompt, continuation in zip(prompts, continuations):
        predicted = teacher_forced_argmax(engine, prompt, continuation)
        hits += sum(int(p == c) for p, c in zip(predicted, continuation))
        total += len(continuation)
    return hits / total


def teacher_forced_argmax(engine: LLMEngine, prompt: list[int], continuation: list[int]
                          ) -> list[int]:
    """The engine's greedy choice after prompt + continuation[:i], for every i, in one pass
    (`LLMEngine.score`; call it while the engine is idle: it borrows free KV blocks)."""
    logits = engine.score(prompt + continuation[:-1])  # (len(prompt) + len(cont) - 1, V)
    return logits[len(prompt) - 1:].argmax(dim=-1).tolist()
