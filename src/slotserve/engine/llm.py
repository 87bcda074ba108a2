"""The offline API: `LLM().generate(prompts, params)` runs a whole batch to completion."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

# NOTE: engine_config lives in slotserve.config; re-exported here for older imports.
from slotserve.config import engine_config
from slotserve.engine.llm_engine import LLMEngine, Prompt
from slotserve.engine.outputs import RequestOutput
from slotserve.sampling import SamplingParams

__all__ = ["LLM", "engine_config"]


# The chat template's arguments LLM.chat sets itself (chat_template_kwargs may not).
CHAT_TEMPLATE_RESERVED = frozenset({"messages", "add_generation_prompt", "chat_template"})


class LLM:
    """Offline generation. With no model named, the embedded SmolLM2-135M-Instruct.

    >>> llm = LLM()
    >>> out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    >>> out[0].text, out[0].finish_reason, out[0].metrics.ttft
    """

    def __init__(self, model: str | None = None, *, engine: LLMEngine | None = None,
                 **kwargs) -> None:
        self.engine = engine or LLMEngine.from_config(engine_config(model, **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, trace: str | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order.

        prompts: a string, a list of token ids, or a list of either.
        trace: write the iteration trace of this run to this JSON path.
        """
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        if trace is not None:
            self.engine.trace.clear()
        ids = self._add_all(prompts, params)
        expected = {i: p.n for i, p in zip(ids, params)}
        results = self._run(expected, use_tqdm if use_tqdm is not None else len(prompts) >= 32)
        if trace is not None:
            self.engine.trace.save(trace)
        return [results[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, *,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             **kwargs) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the chat template.

        chat_template: a Jinja template used instead of the model's (the server's
        `--chat-template`); chat_template_kwargs: extra template variables, e.g. Qwen3's
        `{"enable_thinking": False}` (as vLLM's LLM.chat takes them).
        """
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer and no chat template")
        extra = dict(chat_template_kwargs or {})
        reserved = sorted(set(extra) & CHAT_TEMPLATE_RESERVED)
        if reserved:
            raise ValueError(f"chat_template_kwargs: {reserved[0]!r} is set by LLM.chat")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        # NOTE: the server's chat path uses the same encode_chat (BOS only as the template
        # writes it), so both give the same prompt ids.
        prompts = [self.tokenizer.encode_chat(c, add_generation_prompt=True,
                                              chat_template=chat_template, **extra)
                   for c in conversations]
        return self.generate(prompts, sampling_params, **kwargs)

    def _add_all(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[str]:
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, p)
                ids.append(request_id)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            self.engine.step()  # drain the abort outputs
            raise
        return ids

    def _run(self, expected: dict[str, int], use_tqdm: bool) -> dict[str, RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(expected)) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if not out.outputs[0].finished:
                    continue
                merged = self._collect(results, out)
                if bar and len(merged.outputs) == expected[out.request_id]:
                    bar.update(1)
        if bar:
            bar.close()
        return results

    @staticmethod
    def _collect(results: dict[str, RequestOutput], out: RequestOutput) -> RequestOutput:
        """Merge a finished completion into its request's output."""
        merged = results.setdefault(out.request_id, RequestOutput(
            out.request_id, out.prompt, out.prompt_token_ids, [], out.error))
        merged.outputs.append(out.outputs[0])
        if out.outputs[0].index == 0:  # NOTE: the prompt counts once, as choice 0 found it
            merged.num_cached_tokens = out.num_cached_tokens
        merged.outputs.sort(key=lambda o: o.index)
        merged.error = merged.error or out.error
        merged.error_kind = merged.error_kind or out.error_kind
        return merged


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    if not prompts:
        raise ValueError("prompts must not be empty")
    return prompts


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"sampling_params: {len(params)} given for {count} prompts")
    return params


def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)
