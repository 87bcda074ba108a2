// The decode stack's code: a linear layer by its kernel, and the layers of an all-decode
// iteration in the order of slotserve/model/llama.py's LlamaDecoderLayer (decode_stack.h).

#include "decode_stack.h"

#include "ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace slotserve::kernels {

torch::Tensor LinearWeights::operator()(const torch::Tensor& x) const {  // (T, in) -> (T, out)
  if (kind == Kind::kMkl) {
    static auto mkl_linear =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("mkl::_mkl_linear", "")
            .typed<torch::Tensor(const torch::Tensor&, const torch::Tensor&,
                                 const torch::Tensor&, const c10::optional<torch::Tensor>&,
                                 int64_t)>();
    return mkl_linear.call(x, a, b, bias, x.size(0));
  }
  if (kind == Kind::kPlain) return bias ? torch::addmm(*bias, x, a) : torch::mm(x, a);
  torch::Tensor y = kind == Kind::kPanel      ? panel_linear(x, a, out_features)
                    : kind == Kind::kInt8     ? int8_linear(x, a, b)
                    : kind == Kind::kPanelBf16 && amx_min_rows > 0 &&
                            x.size(0) >= amx_min_rows && amx_bf16_usable()
                        ? panel_linear_bf16_amx(x, a, out_features)
                        : panel_linear_bf16(x, a, out_features, kind == Kind::kPanelBf16Dot);
  return bias ? y.add_(*bias) : y;
}

LinearWeights make_linear(const std::string& kind, torch::Tensor a,
                          c10::optional<torch::Tensor> b, c10::optional<torch::Tensor> bias,
                          int64_t out_features, int64_t amx_min_rows) {
  using Kind = LinearWeights::Kind;
  const bool panel = kind == "panel" || kind == "panel_bf16" || kind == "panel_bf16_dot";
  TORCH_CHECK(kind == "plain" || kind == "mkl" || kind == "int8" || panel,
              "linear kind must be plain, mkl, int8 or panel (or panel_bf16, panel_bf16_dot), got ",
              kind);
  TORCH_CHECK(kind == "plain" || panel || b, kind, " linear needs its second tensor");
  TORCH_CHECK(!panel || out_features > 0, "panel linear needs out_features");
  const Kind parsed = kind == "plain"        ? Kind::kPlain
                      : kind == "mkl"        ? Kind::kMkl
                      : kind == "int8"       ? Kind::kInt8
                      : kind == "panel"      ? Kind::kPanel
                      : kind == "panel_bf16" ? Kind::kPanelBf16
                                             : Kind::kPanelBf16Dot;
  return {parsed, a, b ? *b : torch::Tensor(), bias, out_features, amx_min_rows};
}

torch::Tensor DecodeStack::forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                   const std::vector<torch::Tensor>& caches,
                                   torch::Tensor slot_mapping, torch::Tensor block_tables,
                                   torch::Tensor context_lens) const {
  TORCH_CHECK(caches.size() == 2 * layers_.size(), "one k and one v cache per layer");
  const int64_t D = x.size(0), q_size = num_heads_ * head_dim_;
  const int64_t kv_size = num_kv_heads_ * head_dim_;
  // the residual stream, added to in place (the caller's x stays as it was)
  x = x.clone(at::MemoryFormat::Contiguous);
  torch::Tensor mlp_out;  // the previous layer's MLP output, not yet added to x
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DecoderLayerWeights& layer = layers_[i];
    const torch::Tensor &k_cache = caches[2 * i], &v_cache = caches[2 * i + 1];
    // attention block
    torch::Tensor h = i == 0 ? rms_norm(x, layer.input_norm, eps_)
                             : add_rms_norm_(x, mlp_out, layer.input_norm, eps_);
    torch::Tensor qkv = layer.qkv(h);  // (D, q + 2 kv)
    torch::Tensor qk = qkv.narrow(1, 0, q_size + kv_size)
                           .view({D, num_heads_ + num_kv_heads_, head_dim_});
    rotary_(qk, cos, sin);  // in place, inside qkv
    torch::Tensor q = qk.narrow(1, 0, num_heads_);                // (D, nh, hd)
    torch::Tensor k = qk.narrow(1, num_heads_, num_kv_heads_);    // (D, nkv, hd)
    torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size)
                          .view({D, num_kv_heads_, head_dim_});  // (D, nkv, hd)
    write_kv_(k_cache, v_cache, k, v, slot_mapping);
    torch::Tensor attn = paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                context_lens, scale_);  // (D, nh, hd)
    // MLP block
    h = add_rms_norm_(x, layer.o(attn.view({D, q_size})), layer.post_attention_norm, eps_);
    mlp_out = layer.down(silu_mul(layer.gate_up(h)));  // (D, H)
  }
  return layers_.empty() ? rms_norm(x, final_norm_, eps_)
                         : add_rms_norm_(x, mlp_out, final_norm_, eps_);
}

}  // namespace slotserve::kernels
