"""A Mistral-style model (the same sliding window on every layer) frees the KV blocks no
layer reads again, and still gives HF transformers' greedy tokens on the fp32 path: long
prompts and long outputs, whole and chunked prefill, preemption, prefix-cache hits, the fused
kernels and the torch paths; a long request holds a number of blocks bounded by the window,
not by its length. A Gemma-3-style model (sliding and global layers) frees nothing."""

from __future__ import annotations

import math

import pytest
import torch

from slotserve import SamplingParams
from slotserve.engine.llm_engine import LLMEngine
from slotserve.layer_windows import uniform_window
from tests.conftest import HAS_CXX, random_prompts, tiny_engine
from tests.model.test_vs_hf import hf_greedy

WINDOW = 8
BLOCK_SIZE = 4
NEW_TOKENS = 40
# Between steps a decoding request holds its window's blocks, one more where not aligned.
DECODE_BOUND = math.ceil(WINDOW / BLOCK_SIZE) + 1
PROMPTS = random_prompts(5, min_len=30, max_len=90, seed=41)
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def tiny_model(model_type: str, seed: int):
    """A small random MistralForCausalLM (window 8 on all 3 layers) or Gemma3ForCausalLM
    text model (layers 0 and 2 slide, layer 1 global)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  sliding_window=WINDOW)
    if model_type == "gemma3_text":
        common.update(head_dim=16, query_pre_attn_scalar=16, rope_theta=10000.0,
                      rope_local_base_freq=1000.0,
                      layer_types=["sliding_attention", "full_attention",
                                   "sliding_attention"])
    cfg = transformers.AutoConfig.for_model(model_type, **common)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model.eval()


@pytest.fixture(scope="module")
def mistral():
    model = tiny_model("mistral", seed=42)
    return model, [hf_greedy(model, prompt, NEW_TOKENS) for prompt in PROMPTS]


def window_engine(hf_model, **kwargs) -> LLMEngine:
    """tiny_engine, its KV manager freeing by the model's uniform window.

    NOTE: set here in case LLMEngine does not pass `uniform_window(sliding_windows)` to its
    KVCacheManager itself (setting the same window again changes nothing).
    """
    engine = tiny_engine(hf_model, block_size=BLOCK_SIZE, **kwargs)
    engine.kv.set_sliding_window(uniform_window(engine.model_config.sliding_windows))
    return engine


def generate(engine: LLMEngine, prompts, on_step=None) -> list[list[int]]:
    """Greedy tokens of each prompt, stepping the engine (check_integrity and on_step(engine)
    after every step)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        engine.check_integrity()
        if on_step is not None:
            on_step(engine)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return [tokens[f"r{i}"] for i in range(len(prompts))]


class BlockWatch:
    """on_step: the most blocks any decoding request held, and whether any were freed."""

    def __init__(self) -> None:
        self.decode_peak = 0
        self.freed = 0

    def __call__(self, engine: LLMEngine) -> None:
        for request in engine.scheduler.running:
            rid = request.request_id
            self.freed = max(self.freed, engine.kv.num_freed_blocks(rid))
            if request.output_token_ids and rid in engine.kv.block_tables:
                self.decode_peak = max(self.decode_peak, len(engine.kv.block_tables[rid]))


def test_the_window_changes_hf_tokens(mistral):
    """Otherwise equality below would prove nothing: full attention gives other tokens."""
    model, hf_tokens = mistral
    model.config.sliding_window = None
    try:
        full = [hf_greedy(model, prompt, NEW_TOKENS) for prompt in PROMPTS]
    finally:
        model.config.sliding_window = WINDOW
    assert sum(a != b for a, b in zip(full, hf_tokens)) >= 3


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("budget", [512, 6], ids=["whole-prefill", "chunked-prefill"])
def test_long_generations_free_blocks_and_match_hf(mistral, kernels, budget):
    """auto: the fused decode kernel and the decode stack read the window of tables whose
    first entries are freed; reference: torch's paths."""
    model, hf_tokens = mistral
    engine = window_engine(model, num_blocks=128, kernels=kernels,
                           max_num_batched_tokens=budget)
    assert engine.kv.sliding_window == WINDOW
    if kernels == "auto" and HAS_CXX:
        assert engine.runner.model.decode_stack is not None
    watch = BlockWatch()
    assert generate(engine, PROMPTS, watch) == hf_tokens
    # 90 + 40 tokens would need 33 blocks: a decoding request holds 3
    assert 0 < watch.decode_peak <= DECODE_BOUND
    assert watch.freed >= (max(map(len, PROMPTS)) + NEW_TOKENS - WINDOW) // BLOCK_SIZE - 1


