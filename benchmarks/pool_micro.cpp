// benchmarks/pool_micro.py's harness: parallel_for (csrc/parallel.h) on the pool or on OpenMP
// over synthetic jobs, built apart from the kernels (this file and csrc/parallel.cpp only).
#include <torch/extension.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <thread>
#include <vector>
#include <sys/resource.h>

#include "parallel.h"

namespace {
using slotserve::kernels::parallel_for;

// `units` steps of dependent floating-point work (~1.1 ns each on a Zen 4 EPYC)
double spin_work(int64_t units) {
  double x = 1.0;
  for (int64_t i = 0; i < units; ++i) {
    x = x * 0.9999999 + 1e-7;
    asm volatile("" : "+x"(x));  // NOTE: kept, in order
  }
  return x;
}

double now_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

double cpu_us() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec * 1e6 + u.ru_utime.tv_usec + u.ru_stime.tv_sec * 1e6 +
         u.ru_stime.tv_usec;
}

// `calls` parallel_for(0, n, 1) calls, each index `units` of work; every `omp_every` calls
// (0: never) one at::parallel_for over 2 indices of `omp_units` each (a torch op between our
// kernels). spin: inside a SpinScope (as the decode stack). Returns {wall us per call, process
// CPU us per call}.
std::vector<double> jobs(int64_t calls, int64_t n, int64_t units, bool spin, int64_t omp_every,
                         int64_t omp_units) {
  std::vector<double> sink(n, 0.0);
  const double t0 = now_us(), c0 = cpu_us();
  {
    std::optional<slotserve::kernels::SpinScope> scope;
    if (spin) scope.emplace();
    for (int64_t c = 0; c < calls; ++c) {
      parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) sink[i] += spin_work(units);
      });
      if (omp_every > 0 && c % omp_every == omp_every - 1)
        at::parallel_for(0, 2, 1, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) sink[i] += spin_work(omp_units);
        });
    }
  }
  const double t1 = now_us(), c1 = cpu_us();
  return {(t1 - t0) / calls, (c1 - c0) / calls, sink[0]};
}

// Process CPU us spent while the caller sleeps `sleep_us` right after one parallel_for (how
// long the idle threads keep spinning: libgomp's ~8 ms, the pool's 200 us in a SpinScope).
double idle_cpu(int64_t sleep_us, bool spin) {
  std::vector<double> sink(2, 0.0);
  {
    std::optional<slotserve::kernels::SpinScope> scope;
    if (spin) scope.emplace();
    parallel_for(0, 2, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) sink[i] += spin_work(20000);
    });
  }
  const double c0 = cpu_us();
  std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
  return cpu_us() - c0 + 0 * sink[0];
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("jobs", &jobs, py::call_guard<py::gil_scoped_release>());
  m.def("idle_cpu", &idle_cpu, py::call_guard<py::gil_scoped_release>());
  m.def("set_thread_pool", &slotserve::kernels::set_thread_pool);
  m.def("pool_worker_chunks", &slotserve::kernels::pool_worker_chunks);
}
