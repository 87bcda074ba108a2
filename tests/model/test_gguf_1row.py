"""The GGUF block kernel's paths by block length and code format (csrc/quant_blocks.cpp).

The VNNI kernel is compiled per (rows in a tile, block length, code format): a row's result
must be the same bits whichever of them runs it (1 row alone, in any tile of up to 8, the
plain-loop fallback), and within the documented bound of gguf-py's `dequantize` + an fp32
matmul (tests/model/test_gguf_quant.py's docstring). Every (block length, format) the loader
can produce is here: each type's own, and the fusions of mixed types (q/k/v, gate/up), whose
codes take 6 or 8 bits in blocks of 16.
"""

from __future__ import annotations

import pytest
import torch

from slotserve.loader.gguf_blocks import concat_rows, to_blocks
from slotserve.model.linear_kernels import GGUFBlockLinear
from tests.model.test_gguf_quant import Q, error_bound, raw_tensor

# name -> the GGUF types fused into one weight (one type: that type's own blocks)
LAYOUTS = {
    "Q4_K (4-bit, L32, factored)": (Q.Q4_K,),
    "Q4_0 (4-bit, L32, fp16)": (Q.Q4_0,),
    "Q5_K (6-bit, L32)": (Q.Q5_K,),
    "Q6_K (6-bit, L16)": (Q.Q6_K,),
    "Q8_0 (8-bit, L32)": (Q.Q8_0,),
    "IQ4_NL (indices, L32)": (Q.IQ4_NL,),
    "Q3_K (4-bit, L16)": (Q.Q3_K,),
    "Q4_K+Q6_K (6-bit, L16)": (Q.Q4_K, Q.Q6_K),
    "Q4_K+Q8_0 (8-bit, L16)": (Q.Q4_K, Q.Q6_K, Q.Q8_0),
}
IN = 512  # two 256-weight super-blocks


def fused_blocks(types):
    parts = [to_blocks(raw_tensor(t, 48 if len(types) == 1 else 16, IN, seed=i), t, "w",
                       "test.gguf") for i, t in enumerate(types)]
    return parts[0] if len(parts) == 1 else concat_rows(parts)


@pytest.mark.parametrize("types", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_one_row_equals_every_tile_and_the_plain_loops(types, block_ops):
    blocks = fused_blocks(types)
    kernel = GGUFBlockLinear(blocks, None, block_ops)
    x = torch.randn(9, IN, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([kernel(x[i:i + 1]) for i in range(len(x))])  # the 1-row path
    for tile in range(2, 10):  # tiles of 2..8 rows, and 9 = 8 + 1
        assert torch.equal(kernel(x[:tile]), alone[:tile]), tile
    plain = block_ops.quant_block_linear(x, kernel.codes, kernel.scales_mins, kernel.out_features,
                                         kernel.block_len, kernel.bits, kernel.activation_bits,
                                         force_plain=True)
    assert torch.equal(plain, alone)
    error = (alone - x @ blocks.dequantize().T).abs()
    assert (error <= error_bound(x, blocks)).all(), error.max()
