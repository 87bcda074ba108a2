"""Dequantization of GGUF tensor data to float32.

Our own vectorized numpy dequantizers cover F32, F16, BF16, Q8_0, Q4_0 and Q4_1 (the default
model holds Q4_1, Q8_0 and F32); every other type goes through `gguf.quants.dequantize`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

Q = GGMLQuantizationType

# NOTE: numpy, not torch: single-threaded and predictable. torch's intra-op threads made these
# loops 5-10x slower on a busy 2-core machine (threads spinning against each other).


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """float32 values of a GGUF tensor's raw data, shaped like `gguf.quants.dequantize`'s result.

    `data` is a `GGUFTensor.data` (rows of bytes) or a `gguf.GGUFReader` tensor's `.data`
    (rows of bytes; an element array for float types). The result has shape
    `data.shape[:-1] + (values per row,)`.
    """
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    row_bytes = data.shape[-1] * data.itemsize
    out_shape = (*data.shape[:-1], row_bytes // type_size * block_size)
    kernel = _KERNELS.get(qtype)
    if kernel is None:
        values = np.array(gguf_dequantize(data, qtype), dtype=np.float32)  # a writable copy
    else:
        values = kernel(np.asarray(data).view(np.uint8).reshape(-1, type_size))
    return torch.from_numpy(values.reshape(out_shape))


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of each block, as a (n_blocks, 1) float32 column."""
    return blocks[:, start:start + 2].view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) packed bytes -> (n, 32) float32: the 16 low nibbles, then the 16 high ones."""
    out = np.empty((qs.shape[0], 2 * qs.shape[1]), dtype=np.float32)
    np.bitwise_and(qs, 0x0F, out=out[:, :qs.shape[1]], casting="unsafe")
    np.right_shift(qs, 4, out=out[:, qs.shape[1]:], casting="unsafe")
    return out


def _deq_f32(blocks: np.ndarray) -> np.ndarray:
    return blocks.view(np.float32).copy()


def _deq_f16(blocks: np.ndarray) -> np.ndarray:
    return blocks.view(np.float16).astype(np.float32)


def _deq_bf16(blocks: np.ndarray) -> np.ndarray:
    return (blocks.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _deq_q8_0(blocks: np.ndarray) -> np.ndarray:
    # block: f16 scale d, 32 x int8 q; x = q * d
    out = blocks[:, 2:].view(np.int8).astype(np.float32)
    out *= _f16(blocks, 0)
    return out


def _deq_q4_0(blocks: np.ndarray) -> np.ndarray:
    # block: f16 scale d, 16 bytes of 4-bit q; x = (q - 8) * d
    out = _nibbles(blocks[:, 2:])
    out -= 8.0
    out *= _f16(blocks, 0)
    return out


def _deq_q4_1(blocks: np.ndarray) -> np.ndarray:
    # block: f16 scale d, f16 min m, 16 bytes of 4-bit q; x = d * q + m
    # NOTE: multiply, then add (never fused): bit-exact with gguf's numpy reference.
    out = _nibbles(blocks[:, 4:])
    out *= _f16(blocks, 0)
    out += _f16(blocks, 2)
    return out


_KERNELS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    Q.F32: _deq_f32,
    Q.F16: _deq_f16,
    Q.BF16: _deq_bf16,
    Q.Q8_0: _deq_q8_0,
    Q.Q4_0: _deq_q4_0,
    Q.Q4_1: _deq_q4_1,
}
