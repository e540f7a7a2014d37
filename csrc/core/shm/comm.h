// ShmComm: collectives among the processes of one host over one POSIX
// shared-memory segment.
//
// Ordering contract: every rank calls the same collectives in the same order
// (as in any c10d backend). One ShmComm is driven by one thread at a time.
//
// Protocol. Each rank owns a control block (a step counter it alone advances)
// and two data slots. A collective is a sequence of *steps*; in step s a rank
// writes into its slot s%2, advances its counter to s, waits until every
// rank's counter reached s, then reads the others' slot s%2. The rule that
// makes double-buffering safe: a rank reads slot s%2 of a peer only during
// step s (and step s+1 for the reduced `out` half, see allReduce), and writes
// its own slot s%2 only after every rank reached s-1, by which time all reads
// of step s-2 are finished. The first step of every collective also carries a
// Descriptor (kind, dtype, op, root, sequence number, shape), which every
// rank checks against all the others: a mismatch raises the same error on
// every rank, and all of them have consumed exactly one step, so the group
// stays usable.
//
// Failure: every wait has the group's deadline. A rank that does not arrive
// in time, or whose process has exited, makes the others raise an error that
// names the collective, its sequence number and the missing ranks; the comm is
// then broken and refuses further work.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "../reduce.h"
#include "liveness.h"
#include "p2p.h"
#include "segment.h"
#include "wait.h"

namespace dsp {

enum class Collective : uint32_t {
  kInit = 0,
  kAllReduce,
  kBroadcast,
  kReduce,
  kAllGather,
  kGather,
  kScatter,
  kReduceScatter,
  kAllToAll,
  kBarrier,
};
const char* collectiveName(Collective c);

constexpr int kMaxRanks = 64;
constexpr int kMaxDims = 8;

// What the caller says about one collective call: checked across ranks.
struct CallInfo {
  Collective kind = Collective::kBarrier;
  DType dtype = DType::kUInt8;
  ReduceOp op = ReduceOp::kSum;
  int root = -1;
  std::vector<int64_t> shape;  // of the tensor that must agree across ranks
  // Calls over several tensors (coalesced): how many, and a hash of all their
  // shapes, so that [4, 6] + [6, 4] on one rank and [6, 4] + [4, 6] on
  // another disagree although their element counts match. 0: one tensor.
  uint32_t tensors = 0;
  uint64_t shapes_hash = 0;
};

// The shapes_hash of a list of shapes (FNV-1a over ndim and dims).
uint64_t hashShapes(const std::vector<std::vector<int64_t>>& shapes);

// Raised (on every rank) when ranks disagree about a collective.
class MismatchError : public std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Raised when a peer is late past the deadline or has died.
class PeerError : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The chunk for this machine: 256 KiB where each core has at least 2 MiB of
// L2, 512 KiB elsewhere. A step of the 2-rank all-reduce touches about 4.5
// chunks per rank (its input piece, both halves of its slot, the peer's
// slices, its output piece): 2.3 MiB at 512 KiB, more than such an L2 holds.
// Measured with benchmarks/collectives.py: on a 2-core Intel Xeon (2 MiB
// L2), 256 KiB took 2-rank 1-4 MB all-reduces to 0.63-0.92x the time of
// 512 KiB (1 and 2 MiB were no better than 512 KiB), and 4 ranks sharing
// its 2 cores saw no difference beyond their noise; on a 2-core AMD EPYC
// (32 MiB L3, whose Zen 3/4 cores have 0.5-1 MiB of L2) 512 KiB
// was no slower than 1 MiB, and it lets a 4-rank tp x pp job fit in a
// container's 64 MB /dev/shm.
size_t defaultChunkBytes();

struct ShmOptions {
  // Bytes per half-slot; a slot (one parity) is twice this. The all-reduce
  // moves `chunk_bytes` per step; byte-moving collectives a whole slot. The
  // slots (4 x this per rank) are reserved in /dev/shm with the segment.
  // 0: defaultChunkBytes().
  size_t chunk_bytes = 0;
  // All-reduces up to this size use the one-shot algorithm (every rank
  // reduces everything: one synchronisation); larger ones reduce-scatter
  // then all-gather (each rank reduces 1/n).
  size_t one_shot_max_bytes = size_t{256} << 10;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  // Spin/yield budgets before sleeping; negative: defaultWaitPolicy's.
  int spins = -1;
  int yields = -1;
  // Point-to-point receives, with a core per rank, keep spinning this many
  // microseconds before sleeping (negative: the default). A pipeline's
  // receive waits for a peer's compute, hundreds of microseconds, and the
  // futex sleep and wake-up cost 1-2% of a small pipeline step on the 2-core
  // reference machine. Collectives keep the short budget: their waits
  // overlap compute in the same process (DDP), which a spinner would slow.
  int p2p_spin_us = -1;
  // Processes of this job sharing the machine's cores (which decides the
  // default wait policy); negative: the comm's size. More than the comm when
  // one machine plays several hosts.
  int machine_ranks = -1;
  // Bytes of each point-to-point ring (one per ordered pair of ranks); 0:
  // ShmP2P::defaultRingBytes(size).
  size_t p2p_ring_bytes = 0;
  // Point-to-point messages too large for a ring are read in place by the
  // receiver (ShmP2P::sendInPlace) between ranks whose memory it can read;
  // false: never (they go elsewhere).
  bool p2p_single_copy = true;
  // What a rank sets aside for point-to-point receives not posted yet
  // (ShmP2P::Limits).
  ShmP2P::Limits p2p_limits;
  // A collective that writes at least this many bytes into its output copies
  // them there with non-temporal stores (stream_copy.h); 0: half the
  // last-level cache (defaultStreamMinBytes).
  size_t stream_min_bytes = 0;
};

// Several buffers of one dtype seen as one array: an all-reduce over them
// reads and writes each in place, with no packing copy before or after (the
// gradients of a DDP bucket). Each buffer is contiguous.
class BufferList {
 public:
  BufferList(std::vector<void*> ptrs, std::vector<size_t> counts, size_t elem_size);
  size_t count() const { return total_; }
  size_t elementSize() const { return es_; }
  // Calls fn(char* piece, size_t done, size_t n) for the pieces that cover
  // elements [off, off + len) in order; `done` counts the elements of the
  // range before this piece.
  template <typename Fn>
  void forRange(size_t off, size_t len, Fn&& fn) const;

