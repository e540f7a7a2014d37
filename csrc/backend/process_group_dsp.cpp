// ProcessGroupDSP construction, routing (which engine serves a call), the work
// queue and WorkDSP. The collectives are in collectives.cpp, send/recv in p2p.cpp.
#include "process_group_dsp.h"

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>
#include <utility>

namespace dsparallel {
namespace {

constexpr const char* kSegmentKey = "dsp/shm_segment";
// Prefix of the segment key's value when rank 0 could not make the segment.
constexpr const char* kSegmentError = "!error: ";

size_t envBytes(const char* name, size_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const unsigned long long x = std::strtoull(v, &end, 10);
  TORCH_CHECK(end != v && *end == '\0' && x > 0, "dsp: ", name,
              " must be a positive number of bytes, got '", v, "'");
  return static_cast<size_t>(x);
}

int envInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  TORCH_CHECK(end != v && *end == '\0' && x >= 0, "dsp: ", name,
              " must be a non-negative integer, got '", v, "'");
  return static_cast<int>(x);
}

// Set on the group's worker threads: a Work must never be freed there.
thread_local bool t_worker = false;
std::atomic<int64_t> g_freed_on_worker{0};

}  // namespace

// ---------------------------------------------------------------------------
// WorkDSP

WorkDSP::~WorkDSP() {
  if (t_worker) g_freed_on_worker.fetch_add(1, std::memory_order_relaxed);
}

int64_t WorkDSP::freedOnWorker() { return g_freed_on_worker.load(); }

WorkDSP::WorkDSP(ProcessGroupDSP* pg, c10d::OpType type, const char* profiling_title,
                 std::vector<at::Tensor> outputs, std::function<void()> run)
    : c10d::Work(pg->getRank(), type, profiling_title),
      pg_(pg),
      outputs_(std::move(outputs)),
      run_(std::move(run)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))) {}

std::exception_ptr WorkDSP::run() {
  try {
    run_();
  } catch (...) {
    run_ = nullptr;  // drop captured tensors as early as possible
    return std::current_exception();
  }
  run_ = nullptr;
  return nullptr;
}

