"""benchmarks/gpu_check.py's prefill attention timings (step 6) at tiny sizes on the CPU
through Triton's interpreter: the rows the GPU run will write, each Triton result checked
against the torch path."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")


def test_the_prefill_timings_run_in_a_dry_run(device):
    if device.type != "cpu":
        pytest.skip("the dry run is the interpreter's")
    from benchmarks import gpu_check

    rows = gpu_check.prefill_attention_cases(device, gpu_check.Timer(cuda=False),
                                             gpu_check.DRY_PREFILL_CASES)
    assert [(r["shape"], r["chunks"], r["tokens"], r["prefix"]) for r in rows] == \
        gpu_check.DRY_PREFILL_CASES
    for row in rows:
        for name in gpu_check.PREFILL_TILES:
            assert row[f"{name}_rel_error"] < 1e-2  # bf16 against fp32
            assert row[f"{name}_ms"] > 0
        assert row["torch_paged_ms"] > 0 and row["triton_best_tflops"] > 0
    assert "dense_sdpa_ms" in rows[0] and "dense_sdpa_ms" not in rows[1]  # prefix 0 only
    # 2 chunks of 3 after 7: each query i sees 7 + i + 1 keys, 4 heads of 16
    assert rows[1]["attention_flops"] == 4 * 16 * 2 * 4 * (3 * 7 + 6)
    summary = gpu_check.summary({"prefill_attention": rows})
    assert "prefill dry 2 x    3 after    7: triton default" in summary


def test_the_gpu_runs_cases_cover_both_head_shapes_and_prefixes():
    from benchmarks import gpu_check

    cases = gpu_check.PREFILL_CASES
    assert {c[0] for c in cases} == {"llama-3.2-1b", "llama-3.1-8b"}
    assert {(c[2], c[3]) for c in cases if c[1] == 1} == {
        (t, p) for t in (256, 512, 2048) for p in (0, 2048)}
    assert ("llama-3.1-8b", 8, 256, 2048) in cases


def test_the_decode_timings_check_several_blocks_a_step(device):
    if device.type != "cpu":
        pytest.skip("the dry run is the interpreter's")
    from benchmarks import gpu_check

    rows = gpu_check.decode_attention_cases(device, gpu_check.Timer(cuda=False),
                                            gpu_check.DRY_DECODE_CASES, None)
    for row in rows:
        for name in ("triton_w4", "triton_w8", "triton_w8_b2", "triton_w8_b4"):
            assert row[f"{name}_rel_error"] < 1e-2 and row[f"{name}_ms"] > 0  # bf16
    assert "w8 2 blocks" in gpu_check.summary({"decode_attention": rows})


def test_the_engine_prefill_comparison_runs_in_a_dry_run(device):
    """gpu_engine.prefill_speed on the tiny model (on the CPU both settings run torch's
    prefill attention: the setting is the CUDA path's; this checks the script)."""
    if device.type != "cpu":
        pytest.skip("the dry run is the interpreter's")
    from benchmarks import gpu_engine
    from slotserve.model.kernels import PREFILL_ATTENTION_ENV

    before = os.environ.get(PREFILL_ATTENTION_ENV)
    result = gpu_engine.prefill_speed("dry", device)
    assert result["sdpa"]["prompt_tok_per_s"] > 0 and result["triton"]["prompt_tok_per_s"] > 0
    assert result["first_token_agreement"] == 1.0  # the same computation on the CPU
    assert os.environ.get(PREFILL_ATTENTION_ENV) == before  # put back as it was