 private:
  std::vector<char*> ptrs_;
  std::vector<size_t> starts_;  // element offset of each buffer; one past the end last
  size_t es_;
  size_t total_ = 0;
};

template <typename Fn>
void BufferList::forRange(size_t off, size_t len, Fn&& fn) const {
  if (len == 0) return;
  // The buffer holding element `off`: the last start at or before it.
  size_t i = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), off) -
                                 starts_.begin()) -
             1;
  size_t done = 0;
  while (done < len) {
    const size_t at = off + done - starts_[i];
    const size_t n = std::min(len - done, starts_[i + 1] - starts_[i] - at);
    if (n) fn(ptrs_[i] + at * es_, done, n);
    done += n;
    ++i;
  }
}

class ShmComm {
 public:
  // Rank 0 creates the segment `name`; the others attach to it. Returns after
  // every rank attached; rank 0 unlinks the name before it returns, so once
  // any rank's first collective has completed the name is gone. On rank 0,
  // `created` (if set) is called once the segment exists, with "" (the peers
  // may now attach), or with the error that stopped its creation (which is
  // then thrown): the caller tells the peers either way, so that they never
  // look for a segment that does not exist yet, and all raise the same error.
  ShmComm(const std::string& name, int rank, int size, ShmOptions options,
          const std::function<void(const std::string& error)>& created = {});
  ~ShmComm();
  ShmComm(const ShmComm&) = delete;
  ShmComm& operator=(const ShmComm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // Bytes of the segment, all reserved in /dev/shm while the group lives.
  size_t segmentBytes() const { return segment_.size(); }
  // Thread-safe: read by callers while another thread runs a collective.
  uint64_t sequenceNumber() const { return seq_.load(std::memory_order_relaxed); }
  // options().timeout is the initial timeout; timeout() the current one.
  const ShmOptions& options() const { return options_; }
  std::chrono::milliseconds timeout() const {
    return std::chrono::milliseconds(timeout_ms_.load(std::memory_order_relaxed));
  }
  // Thread-safe; applies from the next collective (or receive) on.
  void setTimeout(std::chrono::milliseconds t) {
    timeout_ms_.store(t.count(), std::memory_order_relaxed);
    p2p_->setTimeout(t);
  }
  // Thread-safe: wakes a thread waiting in a collective or a receive (within a
  // few ms), which then raises `reason`; every later call raises it too. The
  // peers are out of step after this, so the comm never works again.
  void abort(const std::string& reason);
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }
  std::string abortReason() const {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    return abort_reason_;
  }
  // Point-to-point messages over the same segment (thread-safe, independent
  // of the collectives' one-thread rule).
  ShmP2P& p2p() { return *p2p_; }

