// The thread pool behind parallel_for (parallel.h): persistent workers, one fewer than
// at::get_num_threads() (the calling thread works too), chunks claimed through one atomic.
//
// NOTE (the claim word): `claim_` packs the current job's generation (high 48 bits) and the
// next unclaimed chunk (low 16). A thread claims chunk i of generation g by a compare-exchange
// from (g, i) to (g, i + 1), and only while i < the job's chunk count. The job's fields
// (`body_`, `ctx_`, `chunks_`) are written by the caller before it publishes (g, 0) with a
// release store; a worker reads them after an acquire load of the claim word (so it sees g's
// fields or a newer job's) and uses them only if its compare-exchange on that same (g, i)
// then succeeds.
// NOTE (closing a job: the hang once seen in the full suite): a finished job's word stays (g, chunks_g)
// until the next job is published. Before this was closed, a worker that read (g, chunks_g)
// and was descheduled before reading chunks_ could read the NEXT job's (larger) chunk count,
// written but not yet published, find chunks_g < it, and claim (g, chunks_g) -> (g, chunks_g
// + 1) successfully: it ran a chunk of the next job that its own claims would run again and
// added one to its `done_`, which then passed the chunk count, and the caller, waiting for
// done_ == chunks, slept for ever (the engine thread in wait_until_done, the worker in
// wait_for_job; tests/model/test_parallel_pool.py's race test widens both windows). Now a
// caller first CLOSES the last job, storing (g, INDEX_MASK) (no chunk count reaches it:
// chunks < INDEX_MASK), then a release fence, then writes the new fields; a worker reads
// the fields, then an acquire fence, then compare-exchanges. If any field it read is the new
// job's, the fences order the close before its compare-exchange, which so fails; if all are
// g's, its (g, i) names g's chunk i under g's chunk count, claimed at most once because the
// index only grows within a generation and generations never repeat (48 bits).
// NOTE (the end): the caller returns when `done_` (chunks finished, counted after each ran)
// reaches the job's chunk count, not when the workers have arrived: a worker that never woke
// costs nothing, one descheduled mid-chunk costs that chunk. Only a successful claim of the
// current job adds to done_ (the close above), so done_ counts each of its chunks once and
// reaches exactly the chunk count, after the last chunk's last touch of the job.
#include "parallel.h"

#include <ATen/Parallel.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace slotserve::kernels {
namespace {

constexpr int INDEX_BITS = 16;
constexpr uint64_t INDEX_MASK = (uint64_t(1) << INDEX_BITS) - 1;

// NOTE (spinning): after its last chunk a worker spins DEFAULT_SPIN_US, then sleeps. A decode
// step's regions come microseconds apart and waking a sleeping thread takes tens of them (the
// quiet engine lost half its speed to OMP_WAIT_POLICY=PASSIVE when OpenMP ran these kernels).
// It spins on the core (pause) for DEFAULT_PAUSE_US, then yields the core between checks
// (sched_yield). Yielding: torch's own OpenMP regions (prefill's attention: bmm, softmax) run
// between our kernels on the same cores and wait for every one of their threads, and a worker
// of ours spinning on the core an OpenMP thread was queued on held that region back for a
// time slice (profiled: ~4 ms a bmm). Beside a spinning process, 64 x 32 tokens of SmolLM2 in
// bf16 (interleaved, one process): 595-885 tok/s pausing throughout, 730-1080 yielding.
// Pausing first: a worker that only yielded was slow to see a job of a few microseconds (a
// 1-row matmul of 30 panels: 16.5 us, 10.5 with 20 us of pausing first, OpenMP 10.0).
constexpr int64_t DEFAULT_SPIN_US = 200, DEFAULT_PAUSE_US = 20;
std::atomic<int64_t> spin_us{DEFAULT_SPIN_US};  // set_pool_tuning
std::atomic<int64_t> pause_us{DEFAULT_PAUSE_US};
// NOTE (the caller's wait): with every chunk claimed, the caller spins this long on the
// chunks still running on workers, then sleeps until the last one ends. A worker that is
// running ends its chunk within microseconds; one descheduled mid-chunk (its core shared with
// another process) waits behind that process for a time slice (milliseconds), unless a core
// goes idle: the caller's sleep idles its own core, and the kernel moves the worker there.
constexpr int64_t DEFAULT_CALLER_SPIN_US = 50;
std::atomic<int64_t> caller_spin_us{DEFAULT_CALLER_SPIN_US};
// NOTE (outside a SpinScope): a worker pauses this long on the core, then sleeps. Spinning
// there (yielding included) cost the quiet engine ~10% (SmolLM2 bf16, 64 x 32 tokens: 1377
// tok/s against OpenMP's 1554): prefill's torch ops waited for an OpenMP thread queued behind
// our spinning worker (an aten::add 314 us against 54).
constexpr int64_t DEFAULT_COLD_SPIN_US = 5;
std::atomic<int64_t> cold_spin_us{DEFAULT_COLD_SPIN_US};
std::atomic<int> spin_scopes{0};  // SpinScopes alive
// set_pool_race_delays (tests): a worker's wait between reading the claim word and the job
// it names, a caller's between writing a job and publishing it
std::atomic<int64_t> claim_delay_us{0}, publish_delay_us{0};

inline void test_delay(const std::atomic<int64_t>& us) {
  if (const int64_t wait = us.load(std::memory_order_relaxed))
    std::this_thread::sleep_for(std::chrono::microseconds(wait));
}

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

thread_local bool in_pool_worker = false;
thread_local bool in_pool_call = false;  // a caller, while its job runs

class Pool {
 public:
  explicit Pool(int64_t threads) { resize(threads); }

