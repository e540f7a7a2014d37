// ProcessGroupDSP: the c10d::Backend behind torch.distributed's "dsp".
//
// Ordering contract (as in torch's ProcessGroupGloo): collectives run in the
// order they were issued, one at a time, on this group's shared-memory comm.
// Validation (device, dtype, op) happens in the caller's thread, before a
// collective is queued, so bad input raises at the call and never reaches
// the peers. Work runs on the group's worker thread; a thread that waits on a
// Work helps by running the queued collectives itself, in order, so a
// blocking call issued while nothing is queued runs on the caller's thread
// without the hand-off.
//
// Point-to-point send/recv between ranks of one host go through shared-memory
// rings (core/shm/p2p.h): a send copies into the peer's ring and returns, a
// receive copies out in the thread that waits on it; no socket, no helper
// thread. Messages larger than a ring takes, and every message of a group
// that spans hosts, go through an internal gloo backend that the Python
// creator builds beside this one (see p2p.cpp).
//
// Several hosts: the creator finds which ranks share a host (through the
// store) and hands this group the host's ranks (`Topology`). The shared-memory
// comm then spans only this host; all-reduce is hierarchical (see
// hierarchical.cpp) and the other collectives run over the world gloo group.
//
// CUDA tensors go to torch's ProcessGroupNCCL, which the creator builds when
// torch has CUDA and NCCL: NCCL is the fastest engine for them, and torch's
// group already gives the stream semantics (the collective waits on the
// caller's current stream, Work::wait makes the caller's stream wait on it),
// lazy per-device communicators, its watchdog and abort on error.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "core/shm/comm.h"

namespace dsparallel {

class ProcessGroupDSP;

class WorkDSP : public c10d::Work {
 public:
  WorkDSP(ProcessGroupDSP* pg, c10d::OpType type, const char* profiling_title,
          std::vector<at::Tensor> outputs, std::function<void()> run);
  ~WorkDSP() override;
  // How many were freed on a group's worker thread, process-wide: the
  // hand-off to the callers' threads (finished_) makes it 0.
  static int64_t freedOnWorker();

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  // Runs the collective; returns its error, if any.
  std::exception_ptr run();
  // Marks the work and its future done (with `error`, if any).
  void complete(std::exception_ptr error);

 private:
  ProcessGroupDSP* pg_;
  std::vector<at::Tensor> outputs_;
  std::function<void()> run_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// A blocking collective that ran on the caller's thread: finished when made.
class DoneWorkDSP : public c10d::Work {
 public:
  DoneWorkDSP(int rank, c10d::OpType type, const char* profiling_title,
              std::vector<at::Tensor> outputs);
  bool wait(std::chrono::milliseconds /*timeout*/ = kNoTimeout) override { return true; }
  std::vector<at::Tensor> result() override { return outputs_; }
  // Made on first request: a blocking call's caller rarely asks.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// Where this rank sits when the group spans several hosts.
struct Topology {
  int local_rank = -1;  // among the ranks of this host; -1: a single host
  int local_size = -1;
  // Gloo group of the ranks with this local_rank on every host (null when
  // hosts hold unequal numbers of ranks: all-reduce then goes flat over gloo).
  c10::intrusive_ptr<c10d::Backend> inter;
  // Global ranks of this host (in local order) and of `inter`, for messages.
  std::vector<int> host_ranks;
  std::vector<int> inter_ranks;
  // Every host's global ranks (host order, each in rank order): where any
  // rank sits, for the collectives with a root or a per-rank layout.
  std::vector<std::vector<int>> hosts;
  // Ranks of the group on this physical machine (several simulated hosts
  // may share it); -1: unknown.
  int machine_ranks = -1;
};

class ProcessGroupDSP : public c10d::Backend {
 public:
  // `store` is used to share the segment name among the ranks of the
  // shared-memory comm (the host's ranks when `topology` says so).
  ProcessGroupDSP(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                  std::chrono::milliseconds timeout,
                  c10::intrusive_ptr<c10d::Backend> p2p, Topology topology = {},
                  c10::intrusive_ptr<c10d::Backend> cuda = {});
  ~ProcessGroupDSP() override;

