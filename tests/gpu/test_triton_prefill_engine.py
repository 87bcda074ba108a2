"""The engine with the Triton prefill attention (SLOTSERVE_PREFILL_ATTENTION=triton): greedy
tokens equal HF transformers' on the same weights, through chunked prefills and prefix-cache
hits (chunks after a cached prefix), and how the setting selects the kernel.

On a GPU: the engine as a user gets it (device="cuda", the setting in the environment). In CI
(no GPU): the same engine on CPU tensors with the kernels in Triton's interpreter, its
KernelSet given by hand as model/kernels.cuda_kernels builds it, decode iterations through
DecodeGraphs replaying eagerly (capture=False), as tests/gpu/test_engine_on_device.py runs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("transformers")

from slotserve import SamplingParams  # noqa: E402
from slotserve.gpu import triton_ops, triton_prefill  # noqa: E402
from slotserve.model import kernels  # noqa: E402
from slotserve.model.kernels import KernelSet  # noqa: E402
from slotserve.runner.decode_graphs import DecodeGraphs  # noqa: E402
from tests.conftest import random_prompts, tiny_hf_model, tiny_llm  # noqa: E402

BLOCK_SIZE = 8


def hf_greedy(model, prompt: list[int], max_new: int, device: torch.device) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow  # ~30 s of CPU in the interpreter
def test_greedy_with_the_triton_prefill_matches_hf(device, monkeypatch):
    hf = tiny_hf_model("llama")
    settings = dict(block_size=BLOCK_SIZE, num_blocks=128, max_num_seqs=4,
                    max_num_batched_tokens=24, enable_prefix_caching=True)
    if device.type == "cuda":
        monkeypatch.setenv(kernels.PREFILL_ATTENTION_ENV, "triton")
        llm = tiny_llm(hf, device="cuda", dtype="float32", **settings)
    else:  # as test_engine_on_device's: decodes through DecodeGraphs replaying eagerly
        llm = tiny_llm(hf, kernel_set=KernelSet(ops=triton_prefill.WITH_PREFILL,
                                                fused_layers=True), **settings)
        runner = llm.engine.runner
        runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_caches, BLOCK_SIZE,
                                            settings["max_num_seqs"], 512 // BLOCK_SIZE,
                                            runner.device, capture=False)
    assert llm.engine.runner.kernels.ops is triton_prefill.WITH_PREFILL
    launches = []
    kernel = triton_prefill.paged_prefill_attention
    monkeypatch.setattr(triton_prefill, "paged_prefill_attention",
                        lambda *args, **kw: launches.append(args[3]) or kernel(*args, **kw))
    # prompts over a budget of 24 tokens: chunked, beside each other's chunks and decodes;
    # the second round shares the first's 20-token prefix (two cached blocks: chunks after
    # a cached prefix)
    prompts = random_prompts(3, min_len=9, max_len=40, seed=11)
    prefix = (prompts[0] * 3)[:20]
    rounds = [prompts, [prefix + p[:7] for p in prompts[1:]] + [prefix + [5]]]
    new = 6
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    hf = hf.to(device)
    for batch in rounds:
        outputs = llm.generate(batch, params)
        for prompt, out in zip(batch, outputs):
            assert out.token_ids == hf_greedy(hf, prompt, new, device)
    assert llm.engine.snapshot().prefix_cache_hits >= 3 * 16  # 2 blocks each of round 2
    # one launch a layer (3) for all of an iteration's chunks, some with several chunks
    assert launches and len(launches) % 3 == 0
    assert max(batch.num_seqs for batch in launches) >= 2
    assert any(int(batch.seqs[:, 2].min()) > 0 for batch in launches)  # after a prefix
    llm.engine.check_integrity()


def test_the_setting_selects_the_prefill_kernel(monkeypatch):
    monkeypatch.delenv(kernels.PREFILL_ATTENTION_ENV, raising=False)
    assert kernels.prefill_attention_setting() == "sdpa"  # the default: unchanged
    assert kernels.with_prefill_attention(triton_ops, "sdpa") is triton_ops
    monkeypatch.setenv(kernels.PREFILL_ATTENTION_ENV, " Triton ")
    assert kernels.prefill_attention_setting() == "triton"
    assert kernels.with_prefill_attention(triton_ops, "triton") is triton_prefill.WITH_PREFILL
    monkeypatch.setenv(kernels.PREFILL_ATTENTION_ENV, "flash")
    with pytest.raises(ValueError, match="SLOTSERVE_PREFILL_ATTENTION='flash': must be one"):
        kernels.prefill_attention_setting()
    with pytest.raises(ValueError, match="SLOTSERVE_PREFILL_ATTENTION"):
        kernels.cuda_kernels("auto", "none", torch.bfloat16)


def test_the_start_up_line_says_which_prefill_attention():
    with_triton = KernelSet(ops=triton_prefill.WITH_PREFILL, fused_layers=True)
    assert "decode and prefill attention" in with_triton.describe_linears()
    assert "prefill" not in KernelSet(ops=triton_ops, fused_layers=True).describe_linears()
