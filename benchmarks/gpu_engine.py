"""The engine on the GPU (issue 36): HF equality and speed, steps of benchmarks/gpu_check.py.

- `hf_equality`: a random-weight Llama (8 layers, peaked logits) on the engine and in HF
  transformers on the same device: greedy tokens in fp32 (must be identical), and the
  teacher-forced greedy agreement of the engine in bf16 with HF in fp32, beside HF's own
  bf16 against its fp32 (what bf16 costs anyone).
- `engine_speed`: a random-weight model of Llama-3.2-1B's or Llama-3.1-8B's shape in bf16:
  batch-1 TPOT with CUDA graphs and eager, against the bandwidth floor (weight bytes / the
  measured copy bandwidth); then full batches of 64 and 256 slots: output tokens/s, the
  decode step's median time and what it achieves of the copy bandwidth (weights + KV read)
  and of the bf16 matrix rate.
- `prefill_speed`: the same shapes' prefills (prompts of 3072 tokens, chunks of 2048: some
  after a cached chunk, two prompts' chunks in one iteration), prompt tokens/s with the
  prefill attention through SDPA (the default) and through the Triton kernel
  (SLOTSERVE_PREFILL_ATTENTION=triton), and how often the two agree on the first token.
Random weights time like real ones (the same bytes and FLOPs); their tokens mean nothing.

Dry run (`shape="dry"`): a tiny model on CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from slotserve.config import ModelConfig, engine_config
from slotserve.engine.llm_engine import LLMEngine
from slotserve.lab.bench.targets import timed_greedy_run
from slotserve.sampling import SamplingParams

SHAPES = {  # HF config fields of each benchmarked shape
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         vocab_size=128256, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         vocab_size=128256, tie_word_embeddings=False),
    "dry": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                tie_word_embeddings=False),
}
BF16_TFLOPS = 790.0  # dense bf16 matmul measured on an H200 here (KINDS.md): the compute roof


def model_config(fields: dict, max_positions: int = 8192) -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(model_type="llama", rms_norm_eps=1e-5,
                                         rope_theta=500000.0, bos_token_id=1, eos_token_id=2,
                                         max_position_embeddings=max_positions, **fields))


def random_weights(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                   std: float = 0.02, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named random weights made on `device` (an 8B model never passes through host
    memory); norms are ones."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

    def rand(*shape):
        return (torch.randn(shape, generator=gen, device=device) * std).to(dtype)

    weights = {"model.embed_tokens.weight": rand(cfg.vocab_size, h),
               "model.norm.weight": torch.ones(h, device=device, dtype=dtype)}
    if not cfg.tie_word_embeddings:
        weights["lm_head.weight"] = rand(cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": torch.ones(h, device=device, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, device=device, dtype=dtype)})
    return weights


def weight_bytes(cfg: ModelConfig, element: int = 2) -> int:
    """Bytes a decode step reads of the weights (the embedding table is looked up, not read;
    a tied LM head reads it once)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    return element * (cfg.num_hidden_layers * per_layer + cfg.vocab_size * h)


def kv_bytes_per_token(cfg: ModelConfig, element: int = 2) -> int:
    return element * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim


def build_engine(cfg: ModelConfig, weights: dict, device: torch.device, dtype: str, *,
                 slots: int, max_model_len: int, eager: bool = False) -> LLMEngine:
    blocks = slots * -(-max_model_len // 16) + 16
    config = engine_config(device=device.type, dtype=dtype, max_num_seqs=slots,
                           max_model_len=max_model_len, num_blocks=blocks, block_size=16,
                           max_num_batched_tokens=max(2048, slots), enforce_eager=eager,
                           enable_prefix_caching=False)
    return LLMEngine(config, cfg, weights)


def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=gen).tolist()


