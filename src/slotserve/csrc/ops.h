// The kernel entry points: what bindings.cpp exposes to Python and decode_stack.cpp calls.
// Each is defined (and documented) in its family's file, named in common.h.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <tuple>

namespace slotserve::kernels {

// fused_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor delta, torch::Tensor weight,
                            double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);

// paged_attention.cpp
void write_kv_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
               torch::Tensor slot_mapping);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale);

// int8_linear.cpp
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales);

// panel_linear.cpp
torch::Tensor pack_panels(torch::Tensor weight);
bool panel_linear_vectorised();
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, int64_t out_features);

// bf16_panels.cpp
torch::Tensor pack_panels_bf16(torch::Tensor weight);
std::tuple<bool, bool> panel_bf16_vectorised();
void set_force_plain_loops(bool force);
torch::Tensor panel_linear_bf16(torch::Tensor x, torch::Tensor panels, int64_t out_features,
                                bool bf16_activations);

// bf16_amx.cpp
bool amx_bf16_usable();
torch::Tensor panel_linear_bf16_amx(torch::Tensor x, torch::Tensor panels,
                                    int64_t out_features);

}  // namespace slotserve::kernels
