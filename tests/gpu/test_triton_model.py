"""The Triton kernels in a whole model: a tiny random Llama (GQA, 3 layers) whose norms,
RoPE, K/V writes, SiLU and decode attention run through slotserve.gpu.triton_ops as its
layer ops (the fused CPU kernels' interface; KernelSet(ops=triton_ops, fused_layers=True)),
against the same model on torch's ops: a chunked prefill of two prompts, then greedy decodes.

NOTE: nothing in the engine selects these kernels yet (issue 36, item 1); this test builds the
ModelRunner with them by hand. On a GPU it runs the model on CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("transformers")

from slotserve.attention.metadata import build_metadata  # noqa: E402
from slotserve.config import CacheConfig, ModelConfig, SlotKind  # noqa: E402
from slotserve.core.outputs import ScheduledSeq  # noqa: E402
from slotserve.gpu import triton_ops  # noqa: E402
from slotserve.model.kernels import KernelSet  # noqa: E402
from slotserve.runner.model_runner import ModelRunner  # noqa: E402
from slotserve.sampling import SamplingParams  # noqa: E402
from tests.conftest import tiny_hf_model  # noqa: E402

BLOCK_SIZE = 8


def make_runner(hf, kernels: KernelSet, device: torch.device) -> ModelRunner:
    cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return ModelRunner(cfg, weights, CacheConfig(block_size=BLOCK_SIZE), num_blocks=24,
                       device=device.type, dtype="float32", kernels=kernels)


def forward(runner: ModelRunner, seqs: list[ScheduledSeq]) -> torch.Tensor:
    """One iteration as ModelRunner.execute runs it, up to the logits of each sequence's
    last new token (S, V)."""
    device = runner.device
    meta = build_metadata(seqs, BLOCK_SIZE, device, group_decodes=not runner.fused_cpu_ops)
    ids = torch.tensor([t for s in seqs for t in s.token_ids], device=device)
    positions = torch.tensor([p for s in seqs for p in range(s.start_pos, s.context_len)],
                             device=device)
    last = torch.cumsum(torch.tensor([s.num_tokens for s in seqs]), 0) - 1
    hidden = runner.model(ids, positions, runner.kv_caches, meta)
    return runner.model.compute_logits(hidden[last.to(device)])


@pytest.mark.slow  # ~10 s of CPU in the interpreter (transformers' import included)
def test_a_model_on_the_triton_kernels_equals_it_on_torch_ops(device):
    hf = tiny_hf_model()
    triton_kernels = KernelSet(ops=triton_ops, fused_layers=True)
    runners = [make_runner(hf, triton_kernels, device), make_runner(hf, KernelSet(), device)]
    assert runners[0].fused_cpu_ops and runners[0].model.layers[0].mlp.ops is triton_ops
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (21, 9)]
    tables = [[0, 5, 6, 7, 8, 9], [10, 11, 12, 13]]
    params = SamplingParams(temperature=0.0)

    def seq(i, tokens, start, kind):
        return ScheduledSeq(f"r{i}", tokens, start, tables[i], True, params, 0, kind)

    steps = [  # a chunked prefill of prompt 0 beside all of prompt 1, then its rest
        [seq(0, prompts[0][:12], 0, SlotKind.PREFILL), seq(1, prompts[1], 0, SlotKind.PREFILL)],
        [seq(0, prompts[0][12:], 12, SlotKind.PREFILL)]]
    first = []  # the logits each prompt's last token gave
    for step in steps:
        logits = [forward(r, step) for r in runners]
        torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
        first.append(logits[1])
    next_tokens = [int(first[1][0].argmax()), int(first[0][1].argmax())]
    lengths = [len(p) for p in prompts]
    for _ in range(4):  # greedy decodes of both, across block ends (at 24 and 12 -> 16)
        step = [seq(i, [next_tokens[i]], lengths[i], SlotKind.DECODE) for i in range(2)]
        logits = [forward(r, step) for r in runners]
        torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
        assert logits[0].argmax(-1).tolist() == logits[1].argmax(-1).tolist()
        next_tokens = logits[1].argmax(-1).tolist()
        lengths = [n + 1 for n in lengths]