def test_the_live_views_block_map_draws_freed_blocks_free(mistral):
    """The snapshot's block map (what the live view draws) gives a long request only the
    blocks it holds; the freed ones are free (plain, or cached free with prefix caching)."""
    model, _ = mistral
    engine = window_engine(model, num_blocks=64, kernels="auto", enable_prefix_caching=True)
    engine.add_request("long", PROMPTS[0], GREEDY)
    for _ in range(20):
        engine.step()
    snap = engine.snapshot(include_blocks=True)
    block_map = snap.block_map
    assert block_map.owners == ("long",)
    owned = sum(count for _, count, _ in block_map.runs)
    assert owned == len(engine.kv.block_tables["long"]) <= DECODE_BOUND
    freed = engine.kv.num_freed_blocks("long")
    assert freed >= (len(PROMPTS[0]) + 19 - WINDOW) // BLOCK_SIZE - 1
    assert sum(count for _, count in block_map.cached_free) == freed == snap.kv_blocks_cached_free
    assert snap.kv_blocks_free == snap.kv_blocks_total - owned
    engine.abort_request("long")
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_preemption_with_freed_blocks_matches_hf(mistral):
    """A pool of 14 blocks (56 tokens, one whole request) for five 16 + 40-token requests at
    once, which decoding hold 3 blocks each: some are preempted (all their blocks go back)
    and recomputed from position 0, freeing again; HF's tokens still."""
    model, _ = mistral
    prompts = [p[:16] for p in PROMPTS]
    hf_tokens = [hf_greedy(model, prompt, NEW_TOKENS) for prompt in prompts]
    engine = window_engine(model, num_blocks=14, kernels="auto", max_num_batched_tokens=16,
                           max_model_len=56)
    watch = BlockWatch()
    assert generate(engine, prompts, watch) == hf_tokens
    assert engine.scheduler.num_preemptions > 0 and watch.freed > 0


@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_requests_longer_than_the_pool_match_hf(mistral, kernels):
    """A 10-block pool (40 tokens) with an 8-token budget: one request holds at most 5
    blocks at a time, so 70..130-token sequences run (five at once: with preemption)."""
    model, hf_tokens = mistral
    engine = window_engine(model, num_blocks=10, kernels=kernels, max_num_batched_tokens=8)
    assert engine.max_total_tokens == 512  # max_model_len: no longer the pool's 40
    assert generate(engine, PROMPTS) == hf_tokens
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_prefix_hits_over_freed_blocks_match_hf(mistral, kernels):
    """A 42-token system prefix: the first request frees its early blocks (they stay in the
    prefix cache as cached free blocks); the next ones hit its 10 full blocks, freed ones
    included, and read only their windows."""
    model, _ = mistral
    system = random_prompts(1, min_len=42, max_len=42, seed=43)[0]
    prompts = [system + tail for tail in random_prompts(4, min_len=3, max_len=30, seed=44)]
    engine = window_engine(model, num_blocks=64, kernels=kernels, max_num_batched_tokens=12,
                           enable_prefix_caching=True)
    first = generate(engine, prompts[:1])
    assert engine.kv.pool.num_cached_free > 0  # blocks freed before the window, still cached
    rest = generate(engine, prompts[1:])
    assert engine.stats.prefix_cache_hits >= 3 * 40
    for prompt, tokens in zip(prompts, first + rest):
        assert tokens == hf_greedy(model, prompt, NEW_TOKENS)


def test_mixed_windows_free_nothing_and_match_hf():
    """Gemma 3's layers: a global layer reads every position, so no block is freed."""
    model = tiny_model("gemma3_text", seed=45)
    engine = window_engine(model, num_blocks=128, kernels="auto", max_num_batched_tokens=16)
    assert engine.model_config.sliding_windows == (WINDOW, None, WINDOW)
    assert engine.kv.sliding_window is None
    watch = BlockWatch()
    prompts = PROMPTS[:3]
    assert generate(engine, prompts, watch) == [hf_greedy(model, p, NEW_TOKENS)
                                                for p in prompts]
    assert watch.freed == 0
    longest = max(len(p) for p in prompts) + NEW_TOKENS - 1
    assert watch.decode_peak == math.ceil(longest / BLOCK_SIZE)  # every block kept


def test_the_trace_records_the_uniform_window_for_the_replay(mistral):
    """The engine's trace header names the window (the replay frees by it too:
    tests/unit/test_replay_window.py); a model with mixed windows records none."""
    model, _ = mistral
    engine = tiny_engine(model, block_size=BLOCK_SIZE, num_blocks=64)
    assert engine.trace.export()["settings"]["sliding_window"] == WINDOW
    mixed = tiny_engine(tiny_model("gemma3_text", seed=45), block_size=BLOCK_SIZE, num_blocks=64)
    assert "sliding_window" not in mixed.trace.export()["settings"]
