"""The fast linear kernels agree with the plain torch reference (layers.Linear)."""

from __future__ import annotations

import pytest
import torch

from slotserve.config import EngineConfig
from slotserve.engine.llm_engine import LLMEngine
from slotserve.model.kernels import resolve_kernels
from slotserve.model.layers import Linear
from slotserve.model.linear_kernels import (
    Bf16PanelLinear,
    Int8WeightOnlyLinear,
    MKLPackedLinear,
    PanelLinear,
    mkl_packed_available,
    panel_kernel_available,
    place_panels_in_one_arena,
)
from tests.conftest import tiny_engine

needs_mkl = pytest.mark.skipif(not mkl_packed_available(), reason="torch built without MKL")


def random_linear(in_features: int, out_features: int, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(in_features, out_features, generator=gen) * 0.05
    b = torch.randn(out_features, generator=gen) if bias else None
    return weight, b


def reference(x, weight, bias):
    y = x.double() @ weight.double()
    return (y if bias is None else y + bias.double()).float()


@needs_mkl
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_mkl_packed_equals_matmul(rows, bias):
    weight, b = random_linear(96, 200, bias)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    out = MKLPackedLinear(weight, b)(x)
    assert out.shape == (rows, 200)
    torch.testing.assert_close(out, reference(x, weight, b), atol=1e-5, rtol=1e-5)


# in 95 and 3: input counts that are no multiple of 16 (the kernel walks inputs one by
# one); out 200: a last panel of 8 outputs (200 = 6 x 32 + 8); 40: one full panel and one
# of 8 (masked stores); 32: exactly one panel. Rows: empty, one tile of 1-12 rows, and 13,
# 64, 130 split into even tiles.
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 13, 64, 130])
@pytest.mark.parametrize("in_features,out_features", [(95, 200), (96, 40), (3, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_equals_matmul(cpu_ops, rows, in_features, out_features, bias):
    weight, b = random_linear(in_features, out_features, bias, seed=in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    out = PanelLinear(weight, b, cpu_ops)(x)
    assert out.shape == (rows, out_features)
    torch.testing.assert_close(out, reference(x, weight, b), atol=1e-5, rtol=1e-5)


def test_panel_linear_rows_do_not_depend_on_the_batch(cpu_ops):
    """A row's output is the same to the last bit alone or in a batch of any size, in any
    tile (the kernel's NOTE): batch invariance needs no tolerance on this path."""
    weight, _ = random_linear(576, 96, False)
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(1))
    kernel = PanelLinear(weight, None, cpu_ops)
    full = kernel(x)
    for rows in (1, 2, 5, 6, 7, 12, 13, 33):
        assert torch.equal(kernel(x[:rows]), full[:rows]), rows
        assert torch.equal(kernel(x[-rows:]), full[-rows:]), rows


def panels_by_torch_ops(weight: torch.Tensor, bf16: bool) -> torch.Tensor:
    """The panel layouts written with torch ops (the packers' first version): (out, in) ->
    fp32 (P, in, 32) / bf16 (P, padded pairs, 64), zero padded."""
    outs, in_features = weight.shape
    panels = -(-outs // 32)
    if not bf16:
        padded = torch.zeros(panels * 32, in_features)
        padded[:outs] = weight
        return padded.view(panels, 32, in_features).transpose(1, 2).contiguous()
    pairs = (-(-in_features // 2) + 15) // 16 * 16
    padded = torch.zeros(panels * 32, 2 * pairs)
    padded[:outs, :in_features] = weight
    return (padded.to(torch.bfloat16).view(panels, 32, pairs, 2).permute(0, 2, 1, 3)
            .contiguous().view(panels, pairs, 64))


# out 1, 31, 33, 200: partial last panels; in 1, 3, 95: odd (a half-empty bf16 pair), 64,
# 576: whole pairs; the weight given contiguous, as a transposed view (a Linear's (in, out)
# parameter, .t()) and with a row stride past its width (a slice).
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
@pytest.mark.parametrize("out_features,in_features",
                         [(1, 1), (31, 3), (33, 95), (200, 64), (96, 576), (40, 301)])
def test_packed_panels_are_the_layout_bit_for_bit(cpu_ops, source, bf16, layout, out_features,
                                                  in_features):
    """A weight of any strides, stored fp32, bf16 or fp16 (widened as it is packed: the
    panels of its fp32 widening), inputs past one packing block (PACK_INPUTS) too."""
    gen = torch.Generator().manual_seed(out_features * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    weight[0, 0] = 1 + 2 ** -8  # a tie: to even (1.0) in bf16
    weight[-1, -1] = -(1 + 3 * 2 ** -8)  # a tie: to even (-(1 + 2^-6))
    weight = weight.to(source)
    given = {"contiguous": weight, "transposed": weight.t().contiguous().t(),
             "sliced": torch.cat([weight, weight], dim=1)[:, :in_features]}[layout]
    assert given.is_contiguous() == (layout == "contiguous" or in_features == 1)
    packed = (cpu_ops.pack_panels_bf16 if bf16 else cpu_ops.pack_panels)(given)
    want = panels_by_torch_ops(weight.float(), bf16)
    assert packed.dtype == want.dtype and packed.shape == want.shape
    assert torch.equal(packed.view(torch.int16) if bf16 else packed,
                       want.view(torch.int16) if bf16 else want)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_panels_pack_into_a_given_part_of_an_arena(cpu_ops, bf16):
    weight = torch.randn(40, 95, generator=torch.Generator().manual_seed(5))
    kernel = Bf16PanelLinear if bf16 else PanelLinear
    shape, dtype = kernel.panels_layout(95, 40)
    pack = cpu_ops.pack_panels_bf16 if bf16 else cpu_ops.pack_panels
    assert pack(weight).shape == shape and pack(weight).dtype == dtype
    arena = torch.full((2 * torch.Size(shape).numel(),), 7, dtype=dtype)
    part = arena[arena.numel() // 2:].view(shape)
    assert pack(weight, part).data_ptr() == part.data_ptr()
    assert torch.equal(part.float(), pack(weight).float())
    assert (arena[:arena.numel() // 2] == 7).all()  # nothing written outside the part
    wrong = [torch.empty(shape[0], shape[1] + 1, shape[2], dtype=dtype),
             torch.empty(shape, dtype=torch.float64),
             torch.empty(shape[::-1], dtype=dtype).permute(2, 1, 0)]  # not contiguous
    for out in wrong:
        with pytest.raises(RuntimeError, match="out must be a contiguous CPU tensor"):
            pack(weight, out)


def test_bf16_packing_keeps_infinities_and_nans(cpu_ops):
    weight = torch.tensor([[float("inf"), float("-inf"), float("nan"),
                            torch.finfo(torch.float32).max]])
    packed = cpu_ops.pack_panels_bf16(weight)[0, :2, :2].reshape(-1).float()
    assert packed[0] == float("inf") and packed[1] == float("-inf")
    assert packed[2].isnan() and packed[3] == float("inf")  # rounds up past bf16's largest


def test_panel_linear_checks_its_inputs(cpu_ops):
    panels = cpu_ops.pack_panels(torch.randn(40, 8))  # 2 panels: 33-64 outputs fit
    with pytest.raises(RuntimeError, match="out_features"):
        cpu_ops.panel_linear(torch.randn(1, 8), panels, 70)
    with pytest.raises(RuntimeError, match="in_features"):
        cpu_ops.panel_linear(torch.randn(1, 9), panels, 40)


def test_auto_kernels_pick_panels_where_vectorised_and_mkl_on_request(tiny_llama, cpu_ops):
    auto, mkl = tiny_engine(tiny_llama), tiny_engine(tiny_llama, kernels="mkl")
    if panel_kernel_available(cpu_ops):
        assert auto.runner.linear_kernel.startswith("fp32 weight panels")
    if mkl_packed_available():
        assert mkl.runner.linear_kernel.startswith("fp32 MKL packed GEMM")
    assert mkl.runner.fused_cpu_ops  # "mkl" changes only the fp32 linears


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused-cpu-ops"])
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_weight_only_matches_its_dequantized_weights(rows, bias, fused, request):
    # in > 4096: the fused kernel flushes its int32 sums, and 4200 % 32 leaves a tail;
    # torch's kernel takes only multiples of 64 (see test_torch_int8_refuses_odd_widths)
    in_features = 4200 if fused else 4224
    weight, b = random_linear(in_features, 96, bias)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    kernel = Int8WeightOnlyLinear(weight, b, request.getfixturevalue("cpu_ops") if fused
                                  else None)
    out = kernel(x)
    # the product with the int8 weights it holds: torch's kernel rounds activations and
    # output to bfloat16, the fused one activations to int16 (one scale per row)
    expected = reference(x if fused else x.bfloat16().float(), kernel.dequantized(), b)
    tolerance = 1e-3 if fused else 0.02
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)
    # ...and those weights are within int8 rounding of the originals: half a step, the
    # step being one channel's max / 127 (nudged up by under 1%, see the kernel)
    step = weight.abs().amax(dim=0) / 127  # (out,): one scale per output channel
    assert ((kernel.dequantized() - weight).abs() <= 0.51 * step).all()
    error = (out - reference(x, weight, b)).norm() / reference(x, weight, b).norm()
    assert error < 0.02


@pytest.mark.parametrize("rows", [2, 3, 7])  # 7 = 4 + 3: two passes over the weights
@pytest.mark.parametrize("in_features", [20, 33, 576])  # < 32, a 1-element tail, SmolLM2's
def test_fused_int8_every_row_count_and_width(cpu_ops, rows, in_features):
    weight, _ = random_linear(in_features, 40, False, seed=in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)) * 3
    kernel = Int8WeightOnlyLinear(weight, None, cpu_ops)
    torch.testing.assert_close(kernel(x), reference(x, kernel.dequantized(), None),
                               atol=1e-3, rtol=1e-3)


def test_fused_int8_passes_nan_through_and_zero_rows_stay_zero(cpu_ops):
    weight, _ = random_linear(64, 8, False)
    kernel = Int8WeightOnlyLinear(weight, None, cpu_ops)
    x = torch.randn(3, 64)
    x[0, 5], x[1] = float("nan"), 0.0
    out = kernel(x)
    assert out[0].isnan().all() and (out[1] == 0).all()
    torch.testing.assert_close(out[2], reference(x[2:], kernel.dequantized(), None)[0],
                               atol=1e-3, rtol=1e-3)


def test_torch_int8_refuses_odd_widths():
    # NOTE: torch 2.13's _weight_int8pack_mm crashes the process on such widths
    with pytest.raises(ValueError, match="multiple of 64"):
        Int8WeightOnlyLinear(torch.randn(200, 8), None)


def test_fused_int8_survives_extreme_activations(cpu_ops):
    # every product at its int8 x int16 maximum: int32 lanes would overflow unflushed
    in_features = 20_000
    kernel = Int8WeightOnlyLinear(torch.full((in_features, 3), 0.5), None, cpu_ops)
    x = torch.full((2, in_features), 1000.0)
    expected = reference(x, kernel.dequantized(), None)
    torch.testing.assert_close(kernel(x), expected, rtol=1e-5, atol=0)


def test_swap_releases_the_fp32_weights(tiny_llama):
    engine = tiny_engine(tiny_llama, quantization="int8")
    assert engine.runner.linear_kernel.startswith("int8")
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.kernel is not None for m in linears)
    assert all("weight" not in dict(m.named_parameters()) for m in linears)


def test_panels_move_into_one_arena_in_order_and_compute_the_same(cpu_ops):
    shapes = [(96, 200), (200, 96), (96, 40)]
    kernels = [PanelLinear(*random_linear(i, o, True, seed), cpu_ops)
               for seed, (i, o) in enumerate(shapes)]
    kernels.insert(1, Bf16PanelLinear(*random_linear(96, 64, False), cpu_ops))
    xs = [torch.randn(3, k.panels.shape[1] if isinstance(k, PanelLinear) else 96)
          for k in kernels]
    before = [k(x) for k, x in zip(kernels, xs)]
    place_panels_in_one_arena(kernels)
    assert all(torch.equal(k(x), y) for k, x, y in zip(kernels, xs, before))
    fp32 = [k for k in kernels if isinstance(k, PanelLinear)]
    base = fp32[0].panels.untyped_storage().data_ptr()
    assert all(k.panels.untyped_storage().data_ptr() == base for k in fp32)  # one arena
    starts = [k.panels.data_ptr() for k in fp32]
    assert starts == sorted(starts) and len(set(starts)) == 3  # in the listed order
    assert kernels[1].panels.untyped_storage().data_ptr() != base  # bf16: an arena of its own


def test_an_engine_keeps_every_linear_of_its_model_in_one_arena(tiny_llama, cpu_ops):
    engine = tiny_engine(tiny_llama)
    kernels = [m.kernel for m in engine.runner.model.modules() if isinstance(m, Linear)]
    assert len({k.panels.untyped_storage().data_ptr() for k in kernels}) == 1


def test_reference_kernels_keep_plain_torch(tiny_llama):
    engine = tiny_engine(tiny_llama, kernels="reference")
    assert engine.runner.linear_kernel == "torch reference"
    assert all(m.kernel is None for m in engine.runner.model.modules()
               if isinstance(m, Linear))


def test_int8_refused_off_fp32_cpu():
    with pytest.raises(ValueError, match="int8"):
        resolve_kernels(quantization="int8", dtype="bfloat16")


@pytest.mark.parametrize("field,value", [("quantization", "int4"), ("kernels", "fast")])
def test_bad_kernel_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})
    with pytest.raises(ValueError, match="CPU"):
        EngineConfig(device="cuda", quantization="int8")


def test_int8_greedy_agreement_on_smollm2():
    """The quality bar of the int8 opt-in, on a smaller sample than the benchmark's 32."""
    from slotserve.config import engine_config
    from slotserve.lab.quality import greedy_agreement
    from slotserve.lab.workload import generate_workload
    from slotserve.loader import load_model

    loaded = load_model()
    prompts = generate_workload(6, prompts="chat", seed=1).chat_prompt_ids(loaded.tokenizer)

    def engine(**kwargs):
        return LLMEngine(engine_config(max_num_seqs=8, num_blocks=128, **kwargs),
                         loaded.config, loaded.weights, loaded.tokenizer)

    agreement = greedy_agreement(engine(quantization="none"), engine(quantization="int8"),
                                 prompts, 32)
    assert agreement.tokens == 6 * 32
    assert agreement.teacher_forced >= 0.95, agreement
