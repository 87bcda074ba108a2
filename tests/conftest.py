"""Shared fixtures: tiny random-weight models built with HF transformers (the oracle)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import settings

from slotserve.config import ModelConfig, engine_config
from slotserve.engine.llm import LLM
from slotserve.engine.llm_engine import LLMEngine

# NOTE: property tests draw the same examples on every run (CI must not go red by chance);
# `HYPOTHESIS_PROFILE=explore make test` draws new ones to hunt for bugs.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

# NOTE: `slotserve calibrate` run by a test must not replace this machine's calibration
# (`slotserve replay`'s default clock): tests read and write their own.
_CALIBRATION_DIR = tempfile.mkdtemp(prefix="slotserve-tests-")
os.environ["SLOTSERVE_CALIBRATION"] = os.path.join(_CALIBRATION_DIR, "calibration.json")
atexit.register(shutil.rmtree, _CALIBRATION_DIR, ignore_errors=True)


def tiny_hf_model(kind: str = "llama", seed: int = 0, tied: bool = False):
    """A small random LlamaForCausalLM (GQA, 2+ layers) or Qwen2ForCausalLM (qkv bias)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=1,
                  eos_token_id=2)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=1e6)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common, rope_theta=10000.0)
        model = transformers.LlamaForCausalLM(cfg)
    # Larger-than-default init so greedy choices are well separated (few near-ties).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model.eval()


def tiny_engine(hf_model, *, kernel_set=None, **kwargs) -> LLMEngine:
    """An LLMEngine on the HF model's weights; kwargs as engine_config's (kernel_set: the
    engine's KernelSet instead of the one they resolve to).

    NOTE: fp32 weights unless asked otherwise (not the default quantization="auto"): these
    engines are compared with HF transformers and with each other to the last bit.
    """
    cfg = ModelConfig.from_hf_dict(hf_model.config.to_dict())
    weights = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    kwargs.setdefault("max_model_len", 512)
    kwargs.setdefault("quantization", "none")
    return LLMEngine(engine_config(**kwargs), cfg, weights, tokenizer=None,
                     kernel_set=kernel_set)


def run_to_end(engine: LLMEngine, requests) -> None:
    """Add (request_id, prompt ids, SamplingParams) to the engine and step until done."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()


def tiny_llm(hf_model, **kwargs) -> LLM:
    return LLM(engine=tiny_engine(hf_model, **kwargs))


def random_prompts(count: int, vocab: int = 512, min_len: int = 3, max_len: int = 70,
                   seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny_hf_model("llama")


@pytest.fixture(scope="session")
def tiny_llama_tied():
    return tiny_hf_model("llama", seed=2, tied=True)


@pytest.fixture(scope="session")
def tiny_qwen2():
    return tiny_hf_model("qwen2", seed=1)


@pytest.fixture(scope="session")
def smollm2_llm():
    """The embedded SmolLM2-135M-Instruct through the offline API (small KV pool), fp32:
    compared with HF transformers."""
    return LLM(num_blocks=256, max_num_seqs=16, quantization="none")


@pytest.fixture(scope="session")
def smollm2_hf():
    """HF transformers' own load of the same .gguf (it dequantizes and un-permutes too)."""
    import os

    import transformers

    from slotserve.loader import default_model_path

    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


# Where a C++ compiler exists, the fused CPU kernels must build (and be used by "auto").
HAS_CXX = shutil.which("c++") is not None


@pytest.fixture(scope="session")
def cpu_ops():
    """The compiled fused CPU kernels; a failed build fails the test where a compiler exists."""
    from slotserve.model.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    if ops is None:
        if not HAS_CXX:
            pytest.skip("no C++ compiler here: the fused CPU kernels cannot be built")
        pytest.fail("the fused CPU kernels did not build (see the logged warning)")
    return ops


@pytest.fixture(scope="session")
def block_ops(cpu_ops):
    """The fused CPU kernels where they run GGUF blocks vectorised (AVX512-VNNI or AVX2)."""
    from slotserve.model.linear_kernels import gguf_block_kernel_available

    if not gguf_block_kernel_available(cpu_ops):
        pytest.skip("the GGUF block kernel is not vectorised here (no AVX512-VNNI or AVX2)")
    return cpu_ops