  const std::string getBackendName() const override { return "dsp"; }
  void setTimeout(std::chrono::milliseconds timeout) override;
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return comm_->sequenceNumber(); }
  bool supportsCoalescing() const override { return false; }
  // destroy_process_group() and abort reach only the backends torch knows of:
  // these pass them on to the ones this group owns (NCCL, gloo), so that
  // NCCL's communicators are shut down (or aborted) before its destructor.
  void shutdown() override;
  void abort() override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override;
  // A reduce-scatter whose input is `inputs` laid end to end (group size x
  // output elements in all), read where the tensors are: ZeRO-2 gradients
  // with no copy into a flat bucket. One host, CPU, contiguous, one dtype.
  c10::intrusive_ptr<c10d::Work> reduceScatterFromList(std::vector<at::Tensor> inputs,
                                                       at::Tensor output,
                                                       c10d::ReduceOp op);
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
      std::vector<int64_t>& input_split_sizes,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                               int tag) override;
  // As send() of one byte tensor holding `head`'s bytes, then `payload`'s
  // (host tensors; a receiver posts one buffer of their total size). Through
  // the rings the two go in without a copy that puts them together first:
  // the pipeline's activations, a header before a stage's output.
  c10::intrusive_ptr<c10d::Work> sendWithHead(const at::Tensor& head,
                                              const at::Tensor& payload, int dst_rank,
                                              int tag);

  // Runs queued work on the calling thread until `work` is complete (the
  // caller-runs fast path and the worker loop share this).
  void runUntil(WorkDSP* work);
  // Waits (the worker runs it) until `work` completes or `timeout` passes;
  // false on timeout.
  bool waitFor(WorkDSP* work, std::chrono::milliseconds timeout);
  // Makes the group refuse all further work with `reason`, waking a
  // collective or receive that is waiting now (abort, an expired wait).
  void breakGroup(const std::string& reason);

  // The shared-memory segment name (tests check it is gone from /dev/shm).
  const std::string& segmentName() const { return segment_name_; }
  size_t segmentBytes() const { return comm_->segmentBytes(); }
  // True when the group spans several hosts.
  bool multiHost() const {
    return topology_.local_size > 0 && topology_.local_size != getSize();
  }
  bool hierarchical() const { return multiHost() && topology_.inter; }
  // How many collectives took a hierarchical path (all-reduce, coalesced
  // too, broadcast, all-gather): which path ran is otherwise invisible, and
  // tests assert it.
  int64_t hierarchicalCalls() const { return hierarchical_calls_.load(); }

 private:
  // shutdown() or abort() (`call`), once, on every backend this group owns.
  void passOn(void (c10d::Backend::*call)());
  // recv (src_rank >= 0) and recvAnysource (-1): one routing for both.
  c10::intrusive_ptr<c10d::Work> receive(std::vector<at::Tensor>& tensors, int src_rank,
                                         int tag);

  // The shared-memory rings, when they serve `t` from `writer` to `reader`
  // (-1: any rank): CPU tensors on one host, small enough for a ring or
  // readable in place; null: gloo does.
  dsp::ShmP2P* shmP2P(const at::Tensor& t, int reader, int writer);

  // Queues `run` for the worker. A blocking call (`blocking`: torch's
  // asyncOp false, as dist.* passes without async_op=True, and no timeout
  // of its own) finding nothing queued or running runs at once on the
  // caller's thread instead, and returns a finished Work: no hand-off, no
  // wake-up of the worker, no future to fill, and no std::function made (a
  // template, so that an 8-byte call allocates nothing but its Work).
  template <typename Run>
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, const char* title,
                                         std::vector<at::Tensor> outputs, Run&& run,
                                         bool blocking = false) {
    if (blocking && inline_blocking_ && !batching() && beginInline()) {
      try {
        run();
      } catch (...) {
        endInline();
        throw;
      }
      endInline();
      return c10::make_intrusive<DoneWorkDSP>(getRank(), type, title, std::move(outputs));
    }
    return queue(type, title, std::move(outputs),
                 std::function<void()>(std::forward<Run>(run)));
  }
  template <typename Options>
  static bool blocking(const Options& opts) {
    return !opts.asyncOp && opts.timeout == c10d::kUnsetTimeout;
  }
  // enqueue()'s slow path: the worker's queue (or a BatchScope's list).
  c10::intrusive_ptr<c10d::Work> queue(c10d::OpType type, const char* title,
                                       std::vector<at::Tensor> outputs,
                                       std::function<void()> run);
  // enqueue()'s inline path: beginInline claims the group for this thread
  // when nothing is queued or running (false: queue instead); endInline
  // releases it, waking the worker for work queued meanwhile.
  bool beginInline();
  void endInline();
  // Whether a BatchScope is collecting this thread's calls.
  static bool batching();
  // While one lives on a thread, enqueue() on that thread collects the run
  // closures into `runs` (returning a placeholder) instead of queueing them.
  class BatchScope {
   public:
    explicit BatchScope(std::vector<std::function<void()>>* runs);
    ~BatchScope();

