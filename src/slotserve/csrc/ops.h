// The kernel entry points: what bindings.cpp exposes to Python and decode_stack.cpp calls.
// Each is defined (and documented) in its family's file, named in common.h.
//
// Each tensor entry point checks its arguments, then runs a raw form on pointers (the
// `_rows` and `_into` functions below): the decode stack checks a step once and calls the
// raw forms, with no tensor made or checked between two matmuls. NOTE: a step's weights
// stream through the caches and evict the code: at batch 1 an RMSNorm's tensor call right
// after a matmul took 7-10 us (the torch code it runs, read back from memory), 2 us right
// after another, its raw loop 2.6 us (benchmarks/PERF.md).
#pragma once

#include "tensors.h"

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace slotserve::kernels {

// fused_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor delta, torch::Tensor weight,
                            double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor argmax_rows(torch::Tensor logits);
void rms_norm_rows(const float* x, const float* weight, float* y, int64_t rows,
                   int64_t hidden, double eps);
void add_rms_norm_rows(float* x, const float* delta, const float* weight, float* y,
                       int64_t rows, int64_t hidden, double eps);
void silu_mul_rows(const float* gate_up, float* y, int64_t rows, int64_t inter);
void rotary_rows(float* x, int64_t tokens, int64_t heads, int64_t half, int64_t token_stride,
                 int64_t head_stride, const float* cos, const float* sin);

// paged_attention.cpp
void write_kv_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
               torch::Tensor slot_mapping);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, int64_t window);
constexpr int64_t MAX_ATTENTION_HEADS = 256;  // query heads per sequence (its tasks' arrays)
// The first position a query at position context_len - 1 reads: with a sliding window
// (window > 0, HF's semantics: key j visible iff i - j < window) the last `window`
// positions, else all of them (window 0).
inline int64_t first_window_position(int64_t context_len, int64_t window) {
  return window > 0 && context_len > window ? context_len - window : 0;
}
// The KV caches' elements (`--kv-cache-dtype`): float, c10::BFloat16, or int8 head rows.
enum class KvElements { kFloat, kBf16, kInt8 };
// An int8 cache stores each head row (one token's K or V of one KV head) as hd int8 codes
// followed by fp32 scales, one per run of KV_INT8_GROUP elements from the head's start (the
// last run shorter where hd is not a multiple): slotserve/attention/kv_int8.py's format.
constexpr int64_t KV_INT8_GROUP = 32;
constexpr int64_t kv_int8_scales(int64_t head_dim) {
  return (head_dim + KV_INT8_GROUP - 1) / KV_INT8_GROUP;
}
constexpr int64_t kv_int8_row_bytes(int64_t head_dim) {
  return head_dim + int64_t(sizeof(float)) * kv_int8_scales(head_dim);
}
// One layer's paged K/V caches (num_blocks, bs, nkv, hd) as raw pointers; an int8 cache's
// last axis is a head row's bytes, kv_int8_row_bytes(hd).
struct KvCacheView {
  void *k, *v;
  KvElements elements;
  int64_t num_blocks, block_size, num_kv_heads, head_dim;
  int64_t head_stride;  // elements between two KV heads of a position: hd, or an int8 row
};
KvCacheView kv_cache_view(const torch::Tensor& k_cache, const torch::Tensor& v_cache);
void check_block_tables(const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                        int64_t num_blocks, int64_t block_size, int64_t window);
void write_kv_rows(const KvCacheView& cache, const float* k, int64_t k_token_stride,
                   const float* v, int64_t v_token_stride, int64_t tokens,
                   const int64_t* slots);
void decode_attention_into(const float* q, int64_t seqs, int64_t num_heads,
                           int64_t q_token_stride, int64_t q_head_stride,
                           const KvCacheView& cache, const int64_t* block_tables,
                           int64_t max_blocks, const int64_t* context_lens, double scale,
                           int64_t window, float* out);

// int8_linear.cpp
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales);

