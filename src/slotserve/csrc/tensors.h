// The slice of ATen the kernel files use: the Tensor class and the few factories and ops
// they call, named under torch:: as <torch/types.h> names them.
// NOTE: <torch/types.h> pulls in every ATen operator and the autograd factories: parsing it
// took ~13 s of each kernel file's compile, this ~5 s (no <ATen/TensorOperators.h>: use
// Tensor::mul and the like, not operators).
// bindings.cpp alone includes torch's Python headers (pybind11 needs them).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>

#include <optional>

namespace torch {
using namespace at;  // NOLINT: torch::Tensor, torch::empty, torch::kFloat... as in <torch/types.h>
}  // namespace torch

namespace slotserve::kernels {
// <torch/types.h>'s names of the dtypes ATen calls kFloat, kHalf, kByte, kChar, kShort, kInt
// and kLong (here, not under torch::, where the torch headers bindings.cpp includes have them).
inline constexpr auto kFloat32 = at::kFloat;
inline constexpr auto kFloat16 = at::kHalf;
inline constexpr auto kUInt8 = at::kByte;
inline constexpr auto kInt8 = at::kChar;
inline constexpr auto kInt16 = at::kShort;
inline constexpr auto kInt32 = at::kInt;
inline constexpr auto kInt64 = at::kLong;
}  // namespace slotserve::kernels
