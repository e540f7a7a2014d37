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

  // Runs every action once. Rethrows a callback's exception and raises on a
  // stage output whose shape or dtype changes between micro-batches (on both
  // ends of its transfer). Blocking waits honour the group's timeout.
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

  int rankOf(int stage) const {
    return dsp::pipeline::rankOfStage(stage, num_ranks_, placement_);
  }
  bool local(int stage) const { return rankOf(stage) == my_rank_; }
  int tag(int stage, int mb, bool backward, bool header) const;
  // The group's backend for the tensor's device, called directly: what
  // ProcessGroup::send/recv do through the dispatcher, without its cost per call.
  c10d::Backend& backendFor(const at::Tensor& t);
  c10::intrusive_ptr<c10d::Work> send(const at::Tensor& t, int dst, int tag);
  c10::intrusive_ptr<c10d::Work> recv(const at::Tensor& t, int src, int tag);

  void sendActivation(int stage, int mb, const at::Tensor& out,
                      std::vector<c10::intrusive_ptr<c10d::Work>>& pending);
  void prefetchActivation(int stage, int mb);
  at::Tensor receiveActivation(int stage, int mb);
  void checkShape(int stage, int mb, at::IntArrayRef shape, at::ScalarType dtype);

  std::vector<dsp::pipeline::Action> actions_;
  int num_stages_, num_ranks_, num_microbatches_, my_rank_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  dsp::pipeline::Placement placement_;
  // Each stage's output shape and dtype, fixed by its first micro-batch.
  std::map<int, std::pair<std::vector<int64_t>, at::ScalarType>> shapes_;
  std::map<Key, Posted> posted_;
  std::vector<TraceEntry> trace_, transfers_;
  c10::intrusive_ptr<c10d::Backend> backend_;  // of backend_device_
  c10::DeviceType backend_device_ = c10::DeviceType::CPU;
};

}  // namespace dsparallel::pipeline
