#include "wait.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DSP_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define DSP_CPU_RELAX() asm volatile("yield")
#else
#define DSP_CPU_RELAX() ((void)0)
#endif

namespace dsp {
namespace {

// Budgets measured on the 2-core reference machine (benchmarks/collectives.py,
// 2 and 4 ranks). With a core per rank, a running peer arrives within a few
// microseconds; past that it is probably descheduled. With more ranks than
// cores, spinning only delays the peer, while a yield that finds nobody else
// runnable costs under a microsecond.
constexpr WaitPolicy kDedicatedCores{2000, 64, 0};
constexpr WaitPolicy kOversubscribed{16, 4000, 0};

// Shared (not FUTEX_PRIVATE) futexes: the word lives in memory mapped by
// several processes.
long futex(const std::atomic<uint32_t>* addr, int op, uint32_t val,
           const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<const uint32_t*>(addr), op, val, timeout,
                 nullptr, 0);
}

}  // namespace

bool oversubscribed(int ranks) {
  cpu_set_t set;
  CPU_ZERO(&set);
  int cpus = 0;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = CPU_COUNT(&set);
  if (cpus <= 0) cpus = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  return ranks > cpus;
}

WaitPolicy defaultWaitPolicy(bool oversubscribed) {
  return oversubscribed ? kOversubscribed : kDedicatedCores;
}

void advance(WaitWord& word, uint32_t value) {
  // seq_cst on both sides (this store, the sleeper's increment of `sleepers`
  // and its re-load of `value`) rules out the lost wake-up: either we see the
  // sleeper, or it sees the new value before it sleeps.
  word.value.store(value, std::memory_order_seq_cst);
  if (word.sleepers.load(std::memory_order_seq_cst) != 0) {
    futex(&word.value, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

void bump(WaitWord& word) {
  word.value.fetch_add(1, std::memory_order_seq_cst);
  if (word.sleepers.load(std::memory_order_seq_cst) != 0) {
    futex(&word.value, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

namespace detail {

bool spinThenYield(const WaitWord& word, uint32_t target, const WaitPolicy& policy,
                   std::chrono::steady_clock::time_point deadline) {
  for (int i = 0; i < policy.spins; ++i) {
    if (reached(word.value.load(std::memory_order_acquire), target)) return true;
    DSP_CPU_RELAX();
  }
  if (policy.spin_us > 0) {
    const auto until = std::min(deadline, std::chrono::steady_clock::now() +
                                              std::chrono::microseconds(policy.spin_us));
    do {
      for (int i = 0; i < 256; ++i) {
        if (reached(word.value.load(std::memory_order_acquire), target)) return true;
        DSP_CPU_RELAX();
      }
    } while (std::chrono::steady_clock::now() < until);
  }
  for (int i = 0; i < policy.yields; ++i) {
    if (reached(word.value.load(std::memory_order_acquire), target)) return true;
    // On a loaded machine one yield can last a whole time slice, and 4000 of
    // them seconds: the deadline bounds the yielding too.
    if (i % 64 == 63 && std::chrono::steady_clock::now() >= deadline) break;
    sched_yield();
  }
  return reached(word.value.load(std::memory_order_acquire), target);
}

void sleepOnce(const WaitWord& word, uint32_t observed, std::chrono::microseconds slice) {
  auto& w = const_cast<WaitWord&>(word);
  w.sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (w.value.load(std::memory_order_seq_cst) == observed) {
    timespec ts{};
    ts.tv_sec = static_cast<time_t>(slice.count() / 1000000);
    ts.tv_nsec = static_cast<long>((slice.count() % 1000000) * 1000);
    futex(&w.value, FUTEX_WAIT, observed, &ts);
  }
  w.sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

}  // namespace detail
}  // namespace dsp
