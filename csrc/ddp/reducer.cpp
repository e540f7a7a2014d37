#include "reducer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <sstream>
#include <unordered_set>

#include "backend/process_group_dsp.h"
#include "core/bucket/assign.h"

namespace dsparallel {

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                 c10::intrusive_ptr<c10d::ProcessGroup> group, ReducerOptions options)
    : params_(std::move(params)),
      names_(std::move(names)),
      group_(std::move(group)),
      options_(std::move(options)) {
  TORCH_CHECK(!params_.empty(),
              "DistributedDataParallel: the module has no parameter that "
              "requires a gradient");
  TORCH_CHECK(names_.size() == params_.size(),
              "Reducer: one name per parameter expected");
  for (const auto& p : params_) {
    TORCH_CHECK(p.layout() == c10::kStrided,
                "DistributedDataParallel: sparse parameters are not supported");
  }
  const size_t n = params_.size();
  ready_.assign(n, false);
  locally_used_.assign(n, false);
  hook_counts_.assign(n, 0);
  hooks_left_.assign(n, 0);
  has_grad_.assign(n, false);
  buildBuckets(dsp::reverseOrder(n));
  for (size_t i = 0; i < n; ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    TORCH_CHECK(acc, "DistributedDataParallel: parameter ", names_[i],
                " has no gradient accumulator (is it a leaf that requires grad?)");
    const uintptr_t key =
        acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
            [this, i](const torch::autograd::variable_list& outputs,
                      const torch::autograd::variable_list& /*inputs*/) {
              autogradHook(i);
              return outputs;
            }));
    hooks_.emplace_back(key, std::move(acc));
  }
}

Reducer::~Reducer() {
  for (auto& [key, acc] : hooks_) acc->del_post_hook(key);
}

// ---------------------------------------------------------------------------
// buckets

void Reducer::buildBuckets(const std::vector<size_t>& order) {
  std::vector<dsp::BucketTensor> sizes;
  for (const auto& p : params_) sizes.push_back({p.nbytes(), bucketGroupOf(p)});
  const auto assignment = dsp::assignBuckets(sizes, order, options_.bucket_caps);
  std::vector<Bucket> buckets;
  bucket_of_.assign(params_.size(), 0);
  position_of_.assign(params_.size(), 0);
  for (size_t b = 0; b < assignment.size(); ++b) {
    Bucket bucket;
    static_cast<FlatBucket&>(bucket) = FlatBucket::make(params_, assignment[b]);
    bucket.average_in_reduction = fusedAverage(bucket.flat);
    // On "dsp" (one host, CPU), a bucket with no hook to see it flat is
    // all-reduced straight from the gradients (one coalesced all-reduce,
    // averaged in the same pass): the copies into the bucket and back out
    // cost as much as the shared-memory reduction itself. Unused-parameter
    // tracking and gradient-as-bucket-view keep the flat bucket.
    bucket.in_place_capable = bucket.average_in_reduction && !sharded() &&
                              !options_.gradient_as_bucket_view &&
                              !options_.find_unused_parameters &&
                              !options_.static_graph && dspSharedMemory(bucket.flat);
    for (size_t k = 0; k < bucket.members.size(); ++k) {
      bucket_of_[bucket.members[k]] = b;
      position_of_[bucket.members[k]] = k;
    }
    if (sharded()) {
      // The flat bucket exists only during a backward (allocateFlatLocked).
      const int64_t world = group_->getSize();
      bucket.padded_numel = (bucket.flat.numel() + world - 1) / world * world;
      bucket.shard = at::zeros({bucket.padded_numel / world}, bucket.flat.options());
      bucket.clean_version = shardVersion(bucket);
      bucket.list_capable = bucket.average_in_reduction && dspSharedMemory(bucket.flat);
      const int64_t pad =
          bucket.padded_numel - (bucket.offsets.back() + bucket.lengths.back());
      if (bucket.list_capable && pad > 0)
        bucket.padding = at::zeros({pad}, bucket.flat.options());
      bucket.flat = at::Tensor();
    }
    buckets.push_back(std::move(bucket));
  }
  buckets_ = std::move(buckets);
  if (options_.gradient_as_bucket_view) pointGradsAtBucketsLocked();
}