  // Takes the pool for one job; false if another thread's job holds it.
  bool try_acquire() { return !busy_.exchange(true, std::memory_order_acquire); }
  void release() { busy_.store(false, std::memory_order_release); }

  // Runs the job on `threads` threads (the caller included); the pool must be acquired.
  void run(int64_t threads, int64_t chunks, ChunkBody body, const void* ctx) {
    if (int64_t(workers_.size()) != threads - 1) resize(threads);
    // NOTE (closing a job): no claim of the last job succeeds from here on, so no worker
    // runs, or counts in done_, a chunk of the job written below before it is published.
    claim_.store((generation_ << INDEX_BITS) | INDEX_MASK, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    body_.store(body, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    chunks_.store(chunks, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    test_delay(publish_delay_us);
    const uint64_t generation = ++generation_;
    // NOTE: seq_cst, paired with the sleepers' (wait_for_job): either this thread sees a
    // sleeper and wakes it, or the sleeper sees the new generation before it sleeps.
    claim_.store(generation << INDEX_BITS, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      { std::lock_guard<std::mutex> lock(mutex_); }
      wake_.notify_all();
    }
    work_on(generation);
    wait_until_done(chunks);
    if (error_) std::rethrow_exception(error_);
  }

  void set_paused(bool paused) {
    paused_flag_.store(paused);
    { std::lock_guard<std::mutex> lock(mutex_); paused_ = paused; }
    wake_.notify_all();
  }
  int64_t worker_chunks() const { return worker_chunks_.load(std::memory_order_relaxed); }

 private:
  static uint64_t generation_of(uint64_t word) { return word >> INDEX_BITS; }

  // Claims and runs chunks of job `generation` until none is left (or a newer job is up).
  void work_on(uint64_t generation) {
    uint64_t word = claim_.load(std::memory_order_acquire);
    while (generation_of(word) == generation) {
      const int64_t index = int64_t(word & INDEX_MASK);
      if (in_pool_worker) test_delay(claim_delay_us);
      const int64_t chunks = chunks_.load(std::memory_order_relaxed);
      const ChunkBody body = body_.load(std::memory_order_relaxed);
      const void* ctx = ctx_.load(std::memory_order_relaxed);
      // NOTE (closing a job): paired with the caller's release fence; a field of a newer
      // job read above makes the compare-exchange below see that job's close, and fail
      std::atomic_thread_fence(std::memory_order_acquire);
      if (index >= chunks) return;
      if (!claim_.compare_exchange_weak(word, word + 1, std::memory_order_acquire,
                                        std::memory_order_acquire))
        continue;  // another thread claimed (g, index), or a newer job is up: `word` reloaded
      try {
        body(ctx, index);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      if (in_pool_worker) worker_chunks_.fetch_add(1, std::memory_order_relaxed);
      // NOTE: the last touch of this job: after it the caller may return. seq_cst, paired
      // with the caller's (wait_until_done): either the caller sees the count, or the thread
      // that ends the job sees it sleeping and wakes it.
      if (done_.fetch_add(1, std::memory_order_seq_cst) + 1 == chunks &&
          caller_sleeping_.load(std::memory_order_seq_cst)) {
        { std::lock_guard<std::mutex> lock(done_mutex_); }
        done_cv_.notify_all();
      }
      word = claim_.load(std::memory_order_acquire);
    }
  }

  void wait_until_done(int64_t chunks) {
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::microseconds(caller_spin_us.load(std::memory_order_relaxed));
    for (int spins = 1; done_.load(std::memory_order_acquire) != chunks; ++spins) {
      if (spins % 64 == 0 && std::chrono::steady_clock::now() >= deadline) {
        std::unique_lock<std::mutex> lock(done_mutex_);
        caller_sleeping_.store(true, std::memory_order_seq_cst);
        done_cv_.wait(lock, [&] { return done_.load(std::memory_order_seq_cst) == chunks; });
        caller_sleeping_.store(false, std::memory_order_relaxed);
        break;
      }
      cpu_relax();
    }
    std::lock_guard<std::mutex> lock(error_mutex_);  // error_ as the workers left it
  }

  // The generation of a job newer than `seen`, or 0 when the worker must stop.
  uint64_t wait_for_job(uint64_t seen) {
    const auto start = std::chrono::steady_clock::now();
    const bool hot = spin_scopes.load(std::memory_order_relaxed) > 0;
    const int64_t pause = (hot ? pause_us : cold_spin_us).load(std::memory_order_relaxed);
    const int64_t spin = hot ? spin_us.load(std::memory_order_relaxed) : pause;
    const auto pausing = start + std::chrono::microseconds(pause);
    const auto deadline = start + std::chrono::microseconds(spin);
    bool yielding = false;
    for (int spins = 1;; ++spins) {
      const uint64_t generation = generation_of(claim_.load(std::memory_order_acquire));
      if (generation != seen && !paused_flag_.load(std::memory_order_relaxed)) return generation;
      if (yielding || spins % 64 == 0) {
        const auto now = std::chrono::steady_clock::now();
        if (now >= deadline) break;
        if (hot && spin_scopes.load(std::memory_order_relaxed) == 0) break;  // the stack ended
        yielding = now >= pausing;
      }
      if (yielding) std::this_thread::yield();  // NOTE (spinning)
      else cpu_relax();
    }
    std::unique_lock<std::mutex> lock(mutex_);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    uint64_t generation;
    wake_.wait(lock, [&] {
      generation = generation_of(claim_.load(std::memory_order_seq_cst));
      return stop_ || (generation != seen && !paused_);
    });
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    return stop_ ? 0 : generation;
  }

  void worker_main(uint64_t seen) {
    in_pool_worker = true;
    while (const uint64_t generation = wait_for_job(seen)) {
      seen = generation;
      work_on(generation);
    }
  }

  // Stops the workers and starts threads - 1 new ones (between jobs, the pool acquired).
  void resize(int64_t threads) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
    workers_.clear();
    stop_ = false;
    const uint64_t seen = generation_;
    for (int64_t i = 1; i < threads; ++i)
      workers_.emplace_back([this, seen] { worker_main(seen); });
  }

  // the current job: see the NOTEs at the top
  std::atomic<uint64_t> claim_{0};
  std::atomic<ChunkBody> body_{nullptr};
  std::atomic<const void*> ctx_{nullptr};
  std::atomic<int64_t> chunks_{0};
  std::atomic<int64_t> done_{0};
  uint64_t generation_ = 0;  // the last job's; written by the pool's holder only
  std::mutex error_mutex_;
  std::exception_ptr error_;
  std::atomic<bool> busy_{false};
  std::mutex done_mutex_;  // the caller's sleep until done_ == chunks
  std::condition_variable done_cv_;
  std::atomic<bool> caller_sleeping_{false};

  // sleeping and waking; stop_ and paused_ are written under mutex_
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};
  bool stop_ = false;
  bool paused_ = false;
  std::atomic<bool> paused_flag_{false};  // paused_, read while spinning
  std::atomic<int64_t> worker_chunks_{0};
  std::vector<std::thread> workers_;
};

// NOTE: made once and never destroyed: its workers may still spin while the process exits.
// A forked child has none of the parent's threads: it makes a pool of its own.
std::atomic<Pool*> the_pool{nullptr};
std::once_flag fork_handler_once;

Pool& pool() {
  Pool* existing = the_pool.load(std::memory_order_acquire);
  if (existing) return *existing;
  static std::mutex creating;
  std::lock_guard<std::mutex> lock(creating);
  std::call_once(fork_handler_once, [] {
    pthread_atfork(nullptr, nullptr, [] { the_pool.store(nullptr); });
  });
  if (!the_pool.load()) the_pool.store(new Pool(pool_threads()));
  return *the_pool.load();
}

}  // namespace

int64_t pool_threads() { return std::max(1, at::get_num_threads()); }

namespace {
// Where parallel_for runs its ranges (parallel.h's NOTE (where the pool runs)).
enum class PoolMode { kOff, kAuto, kEverywhere };

// The mode SLOTSERVE_THREAD_POOL names for a pool that is on: "1" everywhere, else auto.
PoolMode on_mode_from_environment() {
  const char* value = std::getenv("SLOTSERVE_THREAD_POOL");
  return value != nullptr && std::string(value) == "1" ? PoolMode::kEverywhere : PoolMode::kAuto;
}
PoolMode mode_from_environment() {
  const char* value = std::getenv("SLOTSERVE_THREAD_POOL");
  if (value != nullptr && std::string(value) == "0") return PoolMode::kOff;
  return on_mode_from_environment();
}
std::atomic<PoolMode> pool_mode{mode_from_environment()};

// NOTE (busy neighbours): the CPU time other processes took over the last window on the
// CPUs this process may run on: /proc/stat's busy time of those CPUs less this process's
// own (getrusage). Busy from BUSY_CORES of a core, quiet again below QUIET_CORES (between
// the two the verdict stands: /proc/stat counts in ticks of 10 ms, ~0.1 core over a window
// of 200 ms on 2 CPUs). Refreshed at most once a window by whichever caller finds it stale
// (try_lock: the others read the last verdict); where /proc/stat cannot be read (not
// Linux) the verdict is "busy": every range on the pool, as SLOTSERVE_THREAD_POOL=1.
constexpr auto NEIGHBOUR_WINDOW = std::chrono::milliseconds(200);
constexpr double BUSY_CORES = 0.3, QUIET_CORES = 0.15;

class Neighbours {
 public:
  bool busy() {
    const int64_t now = now_ns();
    if (now - checked_ns_.load(std::memory_order_relaxed) >= window_ns() && mutex_.try_lock()) {
      std::lock_guard<std::mutex> lock(mutex_, std::adopt_lock);
      refresh(now);
    }
    return busy_.load(std::memory_order_relaxed);
  }

