"""The engine on the Triton kernels, decode iterations through DecodeGraphs: greedy tokens
equal HF transformers' on the same weights.

On a GPU: the engine as a user gets it (device="cuda", kernels auto: the Triton kernels,
CUDA graphs captured at start) against HF on CUDA. In CI (no GPU): the same engine on CPU
tensors with the Triton kernels in the interpreter and DecodeGraphs replaying eagerly
(capture=False), so the padded, one-copy decode path runs there too.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("transformers")

from slotserve import SamplingParams  # noqa: E402
from slotserve.config import SlotKind  # noqa: E402
from slotserve.core.outputs import ScheduledSeq  # noqa: E402
from slotserve.gpu import triton_ops  # noqa: E402
from slotserve.model.kernels import KernelSet  # noqa: E402
from slotserve.runner.decode_graphs import DecodeGraphs, batch_sizes  # noqa: E402
from tests.conftest import random_prompts, tiny_hf_model, tiny_llm  # noqa: E402

BLOCK_SIZE = 8


def device_llm(hf, device: torch.device, **kwargs):
    """The engine on `device` as the tests run it (see the module docstring)."""
    if device.type == "cuda":
        llm = tiny_llm(hf, device="cuda", dtype="float32", block_size=BLOCK_SIZE,
                       num_blocks=128, **kwargs)
        assert llm.engine.runner.kernels.ops is triton_ops
        assert llm.engine.runner.decode_graphs is not None
        return llm
    llm = tiny_llm(hf, block_size=BLOCK_SIZE, num_blocks=128,
                   kernel_set=KernelSet(ops=triton_ops, fused_layers=True), **kwargs)
    runner = llm.engine.runner
    assert not runner.short_chunks_as_rows  # the C++ CPU kernels' rule, not the Triton ones'
    runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_caches, BLOCK_SIZE,
                                        llm.engine.scheduler_config.max_num_seqs,
                                        512 // BLOCK_SIZE, runner.device, capture=False)
    return llm


def hf_greedy(model, prompt: list[int], max_new: int, device: torch.device) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_batch_sizes_cover_every_batch_up_to_the_largest():
    assert batch_sizes(1) == [1]
    assert batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert batch_sizes(256)[-1] == 256 and 255 <= max(b for b in batch_sizes(256) if b < 256) * 2


@pytest.mark.slow  # ~20 s of CPU in the interpreter
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_on_the_device_matches_hf(kind, device):
    hf = tiny_hf_model(kind)
    # 5 prompts: 5 decodes pad to the graph of 8; the shorter prompts' decodes run beside the
    # longer ones' prefills first (eager), then alone (the graphs)
    prompts = random_prompts(5, min_len=3, max_len=30, seed=7)
    new = 12 if device.type == "cpu" else 24
    llm = device_llm(hf, device, max_num_seqs=8)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0,
                                                   ignore_eos=True))
    hf = hf.to(device)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(hf, prompt, new, device)
    llm.engine.check_integrity()


@pytest.mark.slow  # ~10 s of CPU in the interpreter
def test_a_padded_decode_batch_equals_the_eager_forward(device):
    """3 decodes through DecodeGraphs (padded to 4: padding rows write no K/V) against the
    model's own forward over the same metadata, then the same step again: the cache holds
    exactly one copy of each token's K/V."""
    hf = tiny_hf_model("llama")
    llm = device_llm(hf, device)
    runner = llm.engine.runner
    graphs = runner.decode_graphs
    params = SamplingParams(temperature=0.0)
    tables = [[3, 4], [5], [6, 7, 9]]
    lengths = [11, 5, 17]  # contexts after the new token; prompt tokens never written: zeros
    seqs = [ScheduledSeq(f"r{i}", [10 + i], lengths[i] - 1, tables[i], True, params, 0,
                         SlotKind.DECODE) for i in range(3)]
    assert graphs.runs(seqs)
    before = [k.clone() for k, _ in runner.kv_caches]
    hidden = graphs.forward(seqs).clone()  # (3, H)
    written = [(k != b).any(dim=(1, 2, 3)).nonzero().flatten().tolist()
               for (k, _), b in zip(runner.kv_caches, before)]
    assert all(blocks == [4, 5, 9] for blocks in written)  # each row's last block, no other
    plan = type("Plan", (), {"seqs": seqs})()
    runner.decode_graphs = None
    try:
        expected, rows = runner._forward(plan)
    finally:
        runner.decode_graphs = graphs
    assert rows.tolist() == [0, 1, 2]
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-4)


def test_a_prefill_or_a_too_long_table_does_not_take_the_graphs():
    graphs = DecodeGraphs.__new__(DecodeGraphs)  # runs() reads the sizes only
    graphs.rows, graphs.tables_width = 4, 2
    params = SamplingParams()

    def seq(tokens, start, table):
        return ScheduledSeq("r", tokens, start, table, True, params, 0, SlotKind.DECODE)

    assert graphs.runs([seq([1], 3, [0])])
    assert not graphs.runs([seq([1, 2], 3, [0])])  # two new tokens: a prefill chunk
    assert not graphs.runs([seq([1], 0, [0])])  # a first token
    assert not graphs.runs([seq([1], 20, [0, 1, 2])])  # wider than the captured tables
    assert not graphs.runs([seq([1], 3, [0])] * 5)  # more than the largest size
    assert not graphs.runs([])