   private:
    std::vector<std::function<void()>>* previous_;
  };
  // The coalesced forms: member(i) issues the i-th call (checked at once,
  // collected by a BatchScope), and all of them run as one Work, whose error
  // is any member's (the first, naming its index).
  c10::intrusive_ptr<c10d::Work> coalesced(c10d::OpType type, const char* what,
                                           const std::vector<at::Tensor>& outputs,
                                           const std::vector<at::Tensor>& inputs,
                                           const std::function<void(size_t)>& member);
  void workerLoop();
  // The collectives other than all-reduce when the group spans hosts: the
  // world gloo group, which must exist.
  c10d::Backend& flat(const char* what);
  // The backend that serves a call on `t` when this group's shared memory
  // does not: NCCL for CUDA tensors, the world gloo group across hosts
  // (unless `across_hosts` is false: all-reduce has its own path). Null: ours.
  c10d::Backend* route(const at::Tensor& t, const char* what, bool across_hosts = true);
  c10d::Backend* route(const std::vector<at::Tensor>& ts, const char* what,
                       bool across_hosts = true);
  // Intra-host reduce-scatter, inter-host all-reduce of this rank's slice,
  // intra-host all-gather (hierarchical.cpp).
  void hierarchicalAllReduce(const at::Tensor& t, c10d::ReduceOp op);
  // The root's peers (same local index) broadcast across hosts, then each
  // host broadcasts over shared memory.
  void hierarchicalBroadcast(const at::Tensor& t, int root);
  // Each rank gathers its inter group's inputs across hosts, then the host
  // all-gathers those blocks over shared memory; outs[r] receives rank r's.
  void hierarchicalAllGather(const at::Tensor& in, const std::vector<at::Tensor>& outs);
  // The host reduce-scatters over shared memory so that local rank j holds
  // the host's sums of the chunks of j's inter group, which then
  // reduce-scatters them across hosts. chunks[r]: the input for rank r.
  void hierarchicalReduceScatter(const std::vector<at::Tensor>& chunks,
                                 const at::Tensor& out, c10d::ReduceOp op);
  // Before data crosses hosts over `group` (global ranks `ranks`; empty:
  // the world's): every rank's call must agree, or all raise the same error
  // (across_hosts.cpp). op and root: -1 when the call has none.
  void checkAcrossHosts(c10d::Backend& group, const std::vector<int>& ranks,
                        const char* what, const at::Tensor& t, int64_t op, int64_t root);
  // The global ranks with local index `local` on every host, ascending: the
  // members of that index's inter group, in that group's rank order.
  std::vector<int> interGroupOf(int local) const;
  // Pops and runs the next queued work if no other thread is running one.
  // Called and returns with `lock` held.
  bool runOne(std::unique_lock<std::mutex>& lock);

  std::unique_ptr<dsp::ShmComm> comm_;
  std::string segment_name_;
  c10::intrusive_ptr<c10d::Backend> p2p_;
  Topology topology_;
  c10::intrusive_ptr<c10d::Backend> cuda_;
  int64_t hier_piece_bytes_ = 4 << 20;  // DSP_HIER_PIECE_BYTES
  std::atomic<int64_t> hierarchical_calls_{0};
  bool check_across_hosts_ = true;  // DSP_CHECK_ACROSS_HOSTS
  bool inline_blocking_ = true;     // DSP_INLINE_BLOCKING

  std::mutex mutex_;
  std::condition_variable cv_;  // queue changed, or a work finished
  std::deque<c10::intrusive_ptr<WorkDSP>> queue_;
  // Finished work, kept for a caller's thread to drop (enqueue, runUntil,
  // the destructor), whether or not a caller still holds it. Its tensors may carry Python
  // objects, and the worker thread must not be the one to free them: that takes the GIL,
  // and a non-Python thread taking the GIL while the interpreter exits is terminated
  // mid-destructor (the process aborts).
  std::vector<c10::intrusive_ptr<WorkDSP>> finished_;
  std::atomic<bool> shut_down_{false};  // shutdown() or abort() passed on
  bool running_ = false;                // some thread is executing a collective
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace dsparallel