// .grad becomes a view of the parameter's bucket slice (keeping its value),
// so the reduced result needs no copy back.
void Reducer::pointGradsAtBucketsLocked() {
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& grad = params_[i].mutable_grad();
    if (!grad.defined()) continue;
    at::Tensor view = buckets_[bucket_of_[i]].view(position_of_[i], params_[i]);
    if (!grad.is_alias_of(view)) {
      view.copy_(grad);
      grad = view;
    }
  }
}

void Reducer::maybeRebuildBuckets() {
  // As torch: rebuild once, unless unused parameters make the order unreliable.
  const bool allowed = options_.static_graph || !options_.find_unused_parameters;
  if (rebuilt_ || !allowed || sharded() || iteration_ == 0) return;
  rebuilt_ = true;
  // Complete the observed order with parameters that never became ready.
  std::vector<bool> listed(params_.size(), false);
  std::vector<int64_t> order;
  for (size_t i : ready_order_) {
    listed[i] = true;
    order.push_back(static_cast<int64_t>(i));
  }
  for (size_t i : dsp::reverseOrder(params_.size())) {
    if (!listed[i]) order.push_back(static_cast<int64_t>(i));
  }
  // Rank 0's order for everyone: the buckets must match across ranks.
  std::vector<at::Tensor> t = {at::tensor(order, at::kLong).to(params_[0].device())};
  c10d::BroadcastOptions opts;
  opts.rootRank = 0;
  group_->broadcast(t, opts)->wait();
  const at::Tensor cpu = t[0].cpu();
  std::vector<size_t> agreed(cpu.data_ptr<int64_t>(),
                             cpu.data_ptr<int64_t>() + cpu.numel());
  buildBuckets(agreed);
}

std::vector<std::vector<size_t>> Reducer::bucketIndices() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::vector<size_t>> out;
  for (const auto& b : buckets_) out.push_back(b.members);
  return out;
}

size_t Reducer::inPlaceBuckets() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t n = 0;
  for (const auto& b : buckets_) n += inPlace(b) ? 1 : 0;
  return n;
}

std::vector<std::vector<int64_t>> Reducer::bucketOffsets() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::vector<int64_t>> out;
  for (const auto& b : buckets_) out.push_back(b.offsets);
  return out;
}

std::vector<int64_t> Reducer::paddedNumels() const {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(sharded(), "padded bucket lengths exist only with zero_stage=2");
  std::vector<int64_t> out;
  for (const auto& b : buckets_) out.push_back(b.padded_numel);
  return out;
}

std::vector<at::Tensor> Reducer::gradShards() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(sharded(), "gradient shards exist only with zero_stage=2");
  settleZerosLocked();
  std::vector<at::Tensor> out;
  for (const auto& b : buckets_) out.push_back(b.shard);
  return out;
}

void Reducer::zeroGradShards(bool set_to_none) {
  std::lock_guard<std::mutex> lock(mutex_);
  // The zeros are not written yet: the next backward's reduce-scatter
  // overwrites a whole shard, so writing them first would only cost a pass
  // over the shards (and the cache they evict: the next forward measured
  // 4-7 ms slower on the 50M-parameter MLP of benchmarks/zero.py).
  for (auto& b : buckets_) b.zero_pending = b.shard.defined();
  if (set_to_none) has_grad_.assign(params_.size(), false);
}

void Reducer::settleZerosLocked() {
  for (auto& b : buckets_) {
    if (!b.zero_pending) continue;
    b.shard.zero_();
    b.zero_pending = false;
    b.clean_version = shardVersion(b);
  }
}

std::vector<bool> Reducer::paramsWithGradients() {
  std::lock_guard<std::mutex> lock(mutex_);
  settleZerosLocked();
  return has_grad_;
}

void Reducer::setReduceDType(at::ScalarType dtype) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(sharded(), "a reduce dtype is only set with zero_stage=2");
  TORCH_CHECK(at::isFloatingType(dtype), "the reduce dtype must be a floating type, got ",
              dtype);
  TORCH_CHECK(iteration_ == 0 && !expect_hooks_ && !comm_hook_,
              "register_comm_hook can only be called once, before the first forward");
  reduce_dtype_ = dtype;
  // Divided on the way in (a sum of N values must fit the narrower format).
  for (auto& b : buckets_) b.average_in_reduction = false;
}

void Reducer::registerCommHook(std::unique_ptr<c10d::CommHookInterface> hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!comm_hook_, "register_comm_hook can only be called once");
  TORCH_CHECK(iteration_ == 0 && !expect_hooks_,
              "register_comm_hook must be called before the first forward");
  comm_hook_ = std::move(hook);
}

