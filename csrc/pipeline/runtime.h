// The pipeline runtime: executes one rank's actions of a validated schedule.
//
// It owns everything between the stages: the point-to-point transfers (in
// the order the validator proved deadlock-free, receives posted ahead where
// their shape is known), the activations and gradients that travel, a header
// per activation so that a shape change is caught on both ends, and the
// freeing of each as soon as it has been consumed. The compute (a stage's
// module, its loss, autograd) stays with the caller, through two callbacks:
//
//   forward(stage, microbatch, input) -> output
//       input: the previous stage's output, received or handed over on this
//       rank; absent for the first stage (the caller feeds its batch).
//       output: what goes to the next stage; ignored for the last stage.
//   backward(stage, microbatch, grad_output) -> grad_input
//       grad_output: the gradient of this stage's output; absent for the
//       last stage (its backward starts from the loss). grad_input: the
//       gradient of the input, for the previous stage; ignored for the
//       first stage.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <tuple>
#include <vector>

#include "../core/pipeline/schedule.h"
#include "split_backward.h"

namespace dsparallel::pipeline {

// Absent tensors are nullopt (None in Python).
using MaybeTensor = std::optional<at::Tensor>;
using ForwardFn =
    std::function<MaybeTensor(int stage, int microbatch, MaybeTensor input)>;
using BackwardFn =
    std::function<MaybeTensor(int stage, int microbatch, MaybeTensor grad_output)>;
// Called before a W action runs the weight gradients its I deferred; returns
// tensors that join that W's engine run with zero gradients (a DDP stage's
// parameters, at its last W, so that the armed reducer sees all of them).
using WeightFn = std::function<std::vector<at::Tensor>(int stage, int microbatch)>;

// One compute action as it ran: its name ("1F3"), start and end in seconds
// on the monotonic clock (the clock of Python's time.perf_counter on Linux).
using TraceEntry = std::tuple<std::string, double, double>;

class Runtime {
 public:
  // `actions`: this rank's list from a validated schedule of `num_stages`
  // stages over `num_ranks` ranks; `group`: the pipeline's group, whose rank
  // r runs the stages `placement` gives it (r, r + num_ranks, ... or the V's
  // r and 2 num_ranks - 1 - r).
  Runtime(std::vector<dsp::pipeline::Action> actions, int num_stages, int num_ranks,
          int num_microbatches, c10::intrusive_ptr<c10d::ProcessGroup> group,
          dsp::pipeline::Placement placement = dsp::pipeline::Placement::kLoop);

  // Runs every action once. Blocking waits honour the group's timeout.
  //
  // A step that fails in compute (a callback raises, a stage output changes
  // shape or dtype between micro-batches) fails on every rank and leaves the
  // group usable: the rank where it happened skips its remaining compute but
  // still makes every transfer of its list, activations marked as failed
  // (with the sizes the receiver expects) and gradients as zeros; a rank
  // receiving a failed activation does the same. The step ends, as every
  // step does, with an all-gather of each rank's status; then the rank where
  // it happened rethrows its exception and every other rank raises naming
  // that rank, stage, micro-batch and error. No message stays behind, so the
  // next step runs as if the failed one had not (after zeroing the
  // gradients it left). A failed transfer (a peer died, a timeout) leaves
  // the ranks out of step: it raises at once, withdrawing this step's
  // receives, and the group must be rebuilt (an expired bounded wait breaks
  // it; see p2p.cpp).
  void step(const ForwardFn& forward, const BackwardFn& backward,
            const WeightFn& weight = nullptr);

  // The compute actions of the last step, in order.
  const std::vector<TraceEntry>& trace() const { return trace_; }
  // Its transfer actions ("0SEND_F3", ...), in order: how long posting a send
  // or completing a receive took, for the measured bubble's breakdown.
  const std::vector<TraceEntry>& transferTrace() const { return transfers_; }

 private:
  struct Posted {  // a receive posted ahead
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    // Activations: the whole message (header, then payload), or the header
    // alone when the payload travels on its own (into `data`).
    at::Tensor header;
    at::Tensor data;  // gradients, and large activations' payloads
  };
  using Key = std::tuple<bool, int, int>;  // (backward?, stage, micro-batch)
  // Where and why a step failed: here, or on the rank whose failed
  // activation reached this one.
  struct Failure {
    int rank = -1;  // -1: the step has not failed (here or upstream)
    int stage = -1, microbatch = -1;
    std::string what;
    std::exception_ptr error;  // the exception, where it was raised here
  };

  int rankOf(int stage) const {
    return dsp::pipeline::rankOfStage(stage, num_ranks_, placement_);
  }
  bool local(int stage) const { return rankOf(stage) == my_rank_; }
  // Unique within a step and across the last generations_ steps: a message
  // of one step is never taken by the next.
  int tag(int stage, int mb, bool backward, bool header) const;
  // The group's backend for the tensor's device, called directly: what
  // ProcessGroup::send/recv do through the dispatcher, without its cost per call.
  c10d::Backend& backendFor(const at::Tensor& t);
  c10::intrusive_ptr<c10d::Work> send(const at::Tensor& t, int dst, int tag);
  c10::intrusive_ptr<c10d::Work> recv(const at::Tensor& t, int src, int tag);

  // Sends stage's output for micro-batch mb; `out` null (a failed step):
  // a header marked as failed, in messages of the sizes the receiver expects.
  void sendActivation(int stage, int mb, const at::Tensor* out,
                      std::vector<c10::intrusive_ptr<c10d::Work>>& pending);
  void prefetchActivation(int stage, int mb);
  // The previous stage's output; nullopt when it came marked as failed
  // (then `failure_` says where, if this rank had not failed already).
  MaybeTensor receiveActivation(int stage, int mb);
  void checkShape(int stage, int mb, at::IntArrayRef shape, at::ScalarType dtype);
  // Records the first failure on this rank (the current exception).
  void fail(int stage, int mb, const char* action);
  // Every rank's status at the end of a step; raises if any failed.
  void exchangeStatus();

  std::vector<dsp::pipeline::Action> actions_;
  int num_stages_, num_ranks_, num_microbatches_, my_rank_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  dsp::pipeline::Placement placement_;
  // Each stage's output shape and dtype, fixed by its first micro-batch.
  std::map<int, std::pair<std::vector<int64_t>, at::ScalarType>> shapes_;
  std::map<Key, Posted> posted_;
  Failure failure_;  // of the step running
  // Gradients the previous stage waits for, per (stage, micro-batch) received
  // here: sent even from a failed step (as zeros), where it posted a receive.
  std::map<std::pair<int, int>, bool> grad_expected_;
  int64_t steps_ = 0;
  int64_t tags_per_step_ = 0, generations_ = 1;
  std::vector<TraceEntry> trace_, transfers_;
  c10::intrusive_ptr<c10d::Backend> backend_;  // of backend_device_
  c10::DeviceType backend_device_ = c10::DeviceType::CPU;
  // The weight gradients its I actions defer to their W (this pipeline's own).
  WeightGradStore weight_grads_;
};

}  // namespace dsparallel::pipeline
