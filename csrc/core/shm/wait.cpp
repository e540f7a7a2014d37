#include "wait.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

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

// Defaults measured on the 2-core reference machine: a peer that is running
// arrives within a few microseconds; past that it is probably descheduled and
// spinning only delays it.
constexpr int kDefaultSpins = 2000;
constexpr int kDefaultYields = 16;

std::atomic<int> gSpins{kDefaultSpins};
std::atomic<int> gYields{kDefaultYields};

// Shared (not FUTEX_PRIVATE) futexes: the word lives in memory mapped by
// several processes.
long futex(const std::atomic<uint32_t>* addr, int op, uint32_t val,
           const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<const uint32_t*>(addr), op, val, timeout,
                 nullptr, 0);
}

}  // namespace

void tuneWaiting(int spins, int yields) {
  gSpins.store(spins < 0 ? kDefaultSpins : spins);
  gYields.store(yields < 0 ? kDefaultYields : yields);
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

namespace detail {

bool spinThenYield(const WaitWord& word, uint32_t target) {
  const int spins = gSpins.load(std::memory_order_relaxed);
  for (int i = 0; i < spins; ++i) {
    if (reached(word.value.load(std::memory_order_acquire), target)) return true;
    DSP_CPU_RELAX();
  }
  const int yields = gYields.load(std::memory_order_relaxed);
  for (int i = 0; i < yields; ++i) {
    if (reached(word.value.load(std::memory_order_acquire), target)) return true;
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