// ---------------------------------------------------------------------------
// one iteration

std::vector<bool> Reducer::unreachableParams(
    const std::vector<at::Tensor>& outputs) const {
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& out : outputs) {
    if (out.defined() && out.requires_grad() && out.grad_fn())
      stack.push_back(out.grad_fn().get());
  }
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    for (const auto& edge : node->next_edges()) {
      if (edge.function && !seen.count(edge.function.get()))
        stack.push_back(edge.function.get());
    }
  }
  std::vector<bool> unreachable(params_.size(), false);
  for (size_t i = 0; i < params_.size(); ++i) {
    unreachable[i] = !seen.count(hooks_[i].second.get());
  }
  return unreachable;
}

void Reducer::prepareForBackward(const std::vector<at::Tensor>& outputs) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (expect_hooks_) {
    // The previous synced forward had no (complete) backward: finish what it
    // launched (buckets of unused parameters, or those before an error) so
    // no collective is left in flight on a buffer about to be reused.
    waitLaunchedBuckets();
  }
  lock.unlock();
  maybeRebuildBuckets();  // a collective: outside the lock
  lock.lock();
  expect_hooks_ = true;
  callback_queued_ = false;
  next_launch_ = 0;
  std::fill(ready_.begin(), ready_.end(), false);
  std::fill(locally_used_.begin(), locally_used_.end(), false);
  for (auto& b : buckets_) {
    b.pending = b.members.size();
    // A result written straight into a clean shard by a backward that never
    // finished is dropped, as an unadded result is: the shard was zero.
    if (b.future && b.scattered.defined() && b.scattered.is_same(b.shard)) {
      b.zero_pending = true;
    }
    b.future.reset();
    if (sharded()) {
      releaseHeld(b);
      b.flat = at::Tensor();
      b.scattered = at::Tensor();
    }
  }
  staging_user_[0] = staging_user_[1] = -1;
  peak_held_bytes_ = held_bytes_ = 0;
  const bool staticAfterFirst = options_.static_graph && iteration_ > 0;
  if (staticAfterFirst) {
    hooks_left_ = hook_counts_;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (hook_counts_[i] == 0) markReadyLocked(i, /*used=*/false);
    }
  } else if (options_.find_unused_parameters && !options_.static_graph) {
    const auto unreachable = unreachableParams(outputs);
    for (size_t i = 0; i < params_.size(); ++i) {
      if (unreachable[i]) markReadyLocked(i, /*used=*/false);
    }
  }
  launchReadyLocked();
}

void Reducer::autogradHook(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!expect_hooks_) return;  // no_sync, or a backward without a synced forward
  if (!callback_queued_) {
    callback_queued_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback(
        [this] { finalizeBackward(); });
  }
  locally_used_[index] = true;
  if (iteration_ == 0) {
    if (hook_counts_[index]++ == 0) ready_order_.push_back(index);
    // The static graph's first iteration only observes; it reduces at the end.
    if (options_.static_graph) return;
  }
  if (options_.static_graph && --hooks_left_[index] > 0) return;
  TORCH_CHECK(!ready_[index], "Expected to mark a variable ready only once. Parameter ",
              names_[index],
              " received its gradient twice in one backward (a shared or "
              "re-entrant use); pass static_graph=True to DistributedDataParallel if the "
              "graph is the same every iteration.");
  markReadyLocked(index, /*used=*/true);
  launchReadyLocked();
}

void Reducer::markReadyLocked(size_t index, bool used) {
  if (ready_[index]) return;
  ready_[index] = true;
  Bucket& bucket = buckets_[bucket_of_[index]];
  at::Tensor& grad = params_[index].mutable_grad();
  if (inPlace(bucket)) {
    // Reduced where it is; a parameter without a gradient contributes zeros.
    if (!grad.defined()) grad = at::zeros_like(params_[index]);
    --bucket.pending;
    return;
  }
  if (listed(bucket)) {
    holdGradLocked(bucket, index, used);
    return;
  }
  if (sharded() && !bucket.flat.defined()) allocateFlatLocked(bucket);
  at::Tensor view = bucket.view(position_of_[index], params_[index]);
  // Without a comm hook, averaging is either fused into the reduction
  // (fusedAverage) or, as torch does it, into this copy: x * (1/n) on the way
  // into the bucket, saving a pass over the gradients.
  const bool scale = !comm_hook_ && !bucket.average_in_reduction;
  const at::Tensor inverseSize =
      at::scalar_tensor(1.0 / group_->getSize(), at::TensorOptions().dtype(at::kDouble));
  if (!used || !grad.defined()) {
    view.zero_();
  } else if (grad.is_alias_of(view)) {
    if (scale) view.mul_(inverseSize);
  } else {
    if (scale) {
      at::mul_out(view, grad, inverseSize);
    } else {
      view.copy_(grad);
    }
    if (options_.gradient_as_bucket_view) grad = view;
  }
  // Stage 2 keeps no whole gradient: the bucket holds it until it is
  // reduce-scattered into this rank's shard.
  if (sharded()) grad = at::Tensor();
  --bucket.pending;
}

