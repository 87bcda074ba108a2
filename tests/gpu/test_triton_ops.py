"""The Triton K/V write, RMSNorm, RoPE and SiLU-and-multiply equal the torch ops of the CPU
path (attention/torch_paged.py, model/layers.py), with the fused CPU kernels' tolerances
(tests/model/test_fused_ops.py) in fp32 and assert_close's bf16 tolerance in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from slotserve.attention.torch_paged import write_kv  # noqa: E402
from slotserve.gpu import triton_ops as ops  # noqa: E402
from slotserve.model.layers import RMSNorm, RotaryEmbedding, apply_rotary  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


def assert_same_bits(got: torch.Tensor, expected: torch.Tensor) -> None:
    """The same bit patterns, to the bit, except a NaN's (torch's own differ: its vectorised
    CPU cast gives 0xFFFF, its scalar one 0x7FC0), which need only be NaN too."""
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan)
    as_int = torch.int16 if got.element_size() == 2 else torch.int32
    assert torch.equal(got.view(as_int)[~nan], expected.view(as_int)[~nan])


# --- K/V write


@pytest.mark.parametrize("kv_dtype", DTYPES, ids=["fp32-cache", "bf16-cache"])
@pytest.mark.parametrize("src_dtype", DTYPES, ids=["fp32-kv", "bf16-kv"])
def test_write_kv_equals_torch_to_the_bit(device, kv_dtype, src_dtype):
    """k and v as the model passes them (views into a wider qkv row); a bf16 cache rounds as
    torch's .to(bfloat16) (to nearest even: ties, the largest finite value, NaN, inf)."""
    gen = torch.Generator().manual_seed(3)
    tokens, nkv, hd = 7, 3, 24  # hd and nkv padded to powers of two in the kernel
    qkv = torch.randn(tokens, (4 + 2 * nkv) * hd, generator=gen) * 5
    qkv[0, 4 * hd:4 * hd + 8] = torch.tensor([
        1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.4e38, float("nan"), float("inf"),
        -float("inf"), 1e-40])  # ties to even (down, up), overflow to inf, a subnormal
    qkv = qkv.to(src_dtype).to(device)
    k = qkv[:, 4 * hd:(4 + nkv) * hd].view(tokens, nkv, hd)
    v = qkv[:, (4 + nkv) * hd:].view(tokens, nkv, hd)
    slots = torch.tensor([5, 0, 17, 9, 30, 2, 11], device=device)
    kernel = [torch.zeros(8, 4, nkv, hd, dtype=kv_dtype, device=device) for _ in range(2)]
    torch_ = [c.clone() for c in kernel]

    ops.write_kv_(*kernel, k, v, slots)
    write_kv(*torch_, k, v, slots)

    assert_same_bits(kernel[0], torch_[0])
    assert_same_bits(kernel[1], torch_[1])


def test_write_kv_skips_negative_slots(device):
    k = torch.randn(3, 2, 8, device=device)
    caches = [torch.zeros(2, 4, 2, 8, device=device) for _ in range(2)]
    ops.write_kv_(*caches, k, k * 2, torch.tensor([6, -1, 1], device=device))
    flat_k, flat_v = (c.view(-1, 2, 8) for c in caches)
    assert torch.equal(flat_k[6], k[0]) and torch.equal(flat_k[1], k[2])
    assert torch.equal(flat_v[1], k[2] * 2)
    assert int(torch.count_nonzero(flat_k)) == 2 * 2 * 8  # nothing else written


def test_write_kv_rejects_bad_arguments(device):
    caches = [torch.zeros(2, 4, 2, 8, device=device) for _ in range(2)]
    k, slots = torch.randn(3, 2, 8, device=device), torch.tensor([0, 1, 2], device=device)
    with pytest.raises(ValueError, match=r"k must be \(T, 2, 8\)"):
        ops.write_kv_(*caches, k[:, :1], k, slots)
    with pytest.raises(ValueError, match="v and slot_mapping differ"):
        ops.write_kv_(*caches, k, k[:2], slots)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        ops.write_kv_(*caches, k, k, slots.int())
    with pytest.raises(ValueError, match="v_cache must have"):
        ops.write_kv_(caches[0], caches[1][:1], k, k, slots)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ops.write_kv_(*caches, k.double(), k, slots)


# --- RMSNorm


