// parallel_for: the kernels' own thread pool, in place of at::parallel_for (OpenMP).
//
// NOTE (why not OpenMP): an OpenMP region splits its range statically, one part per thread,
// and ends at a barrier that every thread must reach. A decode step runs hundreds of regions;
// when another process busies one of the cores, the thread on that core gets a time slice
// only every few milliseconds, and every region waited for it: on a 2-core machine with one
// spinning neighbour the engine ran ~4x slower, where the lost core explains ~1.5x.
// Here a range is cut into chunks that the calling thread and the pool's workers claim one at
// a time; the caller returns when every chunk is DONE, whoever ran it. A worker that wakes
// late finds nothing left to claim, and the caller runs the whole range if it must.
//
// NOTE (invariants the kernels rely on):
// - fn(b, e) is called on disjoint chunks [b, e) that cover [begin, end) exactly once, each
//   at least `grain` long (a range shorter than 2 grains runs in one call, on the caller).
//   Which thread runs a chunk, and how the range is cut, vary with the thread count and the
//   timing: a kernel's result for an index must depend on that index only (each writes its
//   own outputs), never on the chunk it fell in.
// - fn runs on the calling thread or on a worker, never after parallel_for returned: the
//   caller's lambda (and everything it captures by reference) is alive for every call of it.
// - Called from inside a chunk (nested), or while another thread's call holds the pool (two
//   Python threads calling kernels at once), the range runs on the calling thread alone.
// - An exception thrown by fn is rethrown on the caller once every chunk has finished (the
//   first one thrown, if several were).
#pragma once

#include <algorithm>
#include <cstdint>

namespace slotserve::kernels {

// A job's chunk: runs chunk `index` of the job behind `ctx` (a parallel_for's range and fn).
using ChunkBody = void (*)(const void* ctx, int64_t index);

// Runs body(ctx, i) once for every i in [0, chunks), on the calling thread and the pool's
// workers, and returns when all have run (see parallel.cpp).
void run_chunks(int64_t chunks, ChunkBody body, const void* ctx);

// The threads a range may run on, the caller included: at::get_num_threads().
int64_t pool_threads();

// The most chunks a range is cut into: POOL_CHUNKS_PER_THREAD per thread (set_pool_tuning).
int64_t pool_max_chunks();

// fn(b, e) over [begin, end) in chunks of at least `grain` indices (the invariants above).
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t chunks =
      std::min(n / std::max<int64_t>(grain, 1), pool_max_chunks());
  if (chunks <= 1) {
    fn(begin, end);
    return;
  }
  struct Range {
    const F* fn;
    int64_t begin, n, chunks;
  };
  const Range range{&fn, begin, n, chunks};
  // chunk i: [begin + i n / chunks, begin + (i + 1) n / chunks), the sizes within one of each
  // other
  run_chunks(chunks, [](const void* ctx, int64_t i) {
    const Range& r = *static_cast<const Range*>(ctx);
    (*r.fn)(r.begin + i * r.n / r.chunks, r.begin + (i + 1) * r.n / r.chunks);
  }, &range);
}

// Test hooks (tests/model/test_parallel_pool.py): while paused, a worker that wakes for a job
// waits before claiming any chunk (a worker descheduled by a busy neighbour, made certain),
// and the caller must finish the job alone.
void set_pool_workers_paused(bool paused);
// Measurements (benchmarks/PERF.md): how long a worker spins before it sleeps, the chunks per
// thread, how long a caller spins on its last chunks before it sleeps (< 0: unchanged). The
// defaults: DEFAULT_SPIN_US, POOL_CHUNKS_PER_THREAD, DEFAULT_CALLER_SPIN_US (parallel.cpp).
void set_pool_tuning(int64_t spin_us, int64_t chunks_per_thread, int64_t caller_spin_us);
// Chunks run so far by the pool's workers (not by callers).
int64_t pool_worker_chunks();
// counts[i] += 1 for every i in [0, n), through parallel_for(0, n, grain); nested: each chunk
// through a parallel_for of its own; an index == throw_at throws std::runtime_error.
void pool_cover(int32_t* counts, int64_t n, int64_t grain, bool nested, int64_t throw_at);

}  // namespace slotserve::kernels