// Keeps the gradient where autograd left it until its bucket is
// reduce-scattered (no copy into a flat bucket). As with the staging buffers,
// at most two buckets hold gradients: the first gradient of bucket k waits
// for bucket k-2's reduction, which then lets go of its gradients.
void Reducer::holdGradLocked(Bucket& b, size_t index, bool used) {
  const auto k = static_cast<size_t>(&b - buckets_.data());
  if (b.held.empty()) {
    if (k >= 2) finishShard(buckets_[k - 2]);
    b.held.resize(b.members.size());
  }
  at::Tensor& grad = params_[index].mutable_grad();
  at::Tensor g =
      used && grad.defined() ? grad.contiguous() : at::zeros_like(params_[index]);
  grad = at::Tensor();  // stage 2 keeps no whole gradient in .grad
  held_bytes_ += static_cast<int64_t>(g.nbytes());
  peak_held_bytes_ = std::max(peak_held_bytes_, held_bytes_);
  b.held[position_of_[index]] = g.view({-1});
  --b.pending;
}

void Reducer::releaseHeld(Bucket& b) {
  for (const auto& g : b.held)
    held_bytes_ -= g.defined() ? static_cast<int64_t>(g.nbytes()) : 0;
  b.held.clear();
}

void Reducer::allocateFlatLocked(Bucket& b) {
  const auto index = static_cast<int64_t>(&b - buckets_.data());
  const int slot = static_cast<int>(index % 2);
  const int64_t user = staging_user_[slot];
  // The slot's previous bucket, if launched, is finished first (it frees it).
  if (user >= 0 && user != index) finishShard(buckets_[user]);
  const auto options =
      b.shard.options().dtype(reduce_dtype_.value_or(b.shard.scalar_type()));
  if (staging_user_[slot] < 0) {
    if (!staging_[slot].defined() || staging_[slot].dtype() != options.dtype()) {
      int64_t largest = 0;
      for (const auto& other : buckets_) largest = std::max(largest, other.padded_numel);
      staging_[slot] = at::empty({largest}, options);
    }
    b.flat = staging_[slot].narrow(0, 0, b.padded_numel);
    staging_user_[slot] = index;
  } else {
    // Its bucket is still filling (gradients came out of bucket order): this
    // one gets a buffer of its own for this backward.
    b.flat = at::empty({b.padded_numel}, options);
  }
  const int64_t used = b.offsets.back() + b.lengths.back();
  b.flat.narrow(0, used, b.padded_numel - used).zero_();  // the padding
}

// Reduce-scatters a full bucket. At most two buckets are in flight: before
// the third is launched the oldest is finished (its flat bucket freed, its
// result added into the shard), so that a rank never holds more than its
// shards and two buckets, however far communication lags behind backward.
void Reducer::launchReduceScatterLocked(Bucket& b) {
  const size_t index = static_cast<size_t>(&b - buckets_.data());
  if (index >= 2) finishShard(buckets_[index - 2]);
  const int64_t n = b.padded_numel / group_->getSize();
  const bool clean = (b.zero_pending || shardVersion(b) == b.clean_version) &&
                     (listed(b) || b.shard.scalar_type() == b.flat.scalar_type());
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = b.average_in_reduction ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
  if (listed(b)) {
    at::Tensor out = clean ? b.shard : at::empty({n}, b.shard.options());
    std::vector<at::Tensor> inputs = b.held;
    if (b.padding.defined()) inputs.push_back(b.padding);
    b.future = dspBackend(b.shard)
                   ->reduceScatterFromList(inputs, out, opts.reduceOp)
                   ->getFuture();
    b.scattered = std::move(out);
    return;
  }
  // Over our shared memory the result may land where it is wanted: in the
  // shard itself while that is still zero (after zero_grad: nothing to add
  // it to), else in the bucket's own slice (each step reads a slice before
  // writing it); either way no output to allocate.
  at::Tensor out;
  if (!dspSharedMemory(b.flat)) {
    out = at::empty({n}, b.flat.options());
  } else if (clean) {
    out = b.shard;
  } else {
    out = b.flat.narrow(0, group_->getRank() * n, n);
  }
  b.future = group_->_reduce_scatter_base(out, b.flat, opts)->getFuture();
  b.scattered = std::move(out);
}

