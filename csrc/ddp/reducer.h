// The DDP gradient reducer: fused, bucketed all-reduce overlapped with
// backward.
//
// Per iteration (a forward with gradient sync, then its backward):
//   prepareForBackward  resets the per-bucket counts; with
//                       find_unused_parameters, walks the autograd graph from
//                       the outputs and marks parameters it cannot reach as
//                       ready (zero gradient).
//   autograd hook       after a parameter's .grad is accumulated: copy it into
//                       its bucket (or make .grad a view of it); when a
//                       bucket is full, launch its all-reduce, strictly in
//                       bucket order so every rank issues the same sequence.
//   final callback      (autograd engine, end of backward) waits for every
//                       bucket and writes the averages back into .grad.
// After the first iteration the buckets are rebuilt once from the order in
// which gradients became ready on rank 0 (broadcast, so all ranks agree).
//
// ZeRO stage 2 (zero_stage = 2): each bucket is padded to a multiple of the
// group size and rank r owns its r-th equal slice. A full bucket is
// reduce-scattered instead of all-reduced into the bucket's persistent
// gradient shard (1/N of the bucket): straight into it while it is zero
// (after zero_grad), else added into it. .grad is released at once. Over our
// shared memory (no comm hook, no reduce dtype) the gradients are
// reduce-scattered where autograd left them, held until their bucket's
// reduction finishes: no copy into a flat bucket. Otherwise (a hook, another
// backend) they are copied into flat buckets that take turns in two staging
// buffers kept across iterations. Either way bucket k starts filling only
// after bucket k-2's reduction finished: a rank holds its shards plus two
// buckets. The layout never changes (no rebuild): the optimizer's state is
// laid out on it.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <utility>
#include <vector>

#include "flat_bucket.h"

namespace dsparallel {

class ProcessGroupDSP;

// shared_ptr<Node> before torch 2.12, intrusive_ptr<Node> after.
using NodePtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

struct ReducerOptions {
  std::vector<size_t> bucket_caps;  // bytes: first bucket, then the rest
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;
  bool static_graph = false;
  int zero_stage = 0;  // 2: reduce-scatter into gradient shards (see above)
};

class Reducer {
 public:
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
          c10::intrusive_ptr<c10d::ProcessGroup> group, ReducerOptions options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Called by each forward that will be followed by a synchronising backward.
  void prepareForBackward(const std::vector<at::Tensor>& outputs);
  void registerCommHook(std::unique_ptr<c10d::CommHookInterface> hook);

  // Parameter indices per bucket, in launch order (for tests and logs).
  std::vector<std::vector<size_t>> bucketIndices() const;
  // How many buckets are all-reduced straight from the gradients (no flat copy).
  size_t inPlaceBuckets() const;
  bool bucketsRebuilt() const { return rebuilt_; }

  // ZeRO stage 2. Per bucket: its members' element offsets in the flat
  // bucket and the padded length (a multiple of the group size).
  std::vector<std::vector<int64_t>> bucketOffsets() const;
  std::vector<int64_t> paddedNumels() const;
  // This rank's slice of each bucket's averaged gradient, accumulated over
  // synced backwards until zeroGradShards(). This and paramsWithGradients()
  // first write the zeros zeroGradShards() deferred: call either before
  // reading the shards (the optimizer's step does).
  std::vector<at::Tensor> gradShards();
  // Bytes held besides the shards: the two staging buffers (kept across
  // iterations), plus the most gradient bytes held at once for
  // reduce-scatters from where they are, in the last backward.
  int64_t stagingBytes() const;
  // Zeroes the shards (lazily, see gradShards()); with set_to_none, every parameter is
  // also "without a gradient" again, as torch's zero_grad makes .grad None.
  void zeroGradShards(bool set_to_none);
  // Per parameter: whether some rank produced its gradient in a synced
  // backward since the last zeroGradShards(set_to_none=true). An optimizer
  // skips the others, as torch's skip a parameter whose .grad is None.
  std::vector<bool> paramsWithGradients();
  // Buckets are reduced in this floating dtype and added into the shards in
  // the parameters' (a compress hook under reduce-scatter).
  void setReduceDType(at::ScalarType dtype);

