// ---- GGUF blocks unpacked at load: a file's raw blocks -> BlockWeights' arrays ----------
// loader/gguf_blocks.py's `to_blocks` keeps a GGUF tensor's quantized blocks as one form,
// BlockWeights: per output row, blocks of L (16 or 32) unsigned codes u, one a byte, with a
// scale d and min m per block (w = d * u + m), and for the K-quants the factors the file
// stores them as (an int8 factor per block, an fp32 d and m per 256-weight super-block).
// Each supported GGUF type has one decoder here (a struct: its ggml type number, block
// bytes, weights per block, L, and `decode`), run over the tensor's blocks in parallel.
//
// NOTE (same bits): every scale and min is an fp16 value times an integer of at most 8 bits
// (or times -8, -16, -32, -128: powers of two), so each product is exact in fp32, whatever
// the order of operations or the instructions; the codes are bit fields. The numpy
// conversions these replace stay the reference in tests/model/test_gguf_unpack.py, which
// compares every type's arrays to the bit.
// NOTE (finite scales): the loader refuses non-finite fp16 fields first (check_blocks); a
// NaN or inf here would only flow into the arrays.

#include "common.h"
#include "ops.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

namespace slotserve::kernels {

namespace {

// Where one GGUF block's values go in unpack_gguf_blocks' outputs.
struct BlockOut {
  uint8_t* codes;          // kWeights codes
  float* scales;           // kWeights / kLen each
  float* mins;
  int8_t* scale_factors;   // the K-quants' factors (kWeights / kLen each), else unused
  int8_t* min_factors;
  float* super;            // the K-quants' super-block d and m (2), else unused
};

inline float fp16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return float(c10::Half(bits, c10::Half::from_bits()));
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 16 bytes -> 32 codes: the 16 low nibbles, then the 16 high ones (Q4_0, Q4_1, Q5_0,
// Q5_1, IQ4_NL: ggml's dequantize_row_q4_0 order).
inline void nibbles32(const uint8_t* qs, uint8_t* codes) {
  for (int i = 0; i < 16; ++i) {
    codes[i] = qs[i] & 0x0F;
    codes[i + 16] = qs[i] >> 4;
  }
}

// Bit i of qh (a little-endian uint32) as bit 4 of code i (Q5_0, Q5_1).
inline void fifth_bits32(uint32_t qh, uint8_t* codes) {
  for (int i = 0; i < 32; ++i) codes[i] |= uint8_t(((qh >> i) & 1) << 4);
}

// 64 bytes of 2-bit values -> 256 codes: per 32 bytes, bits 0-1 of each, then bits 2-3,
// 4-5, 6-7 (Q2_K, Q3_K: ggml's dequantize_row_q2_K order).
inline void crumbs256(const uint8_t* qs, uint8_t* codes) {
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s)
      for (int l = 0; l < 32; ++l) codes[128 * h + 32 * s + l] = (qs[32 * h + l] >> (2 * s)) & 3;
}

// 128 bytes -> 256 codes: per 32 bytes, the low nibbles, then the high ones (Q4_K, Q5_K).
inline void k_nibbles256(const uint8_t* qs, uint8_t* codes) {
  for (int g = 0; g < 4; ++g)
    for (int l = 0; l < 32; ++l) {
      codes[64 * g + l] = qs[32 * g + l] & 0x0F;
      codes[64 * g + 32 + l] = qs[32 * g + l] >> 4;
    }
}

// Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins -> 8 of each (ggml's get_scale_min_k4).
inline void k_scales_mins(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
  for (int i = 0; i < 4; ++i) {
    sc[i] = s[i] & 0x3F;
    mn[i] = s[4 + i] & 0x3F;
    sc[4 + i] = (s[8 + i] & 0x0F) | ((s[i] >> 2) & 0x30);
    mn[4 + i] = (s[8 + i] >> 4) | ((s[4 + i] >> 2) & 0x30);
  }
}

// The K-quants' sub-block scales d * sc and mins -(dmin * mn), their factors, and the
// super-block's d and m (m: -dmin).
template <int N>
inline void k_scales_out(float d, float dmin, const uint8_t sc[N], const uint8_t mn[N],
                         const BlockOut& o) {
  for (int k = 0; k < N; ++k) {
    o.scales[k] = d * float(sc[k]);
    o.mins[k] = -(dmin * float(mn[k]));
    o.scale_factors[k] = int8_t(sc[k]);
    o.min_factors[k] = int8_t(mn[k]);
  }
  o.super[0] = d;
  o.super[1] = -dmin;
}

// ---- one struct per GGUF type: kType (ggml's number), kBytes, kWeights, kLen, kFactored --

// d (fp16), 16 bytes of nibbles, m = MIN_OVER_D d: Q4_0 (u = q, m = -8 d) and IQ4_NL (its
// 4-bit indices kept as they are, BlockWeights.indexed; m = -128 d)
template <int64_t TYPE, int MIN_OVER_D>
struct NibblesWithScaledMin {
  static constexpr int64_t kType = TYPE, kBytes = 18, kWeights = 32, kLen = 32;
  static constexpr bool kFactored = false;
  static void decode(const uint8_t* b, const BlockOut& o) {
    const float d = fp16_at(b);
    nibbles32(b + 2, o.codes);
    o.scales[0] = d;
    o.mins[0] = float(MIN_OVER_D) * d;
  }
};
using Q4_0 = NibblesWithScaledMin<2, -8>;
using IQ4_NL = NibblesWithScaledMin<20, -128>;

struct Q4_1 {  // d, m (fp16), 16 bytes of nibbles
  static constexpr int64_t kType = 3, kBytes = 20, kWeights = 32, kLen = 32;
  static constexpr bool kFactored = false;
  static void decode(const uint8_t* b, const BlockOut& o) {
    nibbles32(b + 4, o.codes);
    o.scales[0] = fp16_at(b);
    o.mins[0] = fp16_at(b + 2);
  }
};

struct Q5_0 {  // d, 32 fifth bits, 16 bytes of nibbles; m = -16 d
  static constexpr int64_t kType = 6, kBytes = 22, kWeights = 32, kLen = 32;
  static constexpr bool kFactored = false;
  static void decode(const uint8_t* b, const BlockOut& o) {
    const float d = fp16_at(b);
    nibbles32(b + 6, o.codes);
    fifth_bits32(u32_at(b + 2), o.codes);
    o.scales[0] = d;
    o.mins[0] = -16.f * d;
  }
};

struct Q5_1 {  // d, m, 32 fifth bits, 16 bytes of nibbles
  static constexpr int64_t kType = 7, kBytes = 24, kWeights = 32, kLen = 32;
  static constexpr bool kFactored = false;
  static void decode(const uint8_t* b, const BlockOut& o) {
    nibbles32(b + 8, o.codes);
    fifth_bits32(u32_at(b + 4), o.codes);
    o.scales[0] = fp16_at(b);
    o.mins[0] = fp16_at(b + 2);
  }
};

struct Q8_0 {  // d, 32 int8 q; u = q + 128 (the byte's top bit flipped), m = -128 d
  static constexpr int64_t kType = 8, kBytes = 34, kWeights = 32, kLen = 32;
  static constexpr bool kFactored = false;
  static void decode(const uint8_t* b, const BlockOut& o) {
    const float d = fp16_at(b);
    for (int i = 0; i < 32; ++i) o.codes[i] = b[2 + i] ^ 0x80;
    o.scales[0] = d;
    o.mins[0] = -128.f * d;
  }
};

struct Q2_K {  // 16 bytes of 4-bit (scale, min) pairs, 64 bytes of 2-bit q, d, dmin
  static constexpr int64_t kType = 10, kBytes = 84, kWeights = 256, kLen = 16;
  static constexpr bool kFactored = true;
  static void decode(const uint8_t* b, const BlockOut& o) {
    uint8_t sc[16], mn[16];
    for (int k = 0; k < 16; ++k) {
      sc[k] = b[k] & 0x0F;
      mn[k] = b[k] >> 4;
    }
    crumbs256(b + 16, o.codes);
    k_scales_out<16>(fp16_at(b + 80), fp16_at(b + 82), sc, mn, o);
  }
};

struct Q3_K {  // 32 bytes of high bits, 64 of 2-bit q, 12 of 6-bit scales, d
  static constexpr int64_t kType = 11, kBytes = 110, kWeights = 256, kLen = 16;
  static constexpr bool kFactored = true;
  static void decode(const uint8_t* b, const BlockOut& o) {
    const uint8_t *hmask = b, *packed = b + 96;
    const float d = fp16_at(b + 108);
    crumbs256(b + 32, o.codes);
    // q = low bits - 4 unless the high bit is set: u = q + 4 = low bits + 4 * bit; code
    // 32 j + l's bit is bit j of hmask[l]
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; ++l) o.codes[32 * j + l] |= uint8_t(((hmask[l] >> j) & 1) << 2);
    // 16 6-bit scales: low nibbles in bytes 0-7 (then their high nibbles), 2 high bits each
    // in bytes 8-11 (ggml's dequantize_row_q3_K); the scale is d (sc - 32), the min -4 times it
    for (int k = 0; k < 16; ++k) {
      const int low = (packed[k % 8] >> (4 * (k / 8))) & 0x0F;
      const int high = (packed[8 + k % 4] >> (2 * (k / 4))) & 0x03;
      const int signed_sc = (low | (high << 4)) - 32;
      o.scales[k] = d * float(signed_sc);
      o.mins[k] = -4.f * o.scales[k];
      o.scale_factors[k] = o.min_factors[k] = int8_t(signed_sc);
    }
    o.super[0] = d;
    o.super[1] = -4.f * d;
  }
};

struct Q4_K {  // d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
  static constexpr int64_t kType = 12, kBytes = 144, kWeights = 256, kLen = 32;
  static constexpr bool kFactored = true;
  static void decode(const uint8_t* b, const BlockOut& o) {
    uint8_t sc[8], mn[8];
    k_scales_mins(b + 4, sc, mn);
    k_nibbles256(b + 16, o.codes);
    k_scales_out<8>(fp16_at(b), fp16_at(b + 2), sc, mn, o);
  }
};

struct Q5_K {  // as Q4_K, with 32 bytes of fifth bits before the nibbles
  static constexpr int64_t kType = 13, kBytes = 176, kWeights = 256, kLen = 32;
  static constexpr bool kFactored = true;
  static void decode(const uint8_t* b, const BlockOut& o) {
    uint8_t sc[8], mn[8];
    k_scales_mins(b + 4, sc, mn);
    const uint8_t* qh = b + 16;
    k_nibbles256(b + 48, o.codes);
    for (int j = 0; j < 8; ++j)  // sub-block j's fifth bits: bit j of each byte
      for (int l = 0; l < 32; ++l) o.codes[32 * j + l] |= uint8_t(((qh[l] >> j) & 1) << 4);
    k_scales_out<8>(fp16_at(b), fp16_at(b + 2), sc, mn, o);
  }
};

struct Q6_K {  // 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d
  static constexpr int64_t kType = 14, kBytes = 210, kWeights = 256, kLen = 16;
  static constexpr bool kFactored = true;
  static void decode(const uint8_t* b, const BlockOut& o) {
    const uint8_t *ql = b, *qh = b + 128;
    const float d = fp16_at(b + 208);
    for (int h = 0; h < 2; ++h) {
      for (int s = 0; s < 2; ++s)  // code 128 h + 64 s + l: nibble s of ql[64 h + l]
        for (int l = 0; l < 64; ++l)
          o.codes[128 * h + 64 * s + l] = (ql[64 * h + l] >> (4 * s)) & 0x0F;
      for (int s = 0; s < 4; ++s)  // code 128 h + 32 s + l: bits 2s, 2s+1 of qh[32 h + l]
        for (int l = 0; l < 32; ++l)
          o.codes[128 * h + 32 * s + l] |= uint8_t(((qh[32 * h + l] >> (2 * s)) & 3) << 4);
    }
    for (int k = 0; k < 16; ++k) {  // the scale d sc, the min -32 times it
      const int8_t sc = int8_t(b[192 + k]);
      o.scales[k] = d * float(sc);
      o.mins[k] = -32.f * o.scales[k];
      o.scale_factors[k] = o.min_factors[k] = sc;
    }
    o.super[0] = d;
    o.super[1] = -32.f * d;
  }
};

// NOTE (reused memory): a fresh page costs a fault, the kernel zeroing it: ~0.35 s a GiB on
// the 2-core Zen 3 VM, several times the unpacking of a GiB of codes into pages already there.
// A model's weights are unpacked one at a time, and each weight's arrays are dropped once
// its kernel has packed them (LazyBlocks), so their memory is kept for the next weight's:
// one spare buffer, of at most kSpareBytes (a 3B layer's fused gate/up fits, its embedding
// does not), unmapped when the loading is done (release_unpack_memory: load_model's
// LoadedModel dropped). A call's arrays share their buffer's ownership: while one of them
// lives (a test holding BlockWeights), the buffer is not handed out again.
// NOTE (peak memory): a request the spare cannot hold unmaps it first (the loading never
// holds both), and the spare is cut to the largest of the last kRecent requests (a layer's
// weights are 5): the tied embedding, unpacked first, no longer stays resident through every
// layer's loading (a 0.5B's ~200 MB did: its peak RSS +90 MB), while a layer's weights
// reuse the memory of the largest of them (cut to each request, they did not: +0.3 s).
class UnpackMemory {
 public:
  static constexpr size_t kSpareBytes = size_t(256) << 20;
  static constexpr size_t kRecent = 8;