void WorkDSP::complete(std::exception_ptr error) {
  finish(error);
  if (error) {
    future_->setError(error);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
}

bool WorkDSP::wait(std::chrono::milliseconds timeout) {
  if (!isCompleted()) {
    if (timeout == kNoTimeout) {
      pg_->runUntil(this);
    } else if (!pg_->waitFor(this, timeout)) {
      // As torch's gloo: an expired wait raises. The collective is abandoned
      // halfway, which leaves the peers out of step, so the group is broken
      // (the collective, if running, fails within a few ms).
      pg_->breakGroup("dsp: a Work.wait(timeout) expired after " +
                      std::to_string(timeout.count()) + " ms on rank " +
                      std::to_string(pg_->getRank()) +
                      "; the ranks of this process group are out of step, so it "
                      "refuses further work: create a new group");
      TORCH_CHECK(false, "dsp: Work.wait timed out after ", timeout.count(), " ms (rank ",
                  pg_->getRank(), "); this process group is now unusable");
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

DoneWorkDSP::DoneWorkDSP(int rank, c10d::OpType type, const char* profiling_title,
                         std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type, profiling_title), outputs_(std::move(outputs)) {
  finish(nullptr);
}

c10::intrusive_ptr<c10::ivalue::Future> DoneWorkDSP::getFuture() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!future_) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(
        c10::ListType::create(c10::TensorType::get()));
    future_->markCompleted(c10::IValue(outputs_));
  }
  return future_;
}

// ---------------------------------------------------------------------------
// ProcessGroupDSP: set-up and the queue

// Which engine serves a call: NCCL for CUDA tensors, the world gloo group for
// a call that spans hosts; null for our shared memory.
c10d::Backend& ProcessGroupDSP::flat(const char* what) {
  TORCH_CHECK(p2p_, "dsp ", what, ": this call needs the group's internal gloo group");
  return *p2p_;
}

c10d::Backend* ProcessGroupDSP::route(const at::Tensor& t, const char* what,
                                      bool across_hosts) {
  if (t.is_sparse()) {
    // Sparse all-reduce exchanges indices and values of varying length: gloo
    // (our internal group) already does it, so sparse tensors go there.
    return &flat(what);
  }
  if (t.is_cuda()) {
    TORCH_CHECK(cuda_, "dsp ", what, ": the tensor is on ", t.device(),
                " but this group has no NCCL backend (torch without CUDA or NCCL, or "
                "no GPU when the group was created)");
    return cuda_.get();
  }
  if (across_hosts && multiHost()) {
    // All-to-all's tensors may differ in size across ranks (uneven splits):
    // only its name and dtype must agree.
    const bool sized = std::string(what).rfind("all_to_all", 0) != 0;
    checkAcrossHosts(flat(what), {}, what, sized ? t : t.new_empty({0}), -1, -1);
    return &flat(what);
  }
  return nullptr;
}

c10d::Backend* ProcessGroupDSP::route(const std::vector<at::Tensor>& ts, const char* what,
                                      bool across_hosts) {
  if (ts.empty()) return multiHost() ? &flat(what) : nullptr;
  return route(ts[0], what, across_hosts);
}

ProcessGroupDSP::ProcessGroupDSP(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                 int size, std::chrono::milliseconds timeout,
                                 c10::intrusive_ptr<c10d::Backend> p2p, Topology topology,
                                 c10::intrusive_ptr<c10d::Backend> cuda)
    : c10d::Backend(rank, size),
      p2p_(std::move(p2p)),
      topology_(std::move(topology)),
      cuda_(std::move(cuda)) {
  const int comm_rank = multiHost() ? topology_.local_rank : rank;
  const int comm_size = multiHost() ? topology_.local_size : size;
  TORCH_CHECK(!multiHost() || p2p_, "dsp: a group spanning hosts needs the gloo group");
  dsp::ShmOptions options;
  options.chunk_bytes = envBytes("DSP_CHUNK_BYTES", options.chunk_bytes);
  options.one_shot_max_bytes = envBytes("DSP_ONE_SHOT_BYTES", options.one_shot_max_bytes);
  options.timeout = timeout;
  options.machine_ranks = topology_.machine_ranks;
  options.spins = envInt("DSP_SPINS", options.spins);
  options.yields = envInt("DSP_YIELDS", options.yields);
  options.p2p_spin_us = envInt("DSP_P2P_SPIN_US", options.p2p_spin_us);
  options.p2p_ring_bytes = envBytes("DSP_P2P_RING_BYTES", options.p2p_ring_bytes);
  options.p2p_single_copy = envInt("DSP_P2P_SINGLE_COPY", 1) != 0;
  options.p2p_limits.unexpected_bytes =
      envBytes("DSP_P2P_UNEXPECTED_BYTES", options.p2p_limits.unexpected_bytes);
  options.p2p_limits.unexpected_messages =
      envInt("DSP_P2P_UNEXPECTED_MESSAGES",
             static_cast<int>(options.p2p_limits.unexpected_messages));
  options.stream_min_bytes = envBytes("DSP_STREAM_BYTES", options.stream_min_bytes);
  check_across_hosts_ = envInt("DSP_CHECK_ACROSS_HOSTS", 1) != 0;
  // 0: blocking calls are queued like the others (for A/B measurements).
  inline_blocking_ = envInt("DSP_INLINE_BLOCKING", 1) != 0;
  hier_piece_bytes_ =
      static_cast<int64_t>(envBytes("DSP_HIER_PIECE_BYTES", hier_piece_bytes_));
  // The store handed to a backend is already prefixed per group, so each
  // group (and each job, with its own store) gets its own segment. Rank 0
  // publishes the name only once the segment exists (or why it could not be
  // made: every rank then raises that error, not a timeout 30 minutes later).
  std::function<void(const std::string&)> created;
  if (comm_rank == 0) {
    segment_name_ = dsp::Segment::randomName();
    created = [&store, this](const std::string& error) {
      const std::string value = error.empty() ? segment_name_ : kSegmentError + error;
      store->set(kSegmentKey, std::vector<uint8_t>(value.begin(), value.end()));
    };
  } else {
    const auto bytes = store->get(kSegmentKey);
    segment_name_.assign(bytes.begin(), bytes.end());
    if (segment_name_.rfind(kSegmentError, 0) == 0) {
      TORCH_CHECK(false,
                  segment_name_.substr(std::char_traits<char>::length(kSegmentError)),
                  " (reported by rank 0 of this host's shared-memory group)");
    }
  }
  comm_ = std::make_unique<dsp::ShmComm>(segment_name_, comm_rank, comm_size, options,
                                         created);
  worker_ = std::thread([this] { workerLoop(); });
}

ProcessGroupDSP::~ProcessGroupDSP() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void ProcessGroupDSP::shutdown() { passOn(&c10d::Backend::shutdown); }

void ProcessGroupDSP::abort() {
  breakGroup(
      "dsp: this process group was aborted (abort() was called); its ranks are "
      "out of step, so it refuses further work: create a new group");
  passOn(&c10d::Backend::abort);
}

void ProcessGroupDSP::breakGroup(const std::string& reason) { comm_->abort(reason); }

void ProcessGroupDSP::passOn(void (c10d::Backend::*call)()) {
  if (shut_down_.exchange(true)) return;
  for (auto* b : {cuda_.get(), p2p_.get(), topology_.inter.get()})
    if (b) (b->*call)();
}

void ProcessGroupDSP::setTimeout(std::chrono::milliseconds timeout) {
  // Atomic in the comm: a collective running on the worker thread reads it.
  comm_->setTimeout(timeout);
}

namespace {
thread_local std::vector<std::function<void()>>* t_batch = nullptr;
}  // namespace

ProcessGroupDSP::BatchScope::BatchScope(std::vector<std::function<void()>>* runs)
    : previous_(std::exchange(t_batch, runs)) {}

ProcessGroupDSP::BatchScope::~BatchScope() { t_batch = previous_; }

bool ProcessGroupDSP::batching() { return t_batch != nullptr; }

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::queue(c10d::OpType type,
                                                      const char* title,
                                                      std::vector<at::Tensor> outputs,
                                                      std::function<void()> run) {
  if (t_batch != nullptr) {
    t_batch->push_back(std::move(run));
    return {};  // the caller (coalesced) ignores it
  }
  auto work =
      c10::make_intrusive<WorkDSP>(this, type, title, std::move(outputs), std::move(run));
  std::vector<c10::intrusive_ptr<WorkDSP>> finished;  // dropped here, unlocked
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!stop_, "dsp: process group is shutting down");
    TORCH_CHECK(!comm_->aborted(), comm_->abortReason());
    queue_.push_back(work);
    finished.swap(finished_);
  }
  cv_.notify_all();
  return work;
}