// A shard whose zeros are pending takes the result as it is.
void Reducer::addIntoShard(Bucket& b, const at::Tensor& result) {
  if (b.zero_pending) {
    b.shard.copy_(result);
  } else {
    b.shard.add_(result);
  }
}

// Waits for the bucket's reduction and adds this rank's slice into its shard
// (once: the future is dropped).
void Reducer::finishShard(Bucket& b) {
  if (!b.future) return;
  try {
    b.future->wait();
  } catch (...) {
    // A failed reduction written into the shard must not leave half a sum.
    if (b.scattered.is_same(b.shard)) b.zero_pending = true;
    releaseHeld(b);
    throw;
  }
  releaseHeld(b);
  if (comm_hook_) {
    // A hook reduces the whole bucket (all-reduce semantics): keep our slice.
    const at::Tensor result = comm_hook_->parseHookResult(b.future->value());
    const int64_t n = b.shard.numel();
    addIntoShard(b, result.narrow(0, group_->getRank() * n, n));
  } else if (!b.scattered.is_same(b.shard)) {
    addIntoShard(b, b.scattered);
  }
  b.zero_pending = false;
  b.clean_version = -1;  // holds a gradient now
  b.future.reset();
  b.flat = at::Tensor();
  b.scattered = at::Tensor();
  const auto index = static_cast<int64_t>(&b - buckets_.data());
  for (auto& user : staging_user_) {
    if (user == index) user = -1;
  }
}

int64_t Reducer::stagingBytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t bytes = 0;
  for (const auto& t : staging_)
    bytes += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
  return bytes + peak_held_bytes_;
}

// Launches every full bucket in bucket order, stopping at the first that is
// not full: all ranks issue the same collectives in the same order.
void Reducer::launchReadyLocked() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    Bucket& b = buckets_[next_launch_];
    if (comm_hook_) {
      std::vector<c10::IntArrayRef> sizes;
      std::vector<at::Tensor> params;
      std::vector<size_t> offsets, lengths;
      for (size_t k = 0; k < b.members.size(); ++k) {
        sizes.push_back(params_[b.members[k]].sizes());
        params.push_back(params_[b.members[k]]);
        offsets.push_back(static_cast<size_t>(b.offsets[k]));
        lengths.push_back(static_cast<size_t>(b.lengths[k]));
      }
      c10d::GradBucket gb(next_launch_, buckets_.size(), b.flat, offsets, lengths, sizes,
                          params, std::nullopt);
      b.future = comm_hook_->runHook(gb);
    } else if (sharded()) {
      launchReduceScatterLocked(b);
    } else if (inPlace(b)) {
      std::vector<at::Tensor> grads;
      for (size_t m : b.members) grads.push_back(params_[m].mutable_grad());
      c10d::AllreduceCoalescedOptions opts;
      opts.reduceOp = c10d::ReduceOp::AVG;
      b.future = group_->allreduce_coalesced(grads, opts)->getFuture();
    } else {
      // Already scaled by 1/n on the way in, unless the backend averages.
      std::vector<at::Tensor> t = {b.flat};
      c10d::AllreduceOptions opts;
      if (b.average_in_reduction) opts.reduceOp = c10d::ReduceOp::AVG;
      b.future = group_->allreduce(t, opts)->getFuture();
    }
    ++next_launch_;
  }
}

// The shard's version counter: moves with every write through ATen (an
// optimizer clipping it, a zero_), not with the backend's writes into it.
int64_t Reducer::shardVersion(const Bucket& b) {
  return static_cast<int64_t>(
      torch::autograd::impl::version_counter(b.shard).current_version());
}

// CPU tensors of a one-host "dsp" group: reduced over our shared memory, on
// our worker thread, which never frees a gradient's Python object (gloo's and
// NCCL's threads, serving groups across hosts and CUDA tensors, could, and a
// non-Python thread freeing one as the interpreter exits aborts the process).
bool Reducer::dspSharedMemory(const at::Tensor& t) const {
  const auto* dsp = dspBackend(t);
  return dsp != nullptr && t.device().is_cpu() && !dsp->multiHost();
}