  // A buffer of at least `bytes`, the spare one where it is big enough; given back (to be
  // the spare, or unmapped) when the last owner drops it.
  std::shared_ptr<uint8_t> take(size_t bytes) {
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    size_t size = (std::max<size_t>(bytes, 1) + page - 1) / page * page;
    std::lock_guard<std::mutex> lock(mu_);
    recent_[requests_++ % kRecent] = size;
    uint8_t* buffer = nullptr;
    if (spare_ != nullptr && spare_size_ >= size) {
      std::swap(buffer, spare_);
      const size_t keep = std::max(size, *std::max_element(recent_.begin(), recent_.end()));
      if (spare_size_ > keep) munmap(buffer + keep, spare_size_ - keep);
      size = std::min(spare_size_, keep);
    } else {
      unmap_spare();
      void* mapped = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                          -1, 0);
      TORCH_CHECK(mapped != MAP_FAILED, "out of memory unpacking ", size, " bytes of blocks");
      buffer = static_cast<uint8_t*>(mapped);
    }
    return std::shared_ptr<uint8_t>(buffer, [this, size](uint8_t* p) { give_back(p, size); });
  }

  void release() {
    std::lock_guard<std::mutex> lock(mu_);
    unmap_spare();
  }

  size_t spare_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return spare_ == nullptr ? 0 : spare_size_;
  }

 private:
  void give_back(uint8_t* buffer, size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    if (size > kSpareBytes || (spare_ != nullptr && spare_size_ >= size)) {
      munmap(buffer, size);
      return;
    }
    unmap_spare();
    spare_ = buffer;
    spare_size_ = size;
  }
  void unmap_spare() {  // mu_ held
    if (spare_ != nullptr) munmap(spare_, spare_size_);
    spare_ = nullptr;
  }

  std::mutex mu_;
  uint8_t* spare_ = nullptr;
  size_t spare_size_ = 0;
  std::array<size_t, kRecent> recent_{};  // the last requests' sizes (a ring)
  size_t requests_ = 0;
};

// NOTE: never destroyed: arrays alive at exit give their buffers back to it.
UnpackMemory& unpack_memory() {
  static UnpackMemory* memory = new UnpackMemory();
  return *memory;
}

// Uninitialised tensors of `sizes` and `dtypes`, one after the other (64-byte aligned) in
// one buffer of unpack_memory().
std::vector<torch::Tensor> unpack_arrays(const std::vector<std::vector<int64_t>>& sizes,
                                         const std::vector<torch::ScalarType>& dtypes) {
  std::vector<size_t> offsets;
  size_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    offsets.push_back(total);
    int64_t elements = 1;
    for (int64_t n : sizes[i]) elements *= n;
    total += (size_t(elements) * c10::elementSize(dtypes[i]) + 63) / 64 * 64;
  }
  const std::shared_ptr<uint8_t> buffer = unpack_memory().take(total);
  std::vector<torch::Tensor> out;
  for (size_t i = 0; i < sizes.size(); ++i)
    out.push_back(torch::from_blob(buffer.get() + offsets[i], sizes[i],
                                   [buffer](void*) {}, torch::dtype(dtypes[i])));
  return out;
}

// The outputs for rows of row_blocks GGUF blocks of type T, row r read from rows[r].
template <typename T>
std::vector<torch::Tensor> unpack_rows(const std::vector<const uint8_t*>& sources,
                                       int64_t row_blocks) {
  constexpr int64_t subs = T::kWeights / T::kLen;  // blocks of L per GGUF block
  const int64_t rows = int64_t(sources.size()), blocks = row_blocks * subs;  // blocks of L a row
  std::vector<std::vector<int64_t>> sizes{{rows, blocks, T::kLen}, {rows, blocks}, {rows, blocks}};
  std::vector<torch::ScalarType> dtypes{kUInt8, kFloat32, kFloat32};
  if constexpr (T::kFactored) {  // the factors, and one super-block a GGUF block
    sizes.insert(sizes.end(), {{rows, blocks}, {rows, blocks}, {rows, row_blocks, 2}});
    dtypes.insert(dtypes.end(), {kInt8, kInt8, kFloat32});
  }
  std::vector<torch::Tensor> out = unpack_arrays(sizes, dtypes);
  uint8_t* codes = out[0].data_ptr<uint8_t>();
  float *scales = out[1].data_ptr<float>(), *mins = out[2].data_ptr<float>();
  int8_t *scale_factors = nullptr, *min_factors = nullptr;
  float* supers = nullptr;
  if constexpr (T::kFactored) {
    scale_factors = out[3].data_ptr<int8_t>();
    min_factors = out[4].data_ptr<int8_t>();
    supers = out[5].data_ptr<float>();
  }
  // NOTE: chunks of at least ~64 KB of the file: a claim per row of a small tensor would
  // cost more than its blocks
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (row_blocks * T::kBytes + 1));
  parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      for (int64_t g = 0; g < row_blocks; ++g) {
        const int64_t n = r * row_blocks + g;  // this GGUF block's place in the outputs
        const BlockOut o{codes + n * T::kWeights, scales + n * subs, mins + n * subs,
                         T::kFactored ? scale_factors + n * subs : nullptr,
                         T::kFactored ? min_factors + n * subs : nullptr,
                         T::kFactored ? supers + 2 * n : nullptr};
        T::decode(sources[r] + g * T::kBytes, o);
      }
    }
  });
  return out;
}

// Unpacks into `out` if `type` is T's.
template <typename T>
bool unpack_if(int64_t type, const std::vector<const uint8_t*>& sources, int64_t row_bytes,
               std::vector<torch::Tensor>& out) {
  if (type != T::kType) return false;
  TORCH_CHECK(row_bytes % T::kBytes == 0, "rows of ", row_bytes, " bytes are not whole blocks of ",
              T::kBytes);
  out = unpack_rows<T>(sources, row_bytes / T::kBytes);
  return true;
}

template <typename... Types>
std::vector<torch::Tensor> unpack_type(int64_t type, const std::vector<const uint8_t*>& sources,
                                       int64_t row_bytes) {
  std::vector<torch::Tensor> out;
  const bool known = (unpack_if<Types>(type, sources, row_bytes, out) || ...);
  TORCH_CHECK(known, "GGUF type ", type, " has no block unpacking (supported: Q4_0, Q4_1, "
              "Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL)");
  return out;
}

// ---- a GGUF tensor's fp32 values, straight from its blocks ----------------------------

// One row of row_blocks GGUF blocks of type T -> its values w = d u + m (the scale and min
// of each block of L), through T::decode on the stack. NOTE (same values): gguf-py's
// dequantize computes each value as one product of exact factors (d (q - 8)) or as
// d' q - m' with d' = d sc and m' = dmin mn (the K-quants, Q4_1, Q5_1): d u is exact (an
// fp16 times small integers fits fp32's 24 bits), so d u + m rounds as theirs does, fused
// into an FMA or not; only a zero's sign can differ (+0 where theirs is -0).
template <typename T>
void dequantize_row(const uint8_t* row, int64_t row_blocks, float* out) {
  constexpr int64_t subs = T::kWeights / T::kLen;
  alignas(64) uint8_t codes[T::kWeights];
  float scales[subs], mins[subs], supers[2];
  int8_t scale_factors[subs], min_factors[subs];
  const BlockOut o{codes, scales, mins, scale_factors, min_factors, supers};
  for (int64_t g = 0; g < row_blocks; ++g, out += T::kWeights) {
    T::decode(row + g * T::kBytes, o);
    if constexpr (T::kType == QUANT_CODES_IQ4_NL)  // its indices kept: the codes looked up
      for (uint8_t& code : codes) code = IQ4_NL_CODES[code];
    for (int64_t k = 0; k < subs; ++k)
      for (int64_t i = 0; i < T::kLen; ++i)
        out[k * T::kLen + i] = scales[k] * float(codes[k * T::kLen + i]) + mins[k];
  }
}

