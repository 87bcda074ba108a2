// The Python module: every kernel entry point (ops.h) and the decode stack's classes
// (decode_stack.h). The only file that includes torch's Python binding headers (pybind11
// and Python): <torch/python.h>, not <torch/extension.h>, which adds all of libtorch's C++ API
// (~8 s of this file's compile).

#include <torch/python.h>

#include "decode_stack.h"
#include "ops.h"
#include "parallel.h"

using namespace slotserve::kernels;

// NOTE (the GIL): the long kernels below run with the GIL released (`release_gil`), so that
// the server's other Python threads (its event loop, tokenizer pool) run while a matmul or
// an argmax does. That is safe because, between the arguments' conversion and the result's
// (pybind11 does both with the GIL held, outside the guard), these functions touch no Python
// object: only torch tensors (libtorch, which needs no GIL: torch's own ops release it too),
// kept alive by the caller's references for the whole call, and C++ state that is either
// per thread (bf16_panels.cpp's thread_local activation buffer, AMX tile configuration) or
// initialised once thread-safely (amx_bf16_usable's function-local static). Two Python
// threads may call them at once (tests/model/test_kernels_gil.py); what they must not do is
// write a tensor another call reads, or flip set_force_plain_loops (a test switch, kept
// under the GIL) while a kernel runs. A failed check throws with the GIL released: the
// guard's destructor takes it back while unwinding, before pybind11 turns the error into a
// Python exception. Short calls (the fused norms, RoPE, packing at load) keep the GIL.
using release_gil = py::call_guard<py::gil_scoped_release>;