bool ProcessGroupDSP::beginInline() {
  std::vector<c10::intrusive_ptr<WorkDSP>> finished;  // dropped here, unlocked
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!stop_, "dsp: process group is shutting down");
  TORCH_CHECK(!comm_->aborted(), comm_->abortReason());
  // Queued work runs first (collectives run in issue order).
  if (running_ || !queue_.empty()) return false;
  running_ = true;
  finished.swap(finished_);
  return true;
}

void ProcessGroupDSP::endInline() {
  bool queued = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    running_ = false;
    queued = !queue_.empty();  // another thread's, issued meanwhile
  }
  if (queued) cv_.notify_all();
}

bool ProcessGroupDSP::runOne(std::unique_lock<std::mutex>& lock) {
  if (running_ || queue_.empty()) return false;
  auto work = std::move(queue_.front());
  queue_.pop_front();
  running_ = true;
  lock.unlock();
  const std::exception_ptr error = work->run();
  lock.lock();
  running_ = false;
  lock.unlock();
  // Completed with no lock held and the queue free: a future callback (a
  // DDP comm hook) may issue and wait on further collectives.
  work->complete(error);
  lock.lock();
  // Handed to finished_ whoever else holds it: only a caller's thread empties
  // that list, so the worker never drops the last reference. (Deciding by
  // use_count() raced with a caller dropping its reference right after.)
  finished_.push_back(std::move(work));
  cv_.notify_all();
  return true;
}

void ProcessGroupDSP::runUntil(WorkDSP* work) {
  std::vector<c10::intrusive_ptr<WorkDSP>> finished;  // dropped here, unlocked
  std::unique_lock<std::mutex> lock(mutex_);
  while (!work->isCompleted()) {
    if (!runOne(lock)) cv_.wait(lock);
  }
  finished.swap(finished_);
  lock.unlock();
}

bool ProcessGroupDSP::waitFor(WorkDSP* work, std::chrono::milliseconds timeout) {
  // The caller does not run the collective itself here: its own waits would
  // have the group's deadline, not this one. The worker runs it.
  std::vector<c10::intrusive_ptr<WorkDSP>> finished;  // dropped here, unlocked
  std::unique_lock<std::mutex> lock(mutex_);
  const bool done = cv_.wait_for(lock, timeout, [work] { return work->isCompleted(); });
  finished.swap(finished_);
  lock.unlock();
  return done;
}

void ProcessGroupDSP::workerLoop() {
  t_worker = true;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    if (runOne(lock)) continue;
    if (stop_ && queue_.empty() && !running_) return;
    cv_.wait(lock);
  }
}

}  // namespace dsparallel