// A type's row dequantizer, its block bytes and weights.
struct RowDequantizer {
  void (*row)(const uint8_t*, int64_t, float*);
  int64_t bytes, weights;
};

template <typename T>
bool dequantizer_if(int64_t type, RowDequantizer& out) {
  if (type != T::kType) return false;
  out = {&dequantize_row<T>, T::kBytes, T::kWeights};
  return true;
}

template <typename... Types>
RowDequantizer dequantizer_of(int64_t type) {
  RowDequantizer out{};
  const bool known = (dequantizer_if<Types>(type, out) || ...);
  TORCH_CHECK(known, "GGUF type ", type, " has no block dequantizing (supported: Q4_0, Q4_1, "
              "Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL)");
  return out;
}

// Each of a part's rows' bytes, in the order asked (GgufRows).
void append_rows(const GgufRows& part, int64_t row_bytes, std::vector<const uint8_t*>& sources) {
  TORCH_CHECK(part.rows >= 0, "a part of ", part.rows, " rows");
  if (!part.order.has_value()) {
    for (int64_t r = 0; r < part.rows; ++r) sources.push_back(part.data + r * row_bytes);
    return;
  }
  const torch::Tensor index = part.order->to(kInt64).contiguous();
  TORCH_CHECK(index.dim() == 1 && index.numel() == part.rows, "order must be (", part.rows,
              ",)");
  check_indices(index, part.rows, "order");
  const int64_t* order = index.data_ptr<int64_t>();
  for (int64_t r = 0; r < part.rows; ++r) sources.push_back(part.data + order[r] * row_bytes);
}

}  // namespace

