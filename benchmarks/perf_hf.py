"""benchmarks.perf's HF transformers baselines (`--hf`): `generate` in static batches, and
HF's own continuous batching, on slotserve's weights and workload W's prompts."""

from __future__ import annotations

import sys
import time

import torch

from slotserve.lab.bench import EngineTarget
from slotserve.lab.workload import Workload


def hf_static_run(target: EngineTarget, workload: Workload, batch: int = 16) -> dict:
    """HF transformers `generate` in static batches (the tutorials' baseline).

    Each batch is left-padded and runs until its longest request is done; only the tokens
    each request asked for count as output.
    """
    import transformers

    model, prompts, lengths = _hf_inputs(target, workload)
    print(f"running HF transformers static batches of {batch} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ids, mask = _left_pad(prompts[i:i + batch], pad=0)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, do_sample=False,
                           max_new_tokens=max(lengths[i:i + batch]), min_new_tokens=1,
                           eos_token_id=None, pad_token_id=0)
    duration = time.perf_counter() - start
    return {"label": f"HF transformers {transformers.__version__} static batches of {batch}",
            "duration_s": duration, "output_throughput": sum(lengths) / duration,
            "completed": len(prompts)}


def hf_continuous_run(target: EngineTarget, workload: Workload) -> dict:
    """HF transformers' own continuous batching (`init_continuous_batching`'s manager), each
    request with its own max_new_tokens; the issue asks for it "if it runs"."""
    import transformers
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model, prompts, lengths = _hf_inputs(target, workload)
    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                              max_new_tokens=max(lengths))
    hints = WorkloadHints(max_prompt_length=max(map(len, prompts)),
                          max_generated_length=max(lengths), num_requests=len(prompts))
    print("running HF transformers continuous batching ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    generated = 0
    with model.continuous_batching_context_manager(generation_config=config, block=True,
                                                   timeout=5, warmup=False,
                                                   workload_hints=hints) as manager:
        for i, (prompt, n) in enumerate(zip(prompts, lengths)):
            manager.add_request(prompt, request_id=f"w{i}", max_new_tokens=n)
        finished = 0
        while finished < len(prompts):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                finished += 1
                generated += len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("HF continuous batching stopped before the end")
    duration = time.perf_counter() - start
    return {"label": f"HF transformers {transformers.__version__} continuous batching",
            "duration_s": duration, "output_throughput": generated / duration,
            "completed": finished, "generated_tokens": generated}


def _hf_inputs(target: EngineTarget, workload: Workload) -> tuple:
    """HF's model on slotserve's weights, the workload's prompt ids and each request's
    output length."""
    return (_hf_model(target).eval(), workload.chat_prompt_ids(target.tokenizer),
            [r.max_tokens for r in workload.requests])


def _hf_model(target: EngineTarget):
    import transformers

    c = target.model_config
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, eos_token_id=None)
    model = transformers.LlamaForCausalLM(cfg)
    model.load_state_dict(target.weights, strict=False)
    if c.tie_word_embeddings:
        model.tie_weights()
    return model


def _left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask
