// The split backward of zero-bubble pipeline schedules: B becomes I (the
// gradient of the stage's input, which the previous stage waits for) and W
// (the gradients of the weights, which nothing waits for and the schedule
// moves into idle slots).
//
// While the runtime runs an I action it opens a capture in the store; every
// dsparallel::split_linear whose backward runs inside it computes only its
// input gradient and queues the weight-gradient GEMMs. The runtime closes
// the capture after the I and runs that capture's closures at the matching
// W action. A closure adds its gradients through the autograd engine (as a
// backward from the weight itself), so .grad accumulates as it always does
// and AccumulateGrad hooks fire. Outside a capture, split_linear is
// at::linear with an ordinary backward.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <vector>

namespace dsparallel::pipeline {

class WeightGradStore {
 public:
  static WeightGradStore& get();

  // Opens a capture (one at a time); end() closes it and returns its key.
  void begin();
  int64_t end();
  bool capturing() const;
  void put(std::function<void()> fn);
  // Runs and drops the closures of a capture, in the order they were queued;
  // returns how many ran.
  int64_t run(int64_t key);
  // Drops every capture (a step that failed half-way).
  void clear();
  // Closures queued and not run yet, over all captures.
  int64_t pending() const;

 private:
  mutable std::mutex mutex_;
  bool capturing_ = false;
  std::vector<std::function<void()>> open_;
  std::map<int64_t, std::vector<std::function<void()>>> closed_;
  int64_t next_key_ = 0;
};

}  // namespace dsparallel::pipeline