ProcessGroupDSP* Reducer::dspBackend(const at::Tensor& t) const {
  return dynamic_cast<ProcessGroupDSP*>(group_->getBackend(t.device().type()).get());
}

std::string Reducer::backendName(const at::Tensor& t) const {
  return group_->getBackend(t.device().type())->getBackendName();
}

bool Reducer::fusedAverage(const at::Tensor& flat) const {
  // Backends whose all-reduce supports AVG for floating types average in the
  // same pass; gloo does not.
  if (!at::isFloatingType(flat.scalar_type())) return false;
  const std::string name = backendName(flat);
  return name == "dsp" || name == "nccl";
}

void Reducer::waitLaunchedBuckets() {
  for (size_t b = 0; b < next_launch_; ++b) {
    if (buckets_[b].future) buckets_[b].future->wait();
  }
  expect_hooks_ = false;
}

void Reducer::failUnreduced() {
  std::ostringstream names, indices;
  bool first = true;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (ready_[i]) continue;
    names << (first ? "" : ", ") << names_[i];
    indices << (first ? "" : " ") << i;
    first = false;
  }
  waitLaunchedBuckets();
  TORCH_CHECK(
      false,
      "Expected to have finished reduction in the prior iteration before starting a new "
      "one. This error indicates that your module has parameters that were not used in "
      "producing loss. You can enable unused parameter detection by passing the keyword "
      "argument `find_unused_parameters=True` to `DistributedDataParallel`, and by "
      "making "
      "sure all `forward` function outputs participate in calculating loss. Parameters "
      "which did not receive grad for rank ",
      group_->getRank(), ": ", names.str(),
      "\nParameter indices which did not receive "
      "grad for rank ",
      group_->getRank(), ": ", indices.str());
}

std::vector<bool> Reducer::globallyUsed() const {
  std::vector<int32_t> flags(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) flags[i] = locally_used_[i] ? 1 : 0;
  std::vector<at::Tensor> t = {at::tensor(flags, at::kInt).to(params_[0].device())};
  group_->allreduce(t)->wait();
  const at::Tensor used = t[0].cpu();
  std::vector<bool> out(params_.size());
  const int* p = used.data_ptr<int>();
  for (size_t i = 0; i < params_.size(); ++i) out[i] = p[i] > 0;
  return out;
}

void Reducer::finalizeBackward() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!expect_hooks_) return;
  if (options_.static_graph && iteration_ == 0) {
    // Every hook has fired: mark each parameter once, used or not.
    for (size_t i = 0; i < params_.size(); ++i) markReadyLocked(i, locally_used_[i]);
    launchReadyLocked();
  }
  if (next_launch_ < buckets_.size()) failUnreduced();
  expect_hooks_ = false;
  const bool trackUsage = options_.find_unused_parameters || options_.static_graph;
  if (sharded()) {
    // Unused parameters contributed zeros to the shards: nothing to write back.
    for (auto& b : buckets_) finishShard(b);
    lock.unlock();
    const std::vector<bool> used =
        trackUsage ? globallyUsed() : std::vector<bool>(params_.size(), true);
    lock.lock();
    for (size_t i = 0; i < params_.size(); ++i) {
      if (used[i]) has_grad_[i] = true;
    }
    ++iteration_;
    return;
  }
  lock.unlock();

  for (auto& b : buckets_) {
    b.future->wait();
    if (comm_hook_) {
      at::Tensor result = comm_hook_->parseHookResult(b.future->value());
      if (!result.is_same(b.flat)) b.flat.copy_(result);
    }
  }
  const std::vector<bool> used =
      trackUsage ? globallyUsed() : std::vector<bool>(params_.size(), true);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!used[i]) continue;  // no rank produced a gradient: leave .grad as it is
    const Bucket& b = buckets_[bucket_of_[i]];
    if (inPlace(b)) continue;  // .grad holds the result already
    at::Tensor view = b.view(position_of_[i], params_[i]);
    at::Tensor& grad = params_[i].mutable_grad();
    if (options_.gradient_as_bucket_view) {
      if (!grad.is_alias_of(view)) {
        grad = view;
      }
    } else if (!grad.defined()) {
      grad = view.clone();
    } else {
      grad.copy_(view);
    }
  }
  ++iteration_;
}

}  // namespace dsparallel