// GGUF tensors' raw blocks as the kernels read them. NOTE: buffers, not tensors: the
// loader's raw blocks are read-only views of the memory-mapped file (torch.from_numpy warns
// on those).
std::vector<GgufTypedRows> gguf_parts(const std::vector<py::buffer>& raws,
                                      const std::vector<int64_t>& types,
                                      const std::vector<c10::optional<torch::Tensor>>& orders) {
  TORCH_CHECK(!raws.empty() && orders.size() == raws.size() && types.size() == raws.size(),
              "one type and one order (or None) per part, and at least one part");
  std::vector<GgufTypedRows> parts;
  for (size_t i = 0; i < raws.size(); ++i) {
    const py::buffer_info info = raws[i].request();
    TORCH_CHECK(info.ndim == 2 && info.itemsize == 1 && info.strides[1] == 1 &&
                    (info.shape[0] <= 1 || info.strides[0] == info.shape[1]),
                "each part must be contiguous (rows, row bytes) uint8");
    parts.push_back({{static_cast<const uint8_t*>(info.ptr), info.shape[0], orders[i]},
                     types[i], info.shape[1]});
  }
  return parts;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (fp32)");
  m.def("add_rms_norm_", &add_rms_norm_, "x += delta in place, then RMSNorm of each row");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused (T, 2I) gate-up output");
  m.def("rotary_", &rotary_, "rotate-half RoPE in place");
  m.def("argmax_rows", &argmax_rows, release_gil(),
        "each row's argmax (first maximum, or first NaN)");
  m.def("write_kv_", &write_kv_, "store new K/V at their cache slots");
  m.def("int8_linear", &int8_linear, release_gil(),
        "x @ int8 weights (per-channel scales), int16 activations");
  m.def("pack_quant_blocks", &pack_quant_blocks,
        "GGUF blocks as codes (out, blocks, len) uint8, scales and mins (out, blocks) -> "
        "(packed codes, scales_mins) for quant_block_linear", py::arg("codes"),
        py::arg("scales"), py::arg("mins"), py::arg("bits"));
  m.def("pack_factored_scales", &pack_factored_scales,
        "the K-quants' int8 scale and min factors (out, blocks) and super-block scales "
        "(out, supers, 2, fp32 of fp16 values) -> the factored scales_mins of "
        "quant_block_linear's panels; min_factors None: the scale factors serve the mins",
        py::arg("scale_factors"), py::arg("min_factors"), py::arg("supers"));
  m.def(
      "unpack_gguf_blocks",
      [](const std::vector<py::buffer>& raws, int64_t type,
         const std::vector<c10::optional<torch::Tensor>>& orders) {
        const std::vector<GgufTypedRows> parts =
            gguf_parts(raws, std::vector<int64_t>(raws.size(), type), orders);
        std::vector<GgufRows> rows;
        for (const GgufTypedRows& part : parts) {
          TORCH_CHECK(part.row_bytes == parts[0].row_bytes, "the parts' rows must be as long");
          rows.push_back(part.rows);
        }
        return unpack_gguf_blocks(rows, parts[0].row_bytes, type);
      },
      "GGUF tensors' raw blocks (each (rows, row bytes), ggml type `type`), rows in turn -> "
      "[codes (rows, blocks, L) one a byte, scales, mins (rows, blocks) fp32] (+ "
      "[scale_factors, min_factors int8, supers (rows, super-blocks, 2)] for the K-quants); "
      "a part's row r is its raw row order[r] where its order is given",
      py::arg("raws"), py::arg("type"), py::arg("orders"));
  m.def(
      "dequantize_gguf_blocks",
      [](const std::vector<py::buffer>& raws, const std::vector<int64_t>& types,
         const std::vector<c10::optional<torch::Tensor>>& orders) {
        return dequantize_gguf_blocks(gguf_parts(raws, types, orders));
      },
      "GGUF tensors' raw blocks (each (rows, row bytes), of ggml type types[i]), rows in "
      "turn -> their fp32 values (rows, weights a row), as gguf-py's dequantize; a part's "
      "row r is its raw row order[r] where its order is given",
      py::arg("raws"), py::arg("types"), py::arg("orders"));
  m.def("quantize_q8_0", &quantize_q8_0, release_gil(),
        "a float (rows, cols) weight as GGUF Q8_0's raw blocks (rows, cols / 32 * 34) uint8, "
        "as gguf-py's quants.quantize writes them",
        py::arg("weight"));
  m.def("release_unpack_memory", &release_unpack_memory,
        "unmap the memory unpack_gguf_blocks keeps for the next call's arrays (a loading done)");
  m.def("unpack_memory_spare_bytes", &unpack_memory_spare_bytes,
        "bytes unpack_gguf_blocks keeps now for the next call's arrays");
  m.def("quant_block_linear", &quant_block_linear, release_gil(),
        "x @ W^T, W as pack_quant_blocks' blocks, x quantized per block to activation_bits "
        "(8, or 16 for 8-bit codes)",
        py::arg("x"), py::arg("codes"), py::arg("scales_mins"), py::arg("out_features"),
        py::arg("block_len"), py::arg("bits"), py::arg("activation_bits") = 8,
        py::arg("force_plain") = false);
  m.def("quant_block_rows", &quant_block_rows,
        "rows `ids` of W in pack_quant_blocks' blocks, dequantized to fp32 (an embedding lookup)",
        py::arg("codes"), py::arg("scales_mins"), py::arg("out_features"), py::arg("block_len"),
        py::arg("bits"), py::arg("ids"));
  m.def("quant_blocks_vectorised", &quant_blocks_vectorised,
        "whether quant_block_linear runs vectorised (AVX512-VNNI or AVX2)");
  m.def("quant_blocks_isa", &quant_blocks_isa,
        "quant_block_linear's path in this build: avx512vnni, avx2 or plain");
  m.def("pack_panels", &pack_panels,
        "weights (out, in; fp32, or bf16 / fp16 widened) as fp32 panels for panel_linear",
        py::arg("weight"), py::arg("out") = py::none());
  m.def("panel_linear", &panel_linear, release_gil(), "x @ W^T, W as pack_panels(W) (fp32)");
  m.def("panel_linear_vectorised", &panel_linear_vectorised,
        "whether panel_linear runs vectorised (AVX-512)");
  m.def("pack_panels_bf16", &pack_panels_bf16,
        "weights (out, in; fp32, bf16 or fp16) rounded to bf16, as panels for "
        "panel_linear_bf16",
        py::arg("weight"), py::arg("out") = py::none());
  m.def("panel_linear_bf16", &panel_linear_bf16, release_gil(),
        "x @ W^T, W as pack_panels_bf16(W), fp32 accumulation; activations fp32 or rounded "
        "to bf16", py::arg("x"), py::arg("panels"), py::arg("out_features"),
        py::arg("bf16_activations") = false);
  m.def("panel_linear_bf16_amx", &panel_linear_bf16_amx, release_gil(),
        "x @ W^T on AMX-BF16, W as pack_panels_bf16(W), x rounded to bf16, fp32 sums");
  m.def("amx_bf16_usable", &amx_bf16_usable, "whether panel_linear_bf16_amx runs here");
  m.def("panel_bf16_vectorised", &panel_bf16_vectorised,
        "(fp32-activation mode, bf16-activation mode) run vectorised (AVX-512F, AVX512_BF16)");
  m.def("set_force_plain_loops", &set_force_plain_loops,
        "tests: run the bf16 panel kernels' plain-loop fallbacks even where vectorised");
  m.def("paged_decode_attention", &paged_decode_attention,
        "one query per sequence over its paged K/V context (window > 0: its last `window` "
        "positions)", py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("window") = 0);
  m.def("set_thread_pool", &set_thread_pool,
        "true: parallel_for on the kernels' own thread pool while other processes busy this "
        "process's CPUs, else at::parallel_for (the default; SLOTSERVE_THREAD_POOL=1: the "
        "pool always); false: at::parallel_for always", py::arg("on"));
  m.def("thread_pool_on", &thread_pool_on, "whether parallel_for runs on the thread pool");
  m.def("set_pool_workers_paused", &set_pool_workers_paused,
        "tests: parallel_for's workers wait before claiming any chunk (the callers run all)");
  m.def("set_pool_race_delays", &set_pool_race_delays,
        "tests: a worker sleeps claim_us (us) between reading the claim word and the job it "
        "names, a caller publish_us between writing a job and publishing it (0: none)",
        py::arg("claim_us"), py::arg("publish_us"));
  m.def("pool_worker_chunks", &pool_worker_chunks,
        "tests: the chunks parallel_for's workers (not its callers) have run so far");
  m.def("set_pool_tuning", &set_pool_tuning,
        "measurements: parallel_for's workers' spin before they sleep (us), the first part of "
        "it on the core, not yielding it (us), its callers' spin on their last chunks before "
        "they sleep (us), the workers' pause before they sleep outside a decode stack (us); "
        "< 0: unchanged",
        py::arg("spin_us") = -1, py::arg("pause_us") = -1,
        py::arg("caller_spin_us") = -1, py::arg("cold_spin_us") = -1);
  m.def("pool_threads", &pool_threads, "the threads parallel_for runs a range on");
  m.def(
      "pool_cover",
      [](int64_t n, int64_t grain, bool nested, int64_t throw_at) {
        TORCH_CHECK(n >= 0, "n must be >= 0");
        auto counts = torch::zeros({n}, torch::kInt32);
        pool_cover(counts.data_ptr<int32_t>(), n, grain, nested, throw_at);
        return counts;
      },
      release_gil(),
      "tests: how many times parallel_for(0, n, grain) ran each index (nested: each chunk "
      "through a parallel_for of its own; the index throw_at throws)",
      py::arg("n"), py::arg("grain"), py::arg("nested") = false, py::arg("throw_at") = -1);
  // NOTE: module_local: a process may load two builds (a CPU class forced lower gets its
  // own, model/cpu_ops.py), and pybind11 registers a class's name once per process.
  py::class_<LinearWeights>(m, "LinearWeights", py::module_local());
  m.def("linear_weights", &make_linear, "a linear layer's weights for DecodeStack",
        py::arg("kind"), py::arg("a"), py::arg("b") = py::none(), py::arg("bias") = py::none(),
        py::arg("out_features") = -1, py::arg("amx_min_rows") = 0, py::arg("block_len") = 0,
        py::arg("bits") = 0, py::arg("activation_bits") = 8);
  m.def("segmented_linear_weights", &make_segments,
        "one linear layer for DecodeStack of segments (linear_weights each) whose outputs "
        "are concatenated", py::arg("segments"));
  py::class_<DecodeStack>(m, "DecodeStack", py::module_local())
      .def(py::init<int64_t, int64_t, int64_t, double, double, torch::Tensor>())
      .def("add_layer", &DecodeStack::add_layer, py::arg("input_norm"),
           py::arg("post_attention_norm"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"), py::arg("window") = 0, py::arg("q_norm") = py::none(),
           py::arg("k_norm") = py::none(), py::arg("pre_feedforward_norm") = py::none(),
           py::arg("post_feedforward_norm") = py::none(), py::arg("local_rope") = false)
      .def("set_lookup_tables", &DecodeStack::set_lookup_tables, py::arg("embedding"),
           py::arg("cos"), py::arg("sin"), py::arg("cos_local") = py::none(),
           py::arg("sin_local") = py::none())
      .def("set_block_embedding", &DecodeStack::set_block_embedding, py::arg("codes"),
           py::arg("scales_mins"), py::arg("block_len"), py::arg("bits"),
           "look the tokens up in these GGUF blocks (pack_quant_blocks') instead of the "
           "fp32 embedding table")
      .def("set_activation", &DecodeStack::set_activation,
           "the MLP's activation: silu, gelu or gelu_pytorch_tanh")
      .def("set_embedding_scale", &DecodeStack::set_embedding_scale,
           "the looked-up embeddings x this (Gemma's sqrt(H)); 0: none")
      .def("forward", &DecodeStack::forward, release_gil(),
           "all decoder layers and the final norm of an all-decode iteration");
}
