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
//
// Each pipeline runtime owns its store, so two pipelines in one process (two
// models trained by two threads, a pipeline inside another's stage) never
// take or drop each other's weight gradients. A backward of host tensors
// finds the capture open on its own thread (the engine runs a CPU graph on
// the thread that called backward); one of device tensors runs on an engine
// thread of its device, and takes the one capture open in the process,
// refusing to guess when several are.
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
  WeightGradStore() = default;
  ~WeightGradStore();
  WeightGradStore(const WeightGradStore&) = delete;
  WeightGradStore& operator=(const WeightGradStore&) = delete;

  // The store of the bindings' weight_grad_* functions (tests, opt-in use).
  static WeightGradStore& standalone();
  // The store whose capture a split backward of `grad` running now belongs
  // to; null outside any capture.
  static WeightGradStore* capturing(const at::Tensor& grad);

  // Opens a capture on this thread (one per store at a time; a capture of
  // another store opened inside it is closed before it); end() closes it and
  // returns its key.
  void begin();
  int64_t end();
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
  // Closes the capture in the process-wide registry (with mutex_ held).
  void unregisterLocked();

  mutable std::mutex mutex_;
  bool capturing_ = false;
  WeightGradStore* outer_ = nullptr;  // the capture open on this thread before
  std::vector<Closure> open_;
  std::map<int64_t, std::vector<Closure>> closed_;
  int64_t next_key_ = 0;
};

}  // namespace dsparallel::pipeline