// quant_blocks.cpp
// The codes' formats (quant_block_linear's `bits`): 4-, 6- or 8-bit unsigned codes, or
// QUANT_CODES_IQ4_NL (ggml's number for the type): 4-bit indices into IQ4_NL's 16 levels,
// stored as 4-bit codes and looked up in the kernel as the codes level + 128.
constexpr int64_t QUANT_CODES_IQ4_NL = 20;
// IQ4_NL's levels + 128 (ggml-common.h's kvalues_iq4nl): the codes of its indices.
alignas(16) inline constexpr uint8_t IQ4_NL_CODES[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                                         129, 141, 153, 166, 181, 197, 217, 241};
inline bool quant_codes_format_known(int64_t bits) {
  return bits == 4 || bits == 6 || bits == 8 || bits == QUANT_CODES_IQ4_NL;
}
inline int64_t quant_codes_stored_bits(int64_t bits) {
  return bits == QUANT_CODES_IQ4_NL ? 4 : bits;
}
// The formats of a panel's block scales and mins (scales_mins), by its dtype: fp32 or fp16
// (pack_quant_blocks: (panels, blocks, 2, 16)), or the K-quants' factors (pack_factored_scales:
// int8 factors per block and fp16 scales per super-block of QK_K_WEIGHTS weights, multiplied
// in the kernel): uint8 bytes with a scale and a min factor per block, int8 bytes with one
// factor per block that serves both (Q3_K's and Q6_K's mins are -4 d x sc and -32 d x sc:
// their min factor is the scale factor, their super-block min -4 d or -32 d).
constexpr int64_t QUANT_SCALES_F32 = 0, QUANT_SCALES_F16 = 1, QUANT_SCALES_FACTORED = 2,
                  QUANT_SCALES_FACTORED_SHARED = 3;
constexpr int64_t QK_K_WEIGHTS = 256;
inline int64_t quant_scale_format(const torch::Tensor& scales_mins) {
  const auto dtype = scales_mins.scalar_type();
  TORCH_CHECK(dtype == kFloat32 || dtype == kFloat16 || dtype == kUInt8 || dtype == kInt8,
              "scales_mins must be float32, float16 or (factored) uint8 or int8");
  return dtype == kFloat32   ? QUANT_SCALES_F32
         : dtype == kFloat16 ? QUANT_SCALES_F16
         : dtype == kUInt8   ? QUANT_SCALES_FACTORED
                             : QUANT_SCALES_FACTORED_SHARED;
}
bool quant_blocks_vectorised();
std::string quant_blocks_isa();  // "avx512vnni", "avx2" or "plain" (this build's path)
std::tuple<torch::Tensor, torch::Tensor> pack_quant_blocks(torch::Tensor codes,
                                                           torch::Tensor scales,
                                                           torch::Tensor mins, int64_t bits);
// min_factors none: one factor per block serves both (QUANT_SCALES_FACTORED_SHARED).
torch::Tensor pack_factored_scales(torch::Tensor scale_factors,
                                   c10::optional<torch::Tensor> min_factors,
                                   torch::Tensor supers);
// activation_bits: 8 (int8 activations, as llama.cpp's) or 16 (8-bit codes only).
torch::Tensor quant_block_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor sm,
                                 int64_t out_features, int64_t block_len, int64_t bits,
                                 int64_t activation_bits, bool force_plain);
// Throws unless activation_bits is 8, or 16 with 8-bit codes (`bits` 8).
void check_activation_bits(int64_t activation_bits, int64_t bits);
// Throws unless codes and scales_mins are pack_quant_blocks' for (out, in) weights in blocks
// of block_len with `bits`-bit codes.
void check_quant_blocks(const torch::Tensor& codes, const torch::Tensor& scales_mins,
                        int64_t in, int64_t out_features, int64_t block_len, int64_t bits);
// scales_mins in format scale_format (quant_scale_format of its tensor).
void quant_block_linear_into(const float* x, int64_t rows, int64_t in, const uint8_t* codes,
                             const void* scales_mins, int64_t scale_format, int64_t out_features,
                             int64_t block_len, int64_t bits, int64_t activation_bits, float* y,
                             bool force_plain = false);
