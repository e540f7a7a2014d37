// The reduction kernels alone (dsp::reduceIntoWith), every build this CPU
// has: two sources combined into a third buffer, all three in L1/L2, as the
// one-shot all-reduce of a few hundred KiB does.
//
//   dsp_reduce_kernels [ELEMENTS]   (default 32768; one line per build and dtype)
//
// Per line: the median of 9 rounds of ns per element (each round at least
// 20 ms of calls), and the range. Build with -DDSP_BUILD_BENCHMARKS=ON.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "core/reduce.h"

int main(int argc, char** argv) {
  const size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 32768;
  const dsp::DType dtypes[] = {dsp::DType::kFloat32, dsp::DType::kBFloat16,
                               dsp::DType::kFloat16};
  for (const char* build : {"generic", "avx2", "avx512"}) {
    for (dsp::DType dt : dtypes) {
      const size_t es = dsp::elementSize(dt);
      // Zeros: finite in every dtype, so no NaN or subnormal path is timed.
      std::vector<char> a(n * es, 0), b(n * es, 0), out(n * es, 0);
      const void* srcs[] = {a.data(), b.data()};
      auto call = [&] {
        return dsp::reduceIntoWith(build, out.data(), srcs, 2, n, dt, dsp::ReduceOp::kSum,
                                   2);
      };
      if (!call()) break;  // this CPU lacks the build
      std::vector<double> rounds;
      for (int r = 0; r < 9; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        size_t calls = 0;
        std::chrono::duration<double, std::nano> spent{};
        while (spent.count() < 20e6) {
          for (int i = 0; i < 16; ++i) call();
          calls += 16;
          spent = std::chrono::steady_clock::now() - t0;
        }
        rounds.push_back(spent.count() / (static_cast<double>(calls) * n));
      }
      std::sort(rounds.begin(), rounds.end());
      std::printf("%-8s %-9s %zu elements: %.3f ns/element (%.3f-%.3f)\n", build,
                  dsp::dtypeName(dt), n, rounds[4], rounds.front(), rounds.back());
    }
  }
}