torch::Tensor dequantize_gguf_blocks(const std::vector<GgufTypedRows>& parts) {
  TORCH_CHECK(!parts.empty(), "at least one part");
  std::vector<const uint8_t*> sources;  // each output row's bytes, parts in turn
  std::vector<RowDequantizer> kinds;    // and its type's dequantizer
  int64_t cols = -1;
  for (const GgufTypedRows& part : parts) {
    const RowDequantizer kind =
        dequantizer_of<Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL>(
            part.type);
    TORCH_CHECK(part.row_bytes >= 0 && part.row_bytes % kind.bytes == 0, "rows of ",
                part.row_bytes, " bytes are not whole blocks of ", kind.bytes);
    const int64_t part_cols = part.row_bytes / kind.bytes * kind.weights;
    TORCH_CHECK(cols < 0 || part_cols == cols, "the parts' rows must hold as many weights (",
                cols, " and ", part_cols, ")");
    cols = part_cols;
    append_rows(part.rows, part.row_bytes, sources);
    kinds.resize(sources.size(), kind);
  }
  const int64_t rows = int64_t(sources.size());
  torch::Tensor out = unpack_arrays({{rows, cols}}, {kFloat32})[0];
  float* values = out.data_ptr<float>();
  // NOTE: chunks of at least ~256 KB of output: a claim per row of a small tensor would cost
  // more than its values
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (cols + 1));
  parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r)
      kinds[r].row(sources[r], cols / kinds[r].weights, values + r * cols);
  });
  return out;
}

std::vector<torch::Tensor> unpack_gguf_blocks(const std::vector<GgufRows>& parts,
                                              int64_t row_bytes, int64_t type) {
  TORCH_CHECK(row_bytes >= 0, "rows of ", row_bytes, " bytes");
  std::vector<const uint8_t*> sources;  // each output row's bytes, parts in turn
  for (const GgufRows& part : parts) append_rows(part, row_bytes, sources);
  return unpack_type<Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL>(
      type, sources, row_bytes);
}