// Rows `ids` (n,) of the (out_features, in) weight as pack_quant_blocks packed it -> out
// (n, in) fp32, each w = u * d + m (BlockWeights.dequantize's values, to the bit).
void quant_block_rows_into(const uint8_t* codes, const void* scales_mins, int64_t scale_format,
                           int64_t out_features, int64_t in, int64_t block_len, int64_t bits,
                           const int64_t* ids, int64_t n, float* out);
torch::Tensor quant_block_rows(torch::Tensor codes, torch::Tensor sm, int64_t out_features,
                               int64_t block_len, int64_t bits, torch::Tensor ids);

// gguf_unpack.cpp
// Rows of one GGUF tensor's raw blocks: `rows` rows at `data`, row r of them the tensor's
// row order[r] where `order` (int64, a permutation of its rows) is given.
struct GgufRows {
  const uint8_t* data;
  int64_t rows;
  c10::optional<torch::Tensor> order;
};
// GGUF tensors' raw blocks (`parts`, one after the other, rows of row_bytes bytes of ggml
// type `type`) as loader/gguf_blocks.py's BlockWeights arrays: codes (rows, blocks, L)
// uint8, one stored value a byte; scales, mins (rows, blocks) fp32; for the K-quants also
// scale_factors, min_factors (rows, blocks) int8 and supers (rows, super-blocks, 2) fp32.
std::vector<torch::Tensor> unpack_gguf_blocks(const std::vector<GgufRows>& parts,
                                              int64_t row_bytes, int64_t type);
// Rows of a GGUF tensor of ggml type `type`, rows of row_bytes bytes.
struct GgufTypedRows {
  GgufRows rows;
  int64_t type;
  int64_t row_bytes;
};
// GGUF tensors' raw blocks (`parts`, one after the other, each of its own type) as their
// fp32 values (rows, cols): gguf-py's dequantize of each, rows in the order asked, in the
// memory of unpack_gguf_blocks' arrays.
torch::Tensor dequantize_gguf_blocks(const std::vector<GgufTypedRows>& parts);
// A float (rows, cols) weight (fp32, bf16 or fp16; cols a multiple of 32) as GGUF Q8_0's raw
// blocks (rows, cols / 32 * 34 bytes), as gguf-py's quants.quantize (and ggml's
// quantize_row_q8_0_ref) writes them: per block of 32, d = amax / 127 stored as fp16, codes
// x * (1 / d) (the fp32 d) rounded half away from zero, 0 where d is 0; rows in parallel.
// A NaN or infinity is an error.
torch::Tensor quantize_q8_0(const torch::Tensor& weight);
// The memory the arrays of unpack_gguf_blocks are kept in for the next call's, unmapped
// (gguf_unpack.cpp's NOTE (reused memory)); the bytes kept now.
void release_unpack_memory();
int64_t unpack_memory_spare_bytes();

// panel_linear.cpp
// weight (out, in), any strides: fp32, or bf16 / fp16 (widened as read, exactly).
// out: where to write the panels (their shape and dtype, contiguous), else a new tensor
torch::Tensor pack_panels(torch::Tensor weight, c10::optional<torch::Tensor> out);
bool panel_linear_vectorised();
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, int64_t out_features);
void panel_linear_into(const float* x, int64_t tokens, int64_t in, const float* panels,
                       int64_t num_panels, int64_t out_features, float* y);

// bf16_panels.cpp
torch::Tensor pack_panels_bf16(torch::Tensor weight, c10::optional<torch::Tensor> out);
std::tuple<bool, bool> panel_bf16_vectorised();
void set_force_plain_loops(bool force);
torch::Tensor panel_linear_bf16(torch::Tensor x, torch::Tensor panels, int64_t out_features,
                                bool bf16_activations);
// panels of padded_pairs(in) pairs; fp32 activations (the widening mode) unless
// bf16_activations (x rounded to bf16, vdpbf16ps).
void panel_linear_bf16_into(const float* x, int64_t tokens, int64_t in, const uint16_t* panels,
                            int64_t num_panels, int64_t out_features, float* y,
                            bool bf16_activations = false);

// bf16_amx.cpp
bool amx_bf16_usable();
torch::Tensor panel_linear_bf16_amx(torch::Tensor x, torch::Tensor panels,
                                    int64_t out_features);

}  // namespace slotserve::kernels
