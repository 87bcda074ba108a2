// parallel_for: the kernels' own thread pool, in place of at::parallel_for (OpenMP) while
// other processes busy the CPUs (NOTE (where the pool runs)).
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

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <utility>

namespace slotserve::kernels {

// A job's chunk: runs chunk `index` of the job behind `ctx` (a parallel_for's range and fn).
using ChunkBody = void (*)(const void* ctx, int64_t index);

// Runs body(ctx, i) once for every i in [0, chunks), on the calling thread and the pool's
// workers, and returns when all have run (see parallel.cpp).
void run_chunks(int64_t chunks, ChunkBody body, const void* ctx);

// The threads a range may run on, the caller included: at::get_num_threads().
int64_t pool_threads();

// NOTE (where the pool runs): on by default; SLOTSERVE_THREAD_POOL=0 (when the kernels load)
// or set_thread_pool(false) runs every range on at::parallel_for (OpenMP), as before the pool.
// On, a range runs on the pool while other processes take CPU time on this process's CPUs
// (over 0.3 of a core in the last 200 ms: parallel.cpp's NOTE (busy neighbours)), else on
// at::parallel_for. Why not the pool always: torch's own ops (prefill's attention, adds,
// sampling) run on OpenMP between our kernels, and after each one OpenMP's idle thread spins
// on a core for ~8 ms (libgomp's default wait): on a quiet machine it is hot and free for
// our ranges, and a pool worker of ours beside it gets only part of a core (pool_micro.py:
// 64 chunks of 3 us with an OpenMP region between calls, 168-170 us a call on OpenMP,
// 234-274 on the pool; the engine's prefill of 64 x 32 tokens 0.84 s against 1.25 s, its
// decode 2-5% slower, the pool everywhere x0.92 quiet in pool_ab). Beside a busy process
// every OpenMP region waits for its slowest thread, and the pool (the NOTE at the top) is
// faster everywhere.
// SLOTSERVE_THREAD_POOL=1 (set when set_thread_pool(true) is called, or when the kernels
// load) runs every range on the pool (tests, measurements).
bool thread_pool_on();
void set_thread_pool(bool on);
// Whether a range starting now runs on the pool (the NOTE above); cheap (a clock read).
bool run_on_pool();

// How a range is cut: in levels that halve, each level in `width` chunks but the last in
// chunks of one grain. Level l < last covers [n - (n >> l), n - (n >> (l + 1))), the last
// level the rest, [n - (n >> l), n).
// NOTE (why halving levels): the first chunks are big (few claims), the last small, so the
// threads end within a grain of each other. Equal chunks ended unevenly: 18 panels (a
// 576-wide matmul) in 8 chunks of 2 or 3 took 231 us at 64 rows where OpenMP's two halves
// took 207; chunks of one panel cost a claim each (a 1-row matmul of 30 panels: 11.8 us).
struct ChunkLevels {
  int64_t n, grain, width, levels, last_width;

  // The cut of n indices for `threads` threads, every chunk at least `grain` long; width 1:
  // run it whole.
  static ChunkLevels of(int64_t n, int64_t grain, int64_t threads) {
    const int64_t width = std::min(threads, n / grain);
    if (width <= 1) return {n, grain, 1, 1, 1};
    int64_t levels = 1;
    while (levels < 62 && (n >> levels) / width >= grain &&
           ((n >> (levels - 1)) - (n >> levels)) / width >= grain)
      ++levels;
    return {n, grain, width, levels, (n >> (levels - 1)) / grain};
  }
  int64_t chunks() const { return width * (levels - 1) + last_width; }
  // [first, last) of chunk i, relative to the range's begin
  std::pair<int64_t, int64_t> bounds(int64_t i) const {
    const int64_t level = std::min(i / width, levels - 1);
    const int64_t j = i - level * width, parts = level + 1 == levels ? last_width : width;
    const int64_t start = n - (n >> level);
    const int64_t stop = level + 1 == levels ? n : n - (n >> (level + 1));
    return {start + j * (stop - start) / parts, start + (j + 1) * (stop - start) / parts};
  }
};

// fn(b, e) over [begin, end) in chunks of at least `grain` indices (the invariants above).
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  if (!run_on_pool()) {
    at::parallel_for(begin, end, grain, fn);
    return;
  }
  const ChunkLevels cut = ChunkLevels::of(n, std::max<int64_t>(grain, 1), pool_threads());
  if (cut.width <= 1) {
    fn(begin, end);
    return;
  }
  struct Range {
    const F* fn;
    int64_t begin;
    ChunkLevels cut;
  };
  const Range range{&fn, begin, cut};
  run_chunks(cut.chunks(), [](const void* ctx, int64_t i) {
    const Range& r = *static_cast<const Range*>(ctx);
    const auto [first, last] = r.cut.bounds(i);
    (*r.fn)(r.begin + first, r.begin + last);
  }, &range);
}

// NOTE (spinning where it pays): the pool's workers spin between jobs only while a SpinScope
// is alive somewhere (DecodeStack::forward: hundreds of jobs microseconds apart, no torch op
// between them); elsewhere they pause briefly and sleep, so they leave the cores to torch's
// own OpenMP threads, whose ops (prefill's adds, bmm, softmax) run between our kernels there.
class SpinScope {
 public:
  SpinScope();
  ~SpinScope();
  SpinScope(const SpinScope&) = delete;
  SpinScope& operator=(const SpinScope&) = delete;
};

// Test hooks (tests/model/test_parallel_pool.py): while paused, a worker that wakes for a job
// waits before claiming any chunk (a worker descheduled by a busy neighbour, made certain),
// and the caller must finish the job alone.
void set_pool_workers_paused(bool paused);
// Widens the windows of a race (tests): a worker sleeps claim_us between reading the claim
// word and reading the job it names, a caller publish_us between writing a job's fields and
// publishing its generation (0: no wait, the default).
void set_pool_race_delays(int64_t claim_us, int64_t publish_us);
// Measurements: how long a worker spins before it sleeps, how much of that on the core before
// it yields the core between checks, how long a caller spins on its last chunks before it
// sleeps, how long a worker pauses before it sleeps outside any SpinScope (< 0: unchanged).
// The defaults: the DEFAULT_ constants in parallel.cpp.
void set_pool_tuning(int64_t spin_us, int64_t pause_us, int64_t caller_spin_us,
                     int64_t cold_spin_us);
// Chunks run so far by the pool's workers (not by callers).
int64_t pool_worker_chunks();
// counts[i] += 1 for every i in [0, n), through parallel_for(0, n, grain); nested: each chunk
// through a parallel_for of its own; an index == throw_at throws std::runtime_error, and so
// does a chunk shorter than the grain (not nested, run on the pool).
void pool_cover(int32_t* counts, int64_t n, int64_t grain, bool nested, int64_t throw_at);

}  // namespace slotserve::kernels
