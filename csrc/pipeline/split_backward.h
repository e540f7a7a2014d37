// The split backward of zero-bubble pipeline schedules: B becomes I (the
// gradient of the stage's input, which the previous stage waits for) and W
// (the gradients of the weights, which nothing waits for and the schedule
// moves into idle slots).
//
// While the runtime runs an I action it opens a capture in the store; every
// dsparallel::split_linear whose backward runs inside it computes only its
// input gradient and queues the weight-gradient GEMMs. The runtime closes
// the capture after the I and runs that capture's closures at the matching
// W action. A W computes every queued weight gradient and adds them in one
// run of the autograd engine started from the weights themselves: .grad
// accumulates as it always does, AccumulateGrad hooks fire, a weight used
// twice gets the sum once, and a DDP reducer armed before the W sees one
// backward. Outside a capture, split_linear is at::linear with an ordinary
// backward.
#pragma once

#include <ATen/core/Tensor.h>

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
  // A closure computes weight gradients: it appends (tensor, gradient) pairs.
  using Closure = std::function<void(std::vector<at::Tensor>& tensors,
                                     std::vector<at::Tensor>& grads)>;
  void put(Closure fn);
  // Runs and drops the closures of a capture, in the order they were queued,
  // and adds their gradients in one engine run; `complete` are further
  // tensors (a DDP stage's other parameters) that join the run with a zero
  // gradient so that their hooks fire in it too. Returns how many closures
  // ran.
  int64_t run(int64_t key, const std::vector<at::Tensor>& complete = {});
  // Drops every capture (a step that failed half-way).
  void clear();
  // Closures queued and not run yet, over all captures.
  int64_t pending() const;

 private:
  mutable std::mutex mutex_;
  bool capturing_ = false;
  std::vector<Closure> open_;
  std::map<int64_t, std::vector<Closure>> closed_;
  int64_t next_key_ = 0;
};

}  // namespace dsparallel::pipeline