def torch_rms_norm(x, weight, eps):
    norm = RMSNorm(x.shape[1], eps).to(x.device)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm.to(weight.dtype)(x)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_rms_norm_equals_torch(device, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 96, generator=gen) * 3).to(dtype).to(device)  # 96: padded to 128
    weight = torch.randn(96, generator=gen).to(dtype).to(device)
    got = ops.rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype
    torch.testing.assert_close(got, torch_rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_add_rms_norm_adds_in_place_then_normalises(device, dtype):
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 64, generator=gen) * 3).to(dtype).to(device)
    delta = torch.randn(6, 64, generator=gen).to(dtype).to(device)
    weight = torch.randn(64, generator=gen).to(dtype).to(device)
    summed = x + delta
    y = ops.add_rms_norm_(x, delta, weight, 1e-5)
    assert torch.equal(x, summed)  # x holds the sum, rounded as torch's add
    torch.testing.assert_close(y, torch_rms_norm(summed, weight, 1e-5))
    with pytest.raises(ValueError, match="delta must have x's shape"):
        ops.add_rms_norm_(x, delta[:, :32], weight, 1e-5)


def test_rms_norm_rejects_bad_arguments(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ops.rms_norm(x.double(), torch.ones(8, device=device), 1e-5)
    with pytest.raises(ValueError, match=r"weight must be \(8,\)"):
        ops.rms_norm(x, torch.ones(4, device=device), 1e-5)
    with pytest.raises(ValueError, match=r"x must be \(T, H\)"):
        ops.rms_norm(x[0], torch.ones(8, device=device), 1e-5)


# --- RoPE


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rotary_in_place_equals_apply_rotary_and_touches_only_the_view(device, dtype):
    """q and k heads of a qkv row rotated in one call (6 heads: padded to 8), the v columns
    after them untouched; positions from the table's first to its last."""
    tokens, heads, head_dim, max_positions = 5, 6, 16, 64
    rope = RotaryEmbedding(head_dim, max_positions, 10_000.0).to(device)
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(tokens, heads * head_dim + 32, generator=gen).to(dtype).to(device)
    positions = torch.tensor([0, 1, 17, 40, max_positions - 1], device=device)
    view = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    expected = apply_rotary(view, rope.tables(positions))
    untouched = qkv[:, heads * head_dim:].clone()

    assert ops.rotary_(view, rope.cos, rope.sin, positions) is view

    torch.testing.assert_close(view, expected)
    assert torch.equal(qkv[:, heads * head_dim:], untouched)


def test_rotary_takes_the_fused_cpu_kernels_form_too(device):
    """rotary_(x, cos, sin) with the tokens' own rows (RotaryEmbedding.tables), as the model
    calls its layer ops' rotary_."""
    rope = RotaryEmbedding(32, 128, 500_000.0).to(device)
    x = torch.randn(4, 3, 32, generator=torch.Generator().manual_seed(2)).to(device)
    positions = torch.tensor([127, 0, 5, 5], device=device)
    expected = apply_rotary(x, rope.tables(positions))
    torch.testing.assert_close(ops.rotary_(x, *rope.tables(positions)), expected)
    with pytest.raises(ValueError, match="must hold 4 rows of 16 without positions"):
        ops.rotary_(x, rope.cos, rope.sin)


def test_rotary_rejects_bad_arguments(device):
    x = torch.randn(2, 3, 8, device=device)
    table = torch.randn(10, 4, device=device)
    positions = torch.tensor([0, 1], device=device)
    with pytest.raises(ValueError, match="even hd"):
        ops.rotary_(x[..., :7], table, table, positions)
    with pytest.raises(ValueError, match=r"cos must be \(max_positions, 4\)"):
        ops.rotary_(x, table[:, :2], table, positions)
    with pytest.raises(ValueError, match=r"positions must be \(2,\) int64"):
        ops.rotary_(x, table, table, positions.int())


# --- SiLU and multiply


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy
@pytest.mark.parametrize("rows", [1, 17])
def test_silu_mul_equals_torch_over_the_whole_range(device, rows):
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 96, generator=gen) * 20  # large |gate|: exp's extremes
    gate_up[0, :4] = torch.tensor([-200.0, -88.0, 88.0, 200.0])
    gate_up = gate_up.to(device)
    gate, up = gate_up.split(96, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up,
                               rtol=1e-5, atol=1e-6)


def test_silu_mul_in_bf16_and_over_several_programs(device, monkeypatch):
    monkeypatch.setattr(ops, "SILU_BLOCK", 32)  # 96 columns: 3 programs per row
    gen = torch.Generator().manual_seed(11)
    gate_up = (torch.randn(5, 2 * 96, generator=gen) * 4).bfloat16().to(device)
    gate, up = gate_up.float().split(96, dim=-1)
    got = ops.silu_mul(gate_up)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, (F.silu(gate) * up).bfloat16())  # one rounding
    with pytest.raises(ValueError, match=r"gate_up must be \(T, 2I\)"):
        ops.silu_mul(gate_up[:, :95])