 private:
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  static int64_t window_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(NEIGHBOUR_WINDOW).count();
  }
  // The busy time (user, nice, system, irq, softirq; not idle, iowait, steal) of the CPUs
  // this process may run on, in seconds; < 0 if /proc/stat cannot be read.
  static double system_busy_s() {
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    const bool masked = sched_getaffinity(0, sizeof(allowed), &allowed) == 0;
    std::FILE* stat = std::fopen("/proc/stat", "r");
    if (!stat) return -1;
    unsigned long long busy = 0;
    bool any = false;
    char line[512];
    while (std::fgets(line, sizeof(line), stat)) {
      if (std::strncmp(line, "cpu", 3) != 0 || line[3] < '0' || line[3] > '9') continue;
      int cpu = -1;  // a "cpuN" line (not the total, not the lines after the CPUs)
      unsigned long long user, nice, system, idle, iowait, irq, softirq;
      if (std::sscanf(line, "cpu%d %llu %llu %llu %llu %llu %llu %llu", &cpu, &user, &nice,
                      &system, &idle, &iowait, &irq, &softirq) != 8)
        continue;
      if (masked && (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &allowed))) continue;
      busy += user + nice + system + irq + softirq;
      any = true;
    }
    std::fclose(stat);
    static const double tick = 1.0 / double(sysconf(_SC_CLK_TCK));
    return any ? double(busy) * tick : -1;
  }
  static double own_s() {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    return double(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
           1e-6 * double(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec);
  }
  void refresh(int64_t now) {
    const double system = system_busy_s(), own = own_s();
    if (system >= 0 && system_s_ >= 0 && now > checked_ns_.load()) {
      const double cores = ((system - system_s_) - (own - own_s_)) /
                           (double(now - checked_ns_.load()) * 1e-9);
      if (cores > BUSY_CORES) busy_.store(true, std::memory_order_relaxed);
      if (cores < QUIET_CORES) busy_.store(false, std::memory_order_relaxed);
    } else if (system < 0) {
      busy_.store(true, std::memory_order_relaxed);
    }
    system_s_ = system;
    own_s_ = own;
    checked_ns_.store(now, std::memory_order_relaxed);
  }

  std::mutex mutex_;
  std::atomic<int64_t> checked_ns_{0};
  std::atomic<bool> busy_{false};
  double system_s_ = -1, own_s_ = 0;  // at the last check, under mutex_
};
Neighbours neighbours;
}  // namespace

bool thread_pool_on() { return pool_mode.load(std::memory_order_relaxed) != PoolMode::kOff; }
void set_thread_pool(bool on) {
  pool_mode.store(on ? on_mode_from_environment() : PoolMode::kOff, std::memory_order_relaxed);
}

bool run_on_pool() {
  // NOTE: a nested range stays where its outer range runs, which runs it inline (parallel.h)
  if (in_pool_worker || in_pool_call) return true;
  if (at::in_parallel_region()) return false;
  switch (pool_mode.load(std::memory_order_relaxed)) {
    case PoolMode::kOff:
      return false;
    case PoolMode::kEverywhere:
      return true;
    case PoolMode::kAuto:
      break;
  }
  return neighbours.busy();
}

void set_pool_tuning(int64_t spin, int64_t pause, int64_t caller_spin, int64_t cold_spin) {
  if (spin >= 0) spin_us.store(spin);
  if (pause >= 0) pause_us.store(pause);
  if (caller_spin >= 0) caller_spin_us.store(caller_spin);
  if (cold_spin >= 0) cold_spin_us.store(cold_spin);
}

SpinScope::SpinScope() { spin_scopes.fetch_add(1, std::memory_order_relaxed); }
SpinScope::~SpinScope() { spin_scopes.fetch_sub(1, std::memory_order_relaxed); }

void run_chunks(int64_t chunks, ChunkBody body, const void* ctx) {
  const int64_t threads = pool_threads();
  if (threads > 1 && !in_pool_worker && chunks < int64_t(INDEX_MASK)) {  // NOTE (closing)
    Pool& p = pool();
    if (p.try_acquire()) {
      struct Release {
        Pool& p;
        ~Release() {
          in_pool_call = false;
          p.release();
        }
      } holding{p};
      in_pool_call = true;
      p.run(threads, chunks, body, ctx);
      return;
    }
  }
  for (int64_t i = 0; i < chunks; ++i) body(ctx, i);  // nested, busy or one thread: inline
}

void set_pool_race_delays(int64_t claim_us, int64_t publish_us) {
  claim_delay_us.store(std::max<int64_t>(claim_us, 0));
  publish_delay_us.store(std::max<int64_t>(publish_us, 0));
}

void set_pool_workers_paused(bool paused) { pool().set_paused(paused); }

int64_t pool_worker_chunks() { return pool().worker_chunks(); }

void pool_cover(int32_t* counts, int64_t n, int64_t grain, bool nested, int64_t throw_at) {
  auto cover = [&](int64_t begin, int64_t end) {
    // NOTE: the grain is the pool's promise (at::parallel_for may cut a shorter last chunk)
    const bool on_pool = in_pool_worker || in_pool_call;
    if (on_pool && !nested && end - begin < grain && end - begin < n)
      throw std::runtime_error("pool_cover: a chunk shorter than the grain");
    for (int64_t i = begin; i < end; ++i) {
      if (i == throw_at) throw std::runtime_error("pool_cover: index " + std::to_string(i));
      __atomic_fetch_add(counts + i, 1, __ATOMIC_RELAXED);  // a doubled index still counts
    }
  };
  if (nested)
    parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      parallel_for(begin, end, 1, cover);
    });
  else
    parallel_for(0, n, grain, cover);
}

}  // namespace slotserve::kernels