  // out[i] = op over ranks of in[i]; in may equal out. AVG divides by size().
  void allReduce(const void* in, void* out, size_t count, const CallInfo& info);
  // The same, in place over several buffers taken as one array.
  void allReduce(const BufferList& buffers, const CallInfo& info);
  // buf on every rank becomes root's buf.
  void broadcast(void* buf, size_t bytes, const CallInfo& info);
  // out (root only; may equal in) = op over ranks of in.
  void reduce(const void* in, void* out, size_t count, const CallInfo& info);
  // outs[r] (size() pointers, each `bytes`) = rank r's in.
  void allGather(const void* in, size_t bytes, void* const* outs, const CallInfo& info);
  // As allGather, outs read on root only.
  void gather(const void* in, size_t bytes, void* const* outs, const CallInfo& info);
  // out = root's ins[rank()] (ins read on root only).
  void scatter(const void* const* ins, void* out, size_t bytes, const CallInfo& info);
  // out = op over ranks r of rank r's ins[rank()] (count elements each).
  void reduceScatter(const void* const* ins, void* out, size_t count,
                     const CallInfo& info);
  // The same with the input blocks laid end to end across several buffers
  // (size() x count elements in all): block j is elements [j count, (j+1)
  // count) of the list. The gradients of a ZeRO-2 bucket, read where they are.
  void reduceScatter(const BufferList& in, void* out, size_t count, const CallInfo& info);
  // outs[r] (recv_bytes[r]) = rank r's ins[rank()] (its send_bytes[rank()]).
  void allToAll(const void* const* ins, const size_t* send_bytes, void* const* outs,
                const size_t* recv_bytes, const CallInfo& info);
  void barrier();

 private:
  struct Layout;
  struct RankControl;

  RankControl& control(int r) const;
  // Whether rank r's process runs (see liveness.h).
  bool peerAlive(int r) const;
  char* slot(int r, uint32_t step) const;
  size_t slotBytes() const { return 2 * options_.chunk_bytes; }
  // Whether a collective writing `out_bytes` into its output streams them.
  bool streams(size_t out_bytes) const { return out_bytes >= options_.stream_min_bytes; }

  // Begins a collective: checks the comm is usable, takes a sequence number.
  void begin(const CallInfo& info);
  uint32_t nextStep() { return ++step_; }
  void publishDescriptor(uint32_t step, const CallInfo& info, size_t count);
  void publishSplits(uint32_t step, const size_t* send, const size_t* recv);
  void arriveAndWait(uint32_t step);
  void checkDescriptors(uint32_t step, bool compare_counts) const;
  void checkSplits(uint32_t step) const;
  size_t maxSendOverRanks(uint32_t step) const;
  [[noreturn]] void failWaiting(uint32_t step, bool dead_peer);
  [[noreturn]] void failAborted() const;
  // Finds which ranks can read which ranks' memory (one step; see p2p.h).
  void probeSingleCopy();

  template <typename Write, typename Read>
  void chunkedSteps(size_t total, size_t per, size_t count, const CallInfo& info,
                    Write&& write, Read&& read);
  // The two all-reduce algorithms, over an Io that copies ranges of the
  // input into a slot (gather), of a slot into the output (scatter), and
  // visits output ranges in pieces (forOut): one contiguous buffer or a
  // BufferList.
  template <typename Io>
  void allReduceWith(const Io& io, size_t count, const CallInfo& info);
  template <typename Io>
  void allReduceOneShot(const Io& io, size_t count, const CallInfo& info);
  template <typename Io>
  void allReduceScatterGather(const Io& io, size_t count, const CallInfo& info);

  int rank_;
  int size_;
  ShmOptions options_;
  Segment segment_;
  uint32_t step_ = 0;
  std::atomic<uint64_t> seq_{0};
  std::atomic<int64_t> timeout_ms_;
  std::atomic<bool> aborted_{false};
  mutable std::mutex abort_mutex_;
  std::string abort_reason_;  // under abort_mutex_
  Collective current_ = Collective::kInit;
  std::chrono::steady_clock::time_point deadline_;
  WaitPolicy wait_policy_;
  std::string broken_;  // non-empty: why this comm refuses work
  std::unique_ptr<PeerLiveness> liveness_;
  std::unique_ptr<ShmP2P> p2p_;
  uint64_t probe_word_;  // what a peer reading our memory must find
};

}  // namespace dsp
