// Spin-then-sleep waiting on a 32-bit counter in shared memory.
//
// Ranks may outnumber cores: a pure spin then burns the very core the late
// peer needs, and latency collapses. So a waiter spins briefly (the peer is
// usually microseconds away), then yields, then sleeps on a futex that the
// writer wakes only when someone is actually asleep (the `sleepers` count),
// so the fast path costs the writer no syscall.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace dsp {

// A counter that one process advances and others wait on. Lives in shared
// memory; both words must be zero-initialised.
struct WaitWord {
  std::atomic<uint32_t> value;
  std::atomic<uint32_t> sleepers;
};
static_assert(std::atomic<uint32_t>::is_always_lock_free,
              "futex words must be lock-free atomics");
static_assert(sizeof(WaitWord) == 8, "WaitWord crosses processes: keep its layout");

// True when `value` has reached `target` in wrap-around order.
inline bool reached(uint32_t value, uint32_t target) {
  return static_cast<int32_t>(value - target) >= 0;
}

// Publishes `value` and wakes sleepers, if any.
void advance(WaitWord& word, uint32_t value);
// Adds one (several writers may) and wakes sleepers, if any.
void bump(WaitWord& word);

enum class WaitResult { kReached, kTimedOut, kCancelled };

// How long a waiter stays awake before it sleeps on the futex.
struct WaitPolicy {
  int spins;   // pause-spins: cheapest, right when the peer runs on another core
  int yields;  // sched_yield calls: hand the core to a runnable peer
  // After the counted spins, keep spinning for up to this many microseconds
  // (0: none), then yield. For waits whose peer is busy computing, not
  // communicating: a futex sleep and wake-up cost more than the spin.
  int spin_us = 0;
};

// Whether `ranks` processes outnumber the CPUs this process may run on.
bool oversubscribed(int ranks);
// The policy for ranks sharing this host's CPUs: with a core each, spin (a
// peer is microseconds away); oversubscribed, yield almost at once, since
// the peer we wait for may need this very core.
WaitPolicy defaultWaitPolicy(bool oversubscribed);

// Waits until word.value reaches target or the deadline passes. `still_ok` is
// polled while asleep (every few ms): returning false cancels the wait (a
// dead peer).
template <typename StillOk>
WaitResult waitFor(const WaitWord& word, uint32_t target,
                   std::chrono::steady_clock::time_point deadline,
                   const WaitPolicy& policy, StillOk&& still_ok);

namespace detail {
// The time-based spin and the yields stop at `deadline` too.
bool spinThenYield(const WaitWord& word, uint32_t target, const WaitPolicy& policy,
                   std::chrono::steady_clock::time_point deadline);
// One futex sleep of at most `slice`; returns when woken, on timeout or
// spuriously. The caller re-checks.
void sleepOnce(const WaitWord& word, uint32_t observed, std::chrono::microseconds slice);
}  // namespace detail

template <typename StillOk>
WaitResult waitFor(const WaitWord& word, uint32_t target,
                   std::chrono::steady_clock::time_point deadline,
                   const WaitPolicy& policy, StillOk&& still_ok) {
  if (detail::spinThenYield(word, target, policy, deadline)) return WaitResult::kReached;
  constexpr auto kSleepSlice = std::chrono::milliseconds(5);
  for (;;) {
    const uint32_t v = word.value.load(std::memory_order_acquire);
    if (reached(v, target)) return WaitResult::kReached;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return WaitResult::kTimedOut;
    if (!still_ok()) return WaitResult::kCancelled;
    const auto left =
        std::chrono::duration_cast<std::chrono::microseconds>(deadline - now);
    detail::sleepOnce(word, v, left < kSleepSlice ? left : kSleepSlice);
  }
}

}  // namespace dsp
