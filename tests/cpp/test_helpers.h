// Runs n ranks of a ShmComm as threads of this process (as gloo's tests do),
// and checks the messages of expected errors.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/shm/comm.h"

namespace dsp::testing {

inline ShmOptions smallOptions() {
  ShmOptions o;
  o.chunk_bytes = 4096;  // tiny chunks: every size class takes many steps
  o.one_shot_max_bytes = 2048;
  // Outputs of 8 KiB and more stream: the larger sizes of every collective
  // test take the non-temporal copies, the smaller ones memcpy.
  o.stream_min_bytes = 8192;
  o.timeout = std::chrono::seconds(20);
  return o;
}

// Calls fn(comm) on every rank; returns each rank's exception (or null).
inline std::vector<std::exception_ptr> runRanks(int n,
                                                const std::function<void(ShmComm&)>& fn,
                                                ShmOptions options = smallOptions()) {
  const std::string name = Segment::randomName();
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        ShmComm comm(name, r, n, options);
        fn(comm);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

inline std::string messageOf(const std::exception_ptr& e) {
  if (!e) return "";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  }
  return "unknown";
}

// fn() must throw E whose message contains every needle; `if_not_thrown`
// is the failure reported when it returns.
template <typename E, typename Fn>
void expectThrowWith(Fn&& fn, const std::vector<std::string>& needles,
                     const char* if_not_thrown) {
  try {
    fn();
    ADD_FAILURE() << if_not_thrown;
  } catch (const E& e) {
    const std::string m = e.what();
    for (const auto& needle : needles) EXPECT_NE(m.find(needle), std::string::npos) << m;
  }
}

}  // namespace dsp::testing