namespace {

// Q8_0's 34 bytes of the 32 fp32 values x (quantize_q8_0); false where one is a NaN or an
// infinity. NOTE: std::round rounds half away from zero; a block whose d is below fp32's
// normals (1 / d infinite: its fp16 d is 0) gets codes 0, as numpy's cast gives them.
inline bool quantize_q8_0_block(const float* x, uint8_t* block) {
  constexpr int64_t n = Q8_0::kWeights;
#if defined(__AVX512F__)
  // The same operations on 16 lanes: |x|'s maximum (exact, any order), x * (1 / d), and
  // round half away from zero as trunc plus the sign where the dropped part is >= 0.5.
  const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
  const __m512 zero = _mm512_setzero_ps();
  const bool finite = _mm512_cmp_ps_mask(_mm512_sub_ps(lo, lo), zero, _CMP_EQ_OQ) == 0xFFFF &&
                      _mm512_cmp_ps_mask(_mm512_sub_ps(hi, hi), zero, _CMP_EQ_OQ) == 0xFFFF;
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
#else
  bool finite = true;
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    finite &= std::isfinite(x[i]);
    amax = std::max(amax, std::fabs(x[i]));
  }
#endif
  const float d = amax / 127.f;
  const float inverse = d == 0.f ? 0.f : 1.f / d;
  const uint16_t bits = c10::Half(d).x;
  std::memcpy(block, &bits, sizeof bits);
#if defined(__AVX512F__)
  const __m512 scale = _mm512_set1_ps(inverse), half = _mm512_set1_ps(0.5f);
  const __m512i sign_bit = _mm512_set1_epi32(int32_t(0x80000000u));
  const __m512i one = _mm512_castps_si512(_mm512_set1_ps(1.f));
  for (int v = 0; v < 2; ++v) {
    const __m512 p = _mm512_mul_ps(v ? hi : lo, scale);
    const __m512 whole = _mm512_roundscale_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __mmask16 up =
        _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(p, whole)), half, _CMP_GE_OQ);
    const __m512 step = _mm512_castsi512_ps(
        _mm512_or_si512(one, _mm512_and_si512(_mm512_castps_si512(p), sign_bit)));
    const __m512 q = _mm512_mask_add_ps(whole, up, whole, step);
    const __mmask16 held = _mm512_cmp_ps_mask(_mm512_abs_ps(q), _mm512_set1_ps(127.f),
                                              _CMP_LE_OQ);  // false for NaN, infinity
    const __m512i codes = _mm512_maskz_cvttps_epi32(held, q);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(block + 2 + 16 * v),
                     _mm512_cvtepi32_epi8(codes));
  }
#else
  for (int64_t i = 0; i < n; ++i) {
    const float q = std::round(x[i] * inverse);
    block[2 + i] = std::isfinite(q) ? uint8_t(int8_t(q)) : 0;
  }
#endif
  return finite;
}

}  // namespace

torch::Tensor quantize_q8_0(const torch::Tensor& weight) {
  constexpr int64_t kWeights = Q8_0::kWeights, kBytes = Q8_0::kBytes;
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) % kWeights == 0,
              "weight must be (rows, cols), cols a multiple of 32");
  const torch::Tensor values = weight.contiguous();
  const int64_t rows = values.size(0), blocks = values.size(1) / kWeights;
  torch::Tensor out = torch::empty({rows, blocks * kBytes}, kUInt8);
  uint8_t* const raw = out.data_ptr<uint8_t>();
  std::atomic<bool> finite{true};
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (blocks * kWeights + 1));
  with_weight_values(values, [&](const auto* v) {
    parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
      float x[kWeights];
      bool all_finite = true;
      for (int64_t b = first * blocks; b < last * blocks; ++b) {
        widen_row(v + b * kWeights, kWeights, 1, x);
        all_finite &= quantize_q8_0_block(x, raw + b * kBytes);
      }
      if (!all_finite) finite = false;
    });
  });
  TORCH_CHECK(finite.load(), "weight has a NaN or infinite value: no Q8_0 block holds it");
  return out;
}

void release_unpack_memory() { unpack_memory().release(); }

int64_t unpack_memory_spare_bytes() { return int64_t(unpack_memory().spare_bytes()); }

}  // namespace slotserve::kernels