def batch_one(engine: LLMEngine, cfg: ModelConfig, copy_gbps: float | None, prompt_len: int,
              new: int) -> dict:
    """One request alone: the median decode step (TPOT) against the bandwidth floor."""
    timed_greedy_run(engine, random_prompts(1, prompt_len // 2, cfg.vocab_size, seed=1), 8)
    steps = timed_greedy_run(engine, random_prompts(1, prompt_len, cfg.vocab_size, seed=2), new)
    decode = sorted(dt for dt, _ in steps[1:])
    tpot = statistics.median(decode)
    row = {"tpot_ms": 1e3 * tpot, "tpot_p90_ms": 1e3 * decode[int(0.9 * (len(decode) - 1))],
           "decode_steps": len(decode)}
    graphs = engine.runner.decode_graphs
    if graphs is not None:  # the GPU's part of the step: the batch-1 graph replayed alone
        row["graph_replay_ms"] = replay_ms(graphs.graphs[1])
    if copy_gbps:
        floor = weight_bytes(cfg) / (copy_gbps * 1e9)
        row.update(floor_ms=1e3 * floor, tpot_over_floor=tpot / floor)
        if graphs is not None:
            row["replay_over_floor"] = row["graph_replay_ms"] / row["floor_ms"]
    return row


def replay_ms(graph, repeats: int = 50) -> float:
    """Median milliseconds of one replay of a captured graph (CUDA events, after 5 warm)."""
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def full_batches(engine: LLMEngine, cfg: ModelConfig, slots: int, prompt_len: int, new: int,
                 copy_gbps: float | None) -> dict:
    """`slots` requests at once: tokens/s over the run, and the steps with every slot
    decoding."""
    prompts = random_prompts(slots, prompt_len, cfg.vocab_size, seed=slots)
    start = time.perf_counter()
    steps = timed_greedy_run(engine, prompts, new)
    wall = time.perf_counter() - start
    full = sorted(dt for dt, n in steps if n == slots)
    row = {"slots": slots, "prompt": prompt_len, "new_tokens": new, "wall_s": wall,
           "output_tok_per_s": slots * new / wall, "steps": len(steps), "full_steps": len(full)}
    if full:
        step = statistics.median(full)
        context = prompt_len + new / 2  # the mean context of a decode step
        read = weight_bytes(cfg) + slots * context * kv_bytes_per_token(cfg)
        flops = 2 * (weight_bytes(cfg) // 2) * slots  # 2 FLOPs per bf16 weight and token
        row.update(step_ms=1e3 * step, decode_tok_per_s=slots / step,
                   compute_share=flops / step / (BF16_TFLOPS * 1e12))
        if copy_gbps:
            row["bandwidth_share"] = read / step / (copy_gbps * 1e9)
    graphs = engine.runner.decode_graphs
    if graphs is not None and slots in graphs.graphs:
        # NOTE: replays the last step's inputs: its sequences are finished and the prefix
        # cache is off, so the K/V it writes again lands in free blocks
        row["graph_replay_ms"] = replay_ms(graphs.graphs[slots])
    return row


def engine_speed(shape: str, device: torch.device, copy_gbps: float | None,
                 slot_counts=(64, 256), profile: bool = False) -> dict:
    """Batch-1 TPOT with CUDA graphs and eager; full batches at `slot_counts` slots (graphs);
    with `profile`, the kernels of one batch-1 decode forward (torch.profiler, eager)."""
    dry = shape == "dry"
    cfg = model_config(SHAPES[shape])
    weights = random_weights(cfg, device, torch.bfloat16)
    new, prompt_len = (6, 8) if dry else (128, 256)
    result = {"shape": shape, "weight_gb": weight_bytes(cfg) / 1e9,
              "params_b": sum(w.numel() for w in weights.values()) / 1e9}
    for eager in (False, True):
        engine = build_engine(cfg, weights, device, "bfloat16", slots=max(slot_counts),
                              max_model_len=prompt_len + new + 16, eager=eager)
        result["eager" if eager else "graphs"] = row = {"kernels": engine.runner.kernels.describe(),
                              "batch_1": batch_one(engine, cfg, copy_gbps, prompt_len, new)}
        if not eager:
            row["full"] = [full_batches(engine, cfg, slots, prompt_len, new, copy_gbps)
                           for slots in slot_counts]
            if profile and engine.runner.decode_graphs is not None:
                row["profile_batch_1"] = profile_forward(engine.runner.decode_graphs)
        del engine
        _free(device)
    return result


def prefill_speed(shape: str, device: torch.device, prompts: int = 8,
                  prompt_len: int = 3072) -> dict:
    """Prompt tokens/s of `prompts` prefills (max_tokens=1, eager) with each prefill
    attention (model/kernels.PREFILL_ATTENTION_ENV), after one warm-up run of each."""
    from slotserve.model.kernels import PREFILL_ATTENTION_ENV

    if shape == "dry":
        prompts, prompt_len = 2, 24
    cfg = model_config(SHAPES[shape])
    weights = random_weights(cfg, device, torch.bfloat16)
    batch = random_prompts(prompts, prompt_len, cfg.vocab_size, seed=3)
    result = {"shape": shape, "prompts": prompts, "prompt_len": prompt_len}
    before = os.environ.get(PREFILL_ATTENTION_ENV)
    first_tokens = {}
    try:
        for setting in ("sdpa", "triton"):
            os.environ[PREFILL_ATTENTION_ENV] = setting
            engine = build_engine(cfg, weights, device, "bfloat16", slots=prompts,
                                  max_model_len=prompt_len + 16, eager=True)
            _prefills(engine, batch[:2])  # compiles the kernels at these shapes
            wall, first_tokens[setting] = _prefills(engine, batch)
            result[setting] = {"kernels": engine.runner.kernels.describe(), "wall_s": wall,
                               "prompt_tok_per_s": prompts * prompt_len / wall}
            del engine
            _free(device)
    finally:
        if before is None:
            os.environ.pop(PREFILL_ATTENTION_ENV, None)
        else:
            os.environ[PREFILL_ATTENTION_ENV] = before
    same = sum(a == b for a, b in zip(first_tokens["sdpa"], first_tokens["triton"]))
    result["first_token_agreement"] = same / prompts  # bf16, random weights: near ties
    result["triton_speedup"] = result["sdpa"]["wall_s"] / result["triton"]["wall_s"]
    return result


def _prefills(engine: LLMEngine, prompts: list[list[int]]) -> tuple[float, list[int]]:
    """(wall seconds, each prompt's greedy first token) of running the prompts to one token."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ids = [f"prefill-{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    first = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                first[out.request_id] = out.token_ids[0]
    return time.perf_counter() - start, [first[i] for i in ids]


def profile_forward(graphs, repeats: int = 5) -> str:
    """The CUDA kernels of the batch-1 decode forward run eagerly (the graph's kernels), as
    torch.profiler's table (per call: divide by `repeats`)."""
    from torch.profiler import ProfilerActivity, profile

    graphs._run(1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            graphs._run(1)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                     max_name_column_width=60)


def hf_equality(device: torch.device, dry: bool = False) -> dict:
    """fp32 greedy tokens identical to HF's; bf16 teacher-forced agreement (module doc)."""
    import transformers

    from slotserve.lab.quality import teacher_forced_agreement

    fields = dict(SHAPES["dry"]) if dry else dict(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, vocab_size=4096, tie_word_embeddings=False)
    cfg = model_config(fields, max_positions=1024)
    weights = random_weights(cfg, torch.device("cpu"), torch.float32, std=0.06)
    hf_cfg = transformers.LlamaConfig(rms_norm_eps=1e-5, rope_theta=500000.0,
                                      max_position_embeddings=1024, **fields)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.load_state_dict(weights, strict=False)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    hf = hf.to(device)
    prompts = random_prompts(4 if dry else 16, 24 if dry else 96, cfg.vocab_size, seed=5)
    new = 6 if dry else 48
    reference = [_hf_greedy(hf, p, new, device) for p in prompts]
    fp32 = build_engine(cfg, weights, device, "float32", slots=8, max_model_len=256)
    outputs = _greedy(fp32, prompts, new)
    identical = sum(int(o == r) for o, r in zip(outputs, reference))
    del fp32
    bf16 = build_engine(cfg, weights, device, "bfloat16", slots=8, max_model_len=256)
    ours = teacher_forced_agreement(bf16, prompts, reference)
    hf_bf16 = _hf_teacher_forced(hf.to(torch.bfloat16), prompts, reference, device)
    return {"prompts": len(prompts), "new_tokens": new,
            "fp32_identical_sequences": identical,
            "bf16_teacher_forced_agreement": ours,
            "hf_bf16_teacher_forced_agreement": hf_bf16}


def _greedy(engine: LLMEngine, prompts: list[list[int]], new: int) -> list[list[int]]:
    from slotserve.engine.llm import LLM

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in LLM(engine=engine).generate(prompts, params, use_tqdm=False)]


@torch.no_grad()
def _hf_greedy(hf, prompt: list[int], new: int, device: torch.device) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def _hf_teacher_forced(hf, prompts, continuations, device) -> float:
    hits = total = 0
    for prompt, cont in zip(prompts, continuations):
        ids = torch.tensor([prompt + cont[:-1]], device=device)
        predicted = hf(ids).logits[0, len(prompt) - 1:].argmax(-1).tolist()
        hits += sum(int(p == c) for p, c in zip(predicted, cont))
        total += len(cont)
    return hits / total


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


REAL_QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.",
    "Write one sentence about the sea.", "How many legs does a spider have?",
    "What is 12 times 12?", "Give me a synonym for happy.",
    "What language is spoken in Brazil?", "Describe a cat in five words.",
    "What is the boiling point of water in Celsius?", "List two planets.",
    "Who wrote Romeo and Juliet?", "What color is the sky on a clear day?",
    "Translate 'thank you' into Spanish.", "What is the opposite of cold?",
    "Name a fruit that is yellow.", "Why do leaves change color in autumn?",
]


def real_model_equality(path: str, device: torch.device, prompts: int = 16,
                        new: int = 32) -> dict:
    """A real model (a .gguf, e.g. the embedded SmolLM2) on the engine and in HF transformers
    (its own load of the same file) on `device`: fp32 greedy continuations (identical, or
    the first difference a near-tie: HF's token in our top 5), and the bf16 engine's
    teacher-forced agreement with HF fp32 beside HF bf16's."""
    import os

    import transformers

    from slotserve.lab.quality import teacher_forced_agreement

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    hf = hf.eval().to(device)
    fp32 = LLMEngine.from_config(engine_config(model=path, device=device.type,
                                               dtype="float32", max_num_seqs=16))
    tok = fp32.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}],
                                              add_generation_prompt=True))
           for q in REAL_QUESTIONS[:prompts]]
    reference = [_hf_greedy(hf, p, new, device) for p in ids]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, logprobs=5)
    from slotserve.engine.llm import LLM

    outputs = LLM(engine=fp32).generate(ids, params, use_tqdm=False)
    identical, near_ties = 0, 0
    for out, ref in zip(outputs, reference):
        first = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b), None)
        identical += first is None
        near_ties += first is not None and ref[first] in out.outputs[0].logprobs[first]
    answer = tok.decode(outputs[0].token_ids)
    del fp32
    _free(device)
    bf16 = LLMEngine.from_config(engine_config(model=path, device=device.type,
                                               dtype="bfloat16", max_num_seqs=16))
    ours = teacher_forced_agreement(bf16, ids, reference)
    hf_bf16 = _hf_teacher_forced(hf.to(torch.bfloat16), ids, reference, device)
    return {"model": os.path.basename(path), "prompts": len(ids), "new_tokens": new,
            "fp32_identical_sequences": identical, "fp32_first_difference_near_tie": near_ties,
            "first_answer": answer, "bf16_teacher_forced_agreement": ours,
            "hf_bf16_teacher_forced_agreement": hf_bf16}