 private:
  struct Bucket : FlatBucket {
    bool average_in_reduction = false;  // fusedAverage(flat), fixed per bucket
    // The gradients can be all-reduced where they are (see inPlace).
    bool in_place_capable = false;
    size_t pending = 0;
    c10::intrusive_ptr<c10::ivalue::Future> future;
    // ZeRO stage 2: the padded length, this rank's gradient slice, and the
    // reduce-scatter's output until it is added into the slice.
    int64_t padded_numel = 0;
    at::Tensor shard;
    at::Tensor scattered;  // may be `shard` itself (see launchReduceScatterLocked)
    // Over our shared memory (no hook, no reduce dtype) the gradients are
    // reduce-scattered where autograd left them: held here in member order,
    // with `padding` (zeros) after them, until the reduction is finished.
    bool list_capable = false;
    std::vector<at::Tensor> held;
    at::Tensor padding;
    // The shard's version when it was last zeroed (-1: it holds a gradient
    // since): a clean shard takes the reduce-scatter's output directly.
    int64_t clean_version = -1;
    // Zeroed by zeroGradShards() but not written yet: its memory is stale,
    // its value zero (clean as well). See settleZerosLocked().
    bool zero_pending = false;
  };

  void autogradHook(size_t index);
  void markReadyLocked(size_t index, bool used);
  void launchReadyLocked();
  std::string backendName(const at::Tensor& t) const;
  bool dspSharedMemory(const at::Tensor& t) const;
  ProcessGroupDSP* dspBackend(const at::Tensor& t) const;
  bool listed(const Bucket& b) const {
    return b.list_capable && !comm_hook_ && !reduce_dtype_;
  }
  void holdGradLocked(Bucket& b, size_t index, bool used);
  void releaseHeld(Bucket& b);
  bool fusedAverage(const at::Tensor& flat) const;
  bool inPlace(const Bucket& b) const { return b.in_place_capable && !comm_hook_; }
  void finalizeBackward();
  void buildBuckets(const std::vector<size_t>& order);
  void maybeRebuildBuckets();
  void pointGradsAtBucketsLocked();
  std::vector<bool> unreachableParams(const std::vector<at::Tensor>& outputs) const;
  std::vector<bool> globallyUsed() const;
  void waitLaunchedBuckets();
  [[noreturn]] void failUnreduced();
  bool sharded() const { return options_.zero_stage == 2; }
  void allocateFlatLocked(Bucket& b);
  void launchReduceScatterLocked(Bucket& b);
  void finishShard(Bucket& b);
  void addIntoShard(Bucket& b, const at::Tensor& result);
  void settleZerosLocked();
  static int64_t shardVersion(const Bucket& b);

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  ReducerOptions options_;
  std::unique_ptr<c10d::CommHookInterface> comm_hook_;

  std::vector<std::pair<uintptr_t, NodePtr>> hooks_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;    // param -> bucket
  std::vector<size_t> position_of_;  // param -> member index in its bucket

  mutable std::mutex mutex_;
  bool expect_hooks_ = false;     // a synced backward is expected
  bool callback_queued_ = false;  // final callback queued this backward
  size_t next_launch_ = 0;
  std::vector<bool> ready_;
  std::vector<bool> locally_used_;
  std::vector<int> hooks_left_;      // static graph: hook firings still expected
  std::vector<int> hook_counts_;     // static graph: firings seen in iteration 0
  std::vector<size_t> ready_order_;  // first iteration, for the rebuild
  int64_t iteration_ = 0;
  bool rebuilt_ = false;
  std::optional<at::ScalarType> reduce_dtype_;  // stage 2 compression
  std::vector<bool> has_grad_;                  // stage 2: see paramsWithGradients()
  at::Tensor staging_[2];                       // stage 2: see the top
  int64_t staging_user_[2] = {-1, -1};          // the bucket using each, or -1
  int64_t held_bytes_ = 0;                      // stage 2: gradients in Bucket::held
  int64_t peak_held_bytes_ = 0;                 // ... at most, this backward
};

}  // namespace dsparallel
