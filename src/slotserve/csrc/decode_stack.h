// ---- the decode stack: every decoder layer of an all-decode iteration in one call -----
// At batch 1 a step's kernels are short (a few us each) and the Python around them (module
// calls, views, ~15 calls per layer) cost 2-3 ms of a 10-25 ms step. For an iteration of
// decodes only, DecodeStack runs the same kernels in the same order as
// slotserve/model/llama.py's LlamaDecoderLayer, from C++, with the GIL released: the CPU's
// counterpart of replaying a captured CUDA graph. Prefills and mixed batches stay in Python.
// The classes here (bindings.cpp exposes them), their code in decode_stack.cpp.
#pragma once

#include "tensors.h"

#include <cstdint>
#include <string>
#include <vector>

namespace slotserve::kernels {

// One linear layer's weights, in whichever form its kernel (model/linear_kernels.py) keeps.
struct LinearWeights {
  enum class Kind {
    kPlain, kMkl, kInt8, kPanel, kPanelBf16, kPanelBf16Dot, kQuantBlocks, kSegments
  };
  Kind kind;  // plain: a = W (in, out); mkl: a = packed, b = shape-only (out, in) view;
              // int8: a = qweight (out, in), b = scales (out,); panel: a = pack_panels(W);
              // panel_bf16 (fp32 activations), panel_bf16_dot (bf16 activations):
              // a = pack_panels_bf16(W); gguf_blocks (GGUF blocks x 8- or 16-bit activations):
              // a, b = pack_quant_blocks' codes and scales_mins; segments: `segments`
  torch::Tensor a, b;
  c10::optional<torch::Tensor> bias;
  int64_t out_features;  // panels and gguf_blocks only (the last panel may be padded)
  int64_t amx_min_rows;  // panel_bf16: from this many rows on, AMX where usable (0: never);
                         // panel_bf16_dot: bf16 activations from this many rows on (0: all)
  int64_t block_len = 0, bits = 0;  // gguf_blocks only: the blocks' length, the codes' bits
  int64_t activation_bits = 8;      // gguf_blocks only: 8, or 16 (8-bit codes)
  // segments only: layers of the same inputs whose outputs follow each other (a fused q/k/v
  // whose parts keep their own GGUF formats: Q4_K's q and k beside Q6_K's v)
  std::vector<LinearWeights> segments;
  // panel_bf16_dot at `rows` rows: bf16 activations (vdpbf16ps), else widening.
  bool dot_rows(int64_t rows) const {
    return kind == Kind::kPanelBf16Dot && rows >= amx_min_rows;
  }

  torch::Tensor operator()(const torch::Tensor& x) const;  // (T, in) -> (T, out)
  int64_t outputs() const;  // out features
  // Throws unless this layer takes `in` inputs and gives `out` outputs (out < 0: any).
  void check_shape(int64_t in, int64_t out) const;
  // y (rows, outputs()) = x (rows, in), raw pointers (shapes checked by check_shape): the
  // panel kernels straight, the other kinds (and AMX) through operator() and a copy.
  void into(const float* x, int64_t rows, int64_t in, float* y) const;
};

LinearWeights make_linear(const std::string& kind, torch::Tensor a,
                          c10::optional<torch::Tensor> b, c10::optional<torch::Tensor> bias,
                          int64_t out_features, int64_t amx_min_rows, int64_t block_len,
                          int64_t bits,
                          int64_t activation_bits = 8);

// One linear layer of `segments` (each its own kind, biases their own), outputs concatenated.
LinearWeights make_segments(const std::vector<LinearWeights>& segments);

struct DecoderLayerWeights {
  torch::Tensor input_norm, post_attention_norm;  // (H,)
  LinearWeights qkv, o, gate_up, down;
  int64_t window;  // attention's sliding window (the last `window` positions), 0: full
  // Qwen3 / Gemma 3: an RMSNorm over each head's q and over each head's k, before RoPE
  // (hd,) each; undefined: none
  torch::Tensor q_norm, k_norm;
  // Gemma's sandwich norms (H,) each, both or neither: with them post_attention_norm
  // normalizes the attention's output, pre_feedforward_norm the MLP's input and
  // post_feedforward_norm its output; undefined: the Llama block
  torch::Tensor pre_feedforward_norm, post_feedforward_norm;
  bool local_rope = false;  // Gemma 3's sliding layers: the local RoPE tables
};

// The MLP's gate activation: SiLU (the fused silu_mul), GELU or GELU's tanh form (ATen's
// gelu, as the Python GatedMLP computes it: the same ops on the same shapes).
enum class Activation { kSilu, kGelu, kGeluTanh };

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
              double scale, torch::Tensor final_norm)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
        scale_(scale), final_norm_(final_norm) {}

  // NOTE: every shape is checked here, once: forward's layers run on raw pointers.
  // window: the layer's sliding window (its attention reads the last `window` positions),
  // 0 for full attention. q_norm, k_norm (hd,) both or neither: RMSNorm (the stack's eps) of
  // each q head and each k head after the qkv projection, before RoPE (Qwen3's q/k norms).
  void add_layer(torch::Tensor input_norm, torch::Tensor post_attention_norm,
                 const LinearWeights& qkv, const LinearWeights& o,
                 const LinearWeights& gate_up, const LinearWeights& down, int64_t window,
                 c10::optional<torch::Tensor> q_norm = c10::nullopt,
                 c10::optional<torch::Tensor> k_norm = c10::nullopt,
                 c10::optional<torch::Tensor> pre_feedforward_norm = c10::nullopt,
                 c10::optional<torch::Tensor> post_feedforward_norm = c10::nullopt,
                 bool local_rope = false);

  // The MLP's activation: "silu" (the default), "gelu" or "gelu_pytorch_tanh" (HF's names).
  void set_activation(const std::string& name);
  // Gemma: the looked-up embeddings x scale (fp32; the Python model's factor); 0: none.
  void set_embedding_scale(double scale) { embed_scale_ = scale; }

  // The tables forward looks its tokens up in: the embedding (V, H; fp32, or bf16 / fp16
  // rows widened as they are read: WidenedEmbedding) and RoPE's cos, sin (max positions,
  // hd/2, fp32), contiguous; the model's own tensors (no copy).
  // cos_local, sin_local: Gemma 3's sliding layers' tables (add_layer's local_rope).
  void set_lookup_tables(torch::Tensor embedding, torch::Tensor cos, torch::Tensor sin,
                         c10::optional<torch::Tensor> cos_local = c10::nullopt,
                         c10::optional<torch::Tensor> sin_local = c10::nullopt);
  // The token embedding in GGUF blocks (pack_quant_blocks' codes and scales_mins of the
  // (V, H) table): forward looks the tokens up there. NOTE: after set_lookup_tables, whose
  // embedding is then a placeholder of the table's shape (never read: not resident).
  void set_block_embedding(torch::Tensor codes, torch::Tensor scales_mins, int64_t block_len,
                           int64_t bits);

  // input_ids, positions (D,): D decode tokens, one per sequence; caches: k and v of each
  // layer in turn; slot_mapping (D,); block_tables (D, maxb); context_lens (D,) -> the
  // final norm of the last hidden state (D, H).
  // NOTE: the inputs are checked on entry (ids and positions inside the tables too); the
  // embeddings and RoPE rows are looked up here, and the layers run the kernels' raw forms
  // on one workspace, with no tensor made between two matmuls (ops.h says why).
  torch::Tensor forward(torch::Tensor input_ids, torch::Tensor positions,
                        const std::vector<torch::Tensor>& caches, torch::Tensor slot_mapping,
                        torch::Tensor block_tables, torch::Tensor context_lens) const;

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  torch::Tensor final_norm_;
  torch::Tensor embedding_, cos_, sin_;  // set_lookup_tables
  torch::Tensor cos_local_, sin_local_;  // set_lookup_tables' local tables; undefined: none
  // set_block_embedding's blocks; codes undefined: the fp32 table
  torch::Tensor embedding_codes_, embedding_scales_mins_;
  int64_t embedding_block_len_ = 0, embedding_bits_ = 0;
  Activation activation_ = Activation::kSilu;
  double embed_scale_ = 0.0;
  std::vector<DecoderLayerWeights> layers_;
  // The positions any layer reads: the widest window, 0 (all) once a layer has none. NOTE:
  // forward checks the block tables only where some layer reads.
  int64_t read_window_ = 0;
};

}  // namespace slotserve::kernels
