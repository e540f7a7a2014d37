#include "comm.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <sstream>

#include "../cpu_cache.h"
#include "../stream_copy.h"
#include "liveness.h"
#include "wait.h"

namespace dsp {
namespace {

constexpr size_t kCacheLine = 64;
constexpr size_t kPage = 4096;
constexpr size_t kSoloChunkBytes = size_t{64} << 10;
// How long a point-to-point receive spins before it sleeps, with a core per
// rank (ShmOptions::p2p_spin_us): longer than most pipeline bubbles at small
// widths, short enough that a long wait still ends up asleep.
constexpr int kP2PSpinUs = 1000;
constexpr uint64_t kMagic = 0x6473702d73686d31ull;  // "dsp-shm1"
// Rank r's probe word holds kProbe + r.
constexpr uint64_t kProbe = 0x6473702d70726f00ull;  // "dsp-pro\0"

size_t roundUp(size_t x, size_t to) { return (x + to - 1) / to * to; }

// [begin, end) of slice j when `len` elements are split among n ranks in
// ceil(len/n) pieces (the last ones may be short or empty).
std::pair<size_t, size_t> sliceOf(int j, size_t len, int n) {
  const size_t q = (len + n - 1) / n;
  const size_t b = std::min(len, q * static_cast<size_t>(j));
  return {b, std::min(len, b + q)};
}

size_t ceilDiv(size_t a, size_t b) { return (a + b - 1) / b; }

}  // namespace

size_t defaultChunkBytes() {
  // Read once: every process group of the job asks when it is made.
  static const size_t bytes =
      cacheBytes(2) >= (size_t{2} << 20) ? size_t{256} << 10 : size_t{512} << 10;
  return bytes;
}

const char* collectiveName(Collective c) {
  switch (c) {
    case Collective::kInit:
      return "init";
    case Collective::kAllReduce:
      return "all_reduce";
    case Collective::kBroadcast:
      return "broadcast";
    case Collective::kReduce:
      return "reduce";
    case Collective::kAllGather:
      return "all_gather";
    case Collective::kGather:
      return "gather";
    case Collective::kScatter:
      return "scatter";
    case Collective::kReduceScatter:
      return "reduce_scatter";
    case Collective::kAllToAll:
      return "all_to_all";
    case Collective::kBarrier:
      return "barrier";
  }
  return "unknown";
}

// ---------------------------------------------------------------------------
// Shared-memory layout. Everything below crosses processes: fixed-size types,
// each struct padded to its own cache lines.

struct Descriptor {
  uint32_t kind;
  uint32_t dtype;
  uint32_t op;
  int32_t root;
  uint64_t seq;
  uint64_t count;
  uint32_t ndim;
  uint32_t tensors;  // coalesced calls: how many tensors (0: one)
  int64_t dims[kMaxDims];
  uint64_t shapes_hash;  // coalesced calls: hashShapes of all of them
  char tail[16];
};
static_assert(sizeof(Descriptor) % kCacheLine == 0, "Descriptor: whole lines");

struct alignas(kCacheLine) ShmComm::RankControl {
  WaitWord step;  // advanced by the owner only; waited on by everyone
  char pad0[kCacheLine - sizeof(WaitWord)];
  std::atomic<int32_t> pid;
  std::atomic<uint64_t> probe;     // the address of the owner's probe_word_
  std::atomic<uint64_t> readable;  // bit r: the owner can read rank r's memory
  char pad1[kCacheLine - 3 * sizeof(uint64_t)];
  Descriptor desc[2];                 // by step parity
  uint64_t send_bytes[2][kMaxRanks];  // all_to_all splits, by step parity
  uint64_t recv_bytes[2][kMaxRanks];
};
static_assert(sizeof(WaitWord) <= kCacheLine, "WaitWord: one line");
static_assert(sizeof(Descriptor) * 2 % kCacheLine == 0, "RankControl: whole lines");

struct alignas(kCacheLine) Header {
  uint64_t magic;
  uint64_t nranks;
  uint64_t chunk_bytes;
  uint64_t p2p_ring_bytes;
  char pad[kCacheLine - 4 * sizeof(uint64_t)];
};
static_assert(sizeof(Header) == kCacheLine, "Header: one line");

struct ShmComm::Layout {
  static size_t controlOffset() { return sizeof(Header); }
  static size_t slotsOffset(int n) {
    return roundUp(sizeof(Header) + n * sizeof(RankControl), kPage);
  }
  static size_t p2pOffset(int n, size_t slot_bytes) {
    return slotsOffset(n) + static_cast<size_t>(n) * 2 * slot_bytes;
  }
  static size_t total(int n, size_t slot_bytes, size_t ring_bytes) {
    return p2pOffset(n, slot_bytes) + ShmP2P::regionBytes(n, ring_bytes);
  }
};

// ---------------------------------------------------------------------------

ShmComm::ShmComm(const std::string& name, int rank, int size, ShmOptions options,
                 const std::function<void(const std::string&)>& created)
    : rank_(rank),
      size_(size),
      options_(options),
      timeout_ms_(options.timeout.count()),
      liveness_(std::make_unique<PeerLiveness>(std::max(size, 1))) {
  if (size < 1 || size > kMaxRanks || rank < 0 || rank >= size) {
    throw std::invalid_argument("dsp: shared-memory group of size " +
                                std::to_string(size) + " with rank " +
                                std::to_string(rank) + " is invalid (at most " +
                                std::to_string(kMaxRanks) + " ranks per host)");
  }
  if (options_.chunk_bytes == 0) options_.chunk_bytes = defaultChunkBytes();
  options_.chunk_bytes = roundUp(std::max<size_t>(options_.chunk_bytes, kPage), kPage);
  // A group of one only copies through its slots: small ones keep its
  // reserved segment small (init_parallel makes one per rank for each
  // parallel dimension of size one).
  if (size == 1) options_.chunk_bytes = std::min(options_.chunk_bytes, kSoloChunkBytes);
  const bool crowded =
      oversubscribed(options_.machine_ranks > 0 ? options_.machine_ranks : size);
  wait_policy_ = defaultWaitPolicy(crowded);
  if (options_.spins >= 0) wait_policy_.spins = options_.spins;
  if (options_.yields >= 0) wait_policy_.yields = options_.yields;
  if (options_.stream_min_bytes == 0) options_.stream_min_bytes = defaultStreamMinBytes();
  if (options_.p2p_ring_bytes == 0)
    options_.p2p_ring_bytes = ShmP2P::defaultRingBytes(size);
  options_.p2p_ring_bytes = roundUp(options_.p2p_ring_bytes, kCacheLine);
  const size_t bytes = Layout::total(size, slotBytes(), options_.p2p_ring_bytes);
  deadline_ = std::chrono::steady_clock::now() + options_.timeout;
  if (rank == 0) {
    try {
      segment_ = Segment::create(name, bytes);
    } catch (const std::exception& e) {
      if (created) created(e.what());
      throw;
    }
    if (created) created("");
    auto* h = static_cast<Header*>(segment_.data());
    h->nranks = static_cast<uint64_t>(size);
    h->chunk_bytes = options_.chunk_bytes;
    h->p2p_ring_bytes = options_.p2p_ring_bytes;
    std::atomic_thread_fence(std::memory_order_release);
    reinterpret_cast<std::atomic<uint64_t>*>(&h->magic)->store(kMagic);
  } else {
    segment_ = Segment::attach(name, bytes, deadline_);
    auto* h = static_cast<Header*>(segment_.data());
    while (reinterpret_cast<std::atomic<uint64_t>*>(&h->magic)->load() != kMagic) {
      if (std::chrono::steady_clock::now() > deadline_) {
        throw PeerError("dsp: shared-memory segment was never initialised by rank 0");
      }
      sched_yield();
    }
    if (h->nranks != static_cast<uint64_t>(size) ||
        h->chunk_bytes != options_.chunk_bytes ||
        h->p2p_ring_bytes != options_.p2p_ring_bytes) {
      throw std::runtime_error(
          "dsp: ranks disagree on the shared-memory layout (group size " +
          std::to_string(h->nranks) + " vs " + std::to_string(size) + ", chunk bytes " +
          std::to_string(h->chunk_bytes) + " vs " + std::to_string(options_.chunk_bytes) +
          ", ring bytes " + std::to_string(h->p2p_ring_bytes) + " vs " +
          std::to_string(options_.p2p_ring_bytes) +
          "): set DSP_CHUNK_BYTES and DSP_P2P_RING_BYTES alike");
    }
  }
  control(rank_).pid.store(static_cast<int32_t>(getpid()));
  probe_word_ = kProbe + static_cast<uint64_t>(rank_);
  control(rank_).probe.store(reinterpret_cast<uintptr_t>(&probe_word_));
  WaitPolicy p2p_policy = wait_policy_;
  if (!crowded) {  // else the awaited peer may need this very core
    p2p_policy.spin_us = options_.p2p_spin_us >= 0 ? options_.p2p_spin_us : kP2PSpinUs;
  }
  p2p_ = std::make_unique<ShmP2P>(
      static_cast<char*>(segment_.data()) + Layout::p2pOffset(size, slotBytes()), rank_,
      size_, options_.p2p_ring_bytes, timeout(), p2p_policy,
      [this](int r) { return peerAlive(r); }, options_.p2p_limits);
  // Init step: once every rank has arrived, every rank has attached, so the
  // name can go. From here on a crash leaves nothing in /dev/shm.
  current_ = Collective::kInit;
  const uint32_t s = nextStep();
  arriveAndWait(s);
  segment_.unlink();
  // Every peer has arrived, so its published pid is its own: pin it.
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) liveness_->watch(r, control(r).pid.load());
  }
  probeSingleCopy();
}

void ShmComm::probeSingleCopy() {
  // process_vm_readv may be refused: by ptrace rules (Yama's ptrace_scope
  // lets a process read only its descendants, and torchrun's workers are
  // siblings), by seccomp in a container. So every rank tries each peer's
  // probe word once and publishes what it read; one more step and every
  // rank knows the same table, so both ends of a pair route alike.
  uint64_t mine = 0;
  for (int r = 0; options_.p2p_single_copy && r < size_; ++r) {
    uint64_t got = 0;
    if (ShmP2P::readProcess(control(r).pid.load(), control(r).probe.load(), &got,
                            sizeof got) == 0 &&
        got == kProbe + static_cast<uint64_t>(r)) {
      mine |= uint64_t{1} << r;
    }
  }
  control(rank_).readable.store(mine);
  arriveAndWait(nextStep());
  std::vector<bool> table(static_cast<size_t>(size_) * size_);
  for (int reader = 0; reader < size_; ++reader) {
    const uint64_t bits = control(reader).readable.load();
    for (int writer = 0; writer < size_; ++writer) {
      table[static_cast<size_t>(reader) * size_ + writer] = (bits >> writer) & 1u;
    }
  }
  p2p_->enableSingleCopy(std::move(table),
                         [this](int r) { return control(r).pid.load(); });
}

ShmComm::~ShmComm() = default;

ShmComm::RankControl& ShmComm::control(int r) const {
  auto* base = static_cast<char*>(segment_.data()) + Layout::controlOffset();
  return reinterpret_cast<RankControl*>(base)[r];
}

char* ShmComm::slot(int r, uint32_t step) const {
  return static_cast<char*>(segment_.data()) + Layout::slotsOffset(size_) +
         (static_cast<size_t>(r) * 2 + (step & 1u)) * slotBytes();
}

void ShmComm::begin(const CallInfo& info) {
  if (!broken_.empty()) {
    throw PeerError(
        "dsp: this process group is unusable after an earlier "
        "failure: " +
        broken_);
  }
  if (aborted()) failAborted();
  current_ = info.kind;
  seq_.fetch_add(1, std::memory_order_relaxed);
  deadline_ = std::chrono::steady_clock::now() + timeout();
}

void ShmComm::publishDescriptor(uint32_t step, const CallInfo& info, size_t count) {
  Descriptor& d = control(rank_).desc[step & 1u];
  d.kind = static_cast<uint32_t>(info.kind);
  d.dtype = static_cast<uint32_t>(info.dtype);
  d.op = static_cast<uint32_t>(info.op);
  d.root = info.root;
  d.seq = sequenceNumber();
  d.tensors = info.tensors;
  d.shapes_hash = info.shapes_hash;
  d.count = count;
  d.ndim = static_cast<uint32_t>(info.shape.size());
  for (size_t i = 0; i < static_cast<size_t>(kMaxDims); ++i) {
    d.dims[i] = i < info.shape.size() ? info.shape[i] : 0;
  }
}

void ShmComm::publishSplits(uint32_t step, const size_t* send, const size_t* recv) {
  RankControl& c = control(rank_);
  for (int r = 0; r < size_; ++r) {
    c.send_bytes[step & 1u][r] = send[r];
    c.recv_bytes[step & 1u][r] = recv[r];
  }
}

bool ShmComm::peerAlive(int r) const {
  return liveness_->alive(r, control(r).pid.load());
}

void ShmComm::arriveAndWait(uint32_t step) {
  advance(control(rank_).step, step);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const RankControl& peer = control(r);
    const WaitResult res = waitFor(peer.step, step, deadline_, wait_policy_,
                                   [&] { return !aborted() && peerAlive(r); });
    if (res != WaitResult::kReached) {
      if (aborted()) failAborted();
      failWaiting(step, res == WaitResult::kCancelled);
    }
  }
}

void ShmComm::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    if (abort_reason_.empty()) abort_reason_ = reason;
  }
  aborted_.store(true, std::memory_order_release);
  p2p_->abort(reason);
}

void ShmComm::failAborted() const { throw PeerError(abortReason()); }

uint64_t hashShapes(const std::vector<std::vector<int64_t>>& shapes) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t x) {
    for (int i = 0; i < 8; ++i) {
      h ^= (x >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  for (const auto& s : shapes) {
    mix(s.size());
    for (int64_t d : s) mix(static_cast<uint64_t>(d));
  }
  return h;
}

void ShmComm::failWaiting(uint32_t step, bool dead_peer) {
  std::ostringstream missing;
  std::ostringstream dead;
  bool first = true;
  for (int r = 0; r < size_; ++r) {
    const RankControl& c = control(r);
    if (reached(c.step.value.load(), step)) continue;
    missing << (first ? "" : ", ") << r;
    if (!peerAlive(r)) {
      dead << " rank " << r << " (pid " << c.pid.load() << ") has exited.";
    }
    first = false;
  }
  std::ostringstream msg;
  msg << "dsp: " << collectiveName(current_) << " #" << sequenceNumber() << " on rank "
      << rank_ << " failed: rank(s) [" << missing.str() << "] did not arrive";
  if (dead_peer) {
    msg << " (a peer process died).";
  } else {
    msg << " within the timeout of " << timeout().count() << " ms.";
  }
  msg << dead.str();
  broken_ = msg.str();
  throw PeerError(broken_);
}

namespace {
std::string describe(const Descriptor& d) {
  std::ostringstream o;
  o << collectiveName(static_cast<Collective>(d.kind)) << " #" << d.seq << " "
    << dtypeName(static_cast<DType>(d.dtype));
  if (d.ndim > 0) {
    o << "[";
    for (uint32_t i = 0; i < std::min<uint32_t>(d.ndim, kMaxDims); ++i) {
      o << (i ? ", " : "") << d.dims[i];
    }
    o << (d.ndim > static_cast<uint32_t>(kMaxDims) ? ", ...]" : "]");
  } else {
    o << " count " << d.count;
  }
  const auto kind = static_cast<Collective>(d.kind);
  if (kind == Collective::kAllReduce || kind == Collective::kReduce ||
      kind == Collective::kReduceScatter) {
    o << " op " << reduceOpName(static_cast<ReduceOp>(d.op));
  }
  if (d.root >= 0) o << " root " << d.root;
  if (d.tensors > 0) {
    o << " over " << d.tensors << " tensors (shapes hash " << std::hex << d.shapes_hash
      << std::dec << ")";
  }
  return o.str();
}

bool sameCall(const Descriptor& a, const Descriptor& b, bool compare_counts) {
  if (a.kind != b.kind || a.dtype != b.dtype || a.op != b.op || a.root != b.root ||
      a.seq != b.seq) {
    return false;
  }
  if (!compare_counts) return true;
  if (a.count != b.count || a.ndim != b.ndim || a.tensors != b.tensors ||
      a.shapes_hash != b.shapes_hash) {
    return false;
  }
  return std::equal(a.dims, a.dims + kMaxDims, b.dims);
}
}  // namespace

void ShmComm::checkDescriptors(uint32_t step, bool compare_counts) const {
  const Descriptor& ref = control(0).desc[step & 1u];
  bool ok = true;
  for (int r = 1; r < size_ && ok; ++r) {
    ok = sameCall(ref, control(r).desc[step & 1u], compare_counts);
  }
  if (ok) return;
  // Every rank reads the same descriptors, so every rank raises this same
  // message.
  std::ostringstream msg;
  msg << "dsp: ranks called mismatched collectives at collective #" << seq_
      << " of this group (every rank must call the same collective with the "
      << "same dtype, shape, op and root):";
  for (int r = 0; r < size_; ++r) {
    msg << "\n  rank " << r << ": " << describe(control(r).desc[step & 1u]);
  }
  throw MismatchError(msg.str());
}

void ShmComm::checkSplits(uint32_t step) const {
  const unsigned p = step & 1u;
  for (int i = 0; i < size_; ++i) {
    for (int j = 0; j < size_; ++j) {
      const uint64_t sent = control(i).send_bytes[p][j];
      const uint64_t expected = control(j).recv_bytes[p][i];
      if (sent != expected) {
        std::ostringstream msg;
        msg << "dsp: all_to_all #" << sequenceNumber() << ": rank " << i << " sends "
            << sent << " bytes to rank " << j << ", which expects " << expected
            << " bytes from it (split sizes must match across ranks)";
        throw MismatchError(msg.str());
      }
    }
  }
}

size_t ShmComm::maxSendOverRanks(uint32_t step) const {
  uint64_t m = 0;
  for (int i = 0; i < size_; ++i) {
    for (int j = 0; j < size_; ++j) {
      m = std::max(m, control(i).send_bytes[step & 1u][j]);
    }
  }
  return static_cast<size_t>(m);
}

// ---------------------------------------------------------------------------
// all-reduce

// ---------------------------------------------------------------------------
// all-reduce

BufferList::BufferList(std::vector<void*> ptrs, std::vector<size_t> counts,
                       size_t elem_size)
    : es_(elem_size) {
  if (ptrs.size() != counts.size()) {
    throw std::invalid_argument("dsp: BufferList needs one count per buffer");
  }
  for (size_t i = 0; i < ptrs.size(); ++i) {
    ptrs_.push_back(static_cast<char*>(ptrs[i]));
    starts_.push_back(total_);
    total_ += counts[i];
  }
  starts_.push_back(total_);
  ptrs_.push_back(nullptr);  // forRange may step onto the end marker with n == 0
}

namespace {

// A rank's own data into its output, not through the segment: nothing when
// it is already there, memmove where the two overlap, else a copy that
// streams when `stream` (as the segment's copies do). A one-rank group's
// every result is this copy.
void copyOwn(void* to, const void* from, size_t bytes, bool stream) {
  if (to == from || bytes == 0) return;
  const auto* t = static_cast<const char*>(to);
  const auto* f = static_cast<const char*>(from);
  if (t < f + bytes && f < t + bytes) return (void)std::memmove(to, from, bytes);
  copyOut(to, from, bytes, stream);
}

// One contiguous input and output (which may be the same). `stream`: the
// copies out of the segment stream (a separate output outgrows the cache).
struct ContiguousIo {
  const char* in;
  char* out;
  size_t es;
  bool stream;
  void gather(void* dst, size_t off, size_t n) const {
    std::memcpy(dst, in + off * es, n * es);
  }
  void scatter(size_t off, size_t n, const void* src) const {
    copyOut(out + off * es, src, n * es, stream);
  }
  template <typename Fn>
  void forOut(size_t off, size_t n, Fn&& fn) const {
    if (n) fn(out + off * es, size_t{0}, n);
  }
  template <typename Fn>
  void forIn(size_t off, size_t n, Fn&& fn) const {
    if (n) fn(in + off * es, size_t{0}, n);
  }
  // The whole result when this rank is the only one: its input.
  void alone(size_t count) const { copyOwn(out, in, count * es, stream); }
};

// Several buffers, in place.
struct ListIo {
  const BufferList& list;
  void gather(void* dst, size_t off, size_t n) const {
    const size_t es = list.elementSize();
    list.forRange(off, n, [&](char* p, size_t done, size_t k) {
      std::memcpy(static_cast<char*>(dst) + done * es, p, k * es);
    });
  }
  void scatter(size_t off, size_t n, const void* src) const {
    const size_t es = list.elementSize();
    list.forRange(off, n, [&](char* p, size_t done, size_t k) {
      std::memcpy(p, static_cast<const char*>(src) + done * es, k * es);
    });
  }
  template <typename Fn>
  void forOut(size_t off, size_t n, Fn&& fn) const {
    list.forRange(off, n, fn);
  }
  template <typename Fn>
  void forIn(size_t off, size_t n, Fn&& fn) const {
    list.forRange(off, n, fn);
  }
  void alone(size_t) const {}  // in place: already the result
};

}  // namespace

void ShmComm::allReduce(const void* in, void* out, size_t count, const CallInfo& info) {
  // In place, each piece of the output was read into the slot a step before
  // it is written: still cached, where a streaming store would only evict it
  // (measured slower at 64 MB).
  const size_t es = elementSize(info.dtype);
  allReduceWith(ContiguousIo{static_cast<const char*>(in), static_cast<char*>(out), es,
                             in != out && streams(count * es)},
                count, info);
}

void ShmComm::allReduce(const BufferList& buffers, const CallInfo& info) {
  if (buffers.elementSize() != elementSize(info.dtype)) {
    throw std::invalid_argument("dsp: all_reduce buffers and dtype disagree on the size");
  }
  allReduceWith(ListIo{buffers}, buffers.count(), info);
}

// Begins the collective and picks the algorithm by size.
template <typename Io>
void ShmComm::allReduceWith(const Io& io, size_t count, const CallInfo& info) {
  begin(info);
  // One rank: every op over one operand is the operand (AVG divides by 1).
  // Through the segment this cost a world-size-1 group (a data-parallel
  // size of 1 in init_parallel) 5 ms at 64 MB.
  if (size_ == 1) return io.alone(count);
  const size_t bytes = count * elementSize(info.dtype);
  if (bytes <= options_.one_shot_max_bytes && bytes <= options_.chunk_bytes) {
    allReduceOneShot(io, count, info);
  } else {
    allReduceScatterGather(io, count, info);
  }
}

// Small messages: one step. Every rank copies its input into its slot, then
// reduces all n slots into its output. Fewest synchronisations; the n-fold
// read is cheap while it stays in cache.
template <typename Io>
void ShmComm::allReduceOneShot(const Io& io, size_t count, const CallInfo& info) {
  const size_t es = elementSize(info.dtype);
  const uint32_t s = nextStep();
  publishDescriptor(s, info, count);
  if (count) io.gather(slot(rank_, s), 0, count);
  arriveAndWait(s);
  checkDescriptors(s, true);
  std::vector<const void*> srcs(size_);
  io.forOut(0, count, [&](char* out, size_t done, size_t n) {
    for (int r = 0; r < size_; ++r) srcs[r] = slot(r, s) + done * es;
    reduceInto(out, srcs.data(), size_, n, info.dtype, info.op, size_);
  });
}

// Large messages: pipelined reduce-scatter + all-gather over segments of
// chunk_bytes. In step k a rank
//   1. copies segment k of its input, but for its own 1/n slice, into the
//      `in` half of its slot k%2 (only the peers read that half, and each
//      only its own slice),
//   2. waits for everyone,
//   3. reduces its 1/n slice of segment k from every peer's `in` half and
//      its own input (still unchanged: step k writes no output of segment
//      k) into the `out` half of its own slot k%2,
//   4. copies segment k-1's reduced slices from every rank's `out` half of
//      slot (k-1)%2 into its output (written in step k-1, before the peers
//      arrived at k).
// One extra step drains the last segment (and one step number is skipped
// after it, see the end). Each rank touches about 3x the message (copy in
// of (n-1)/n, 1/n reduce, copy out) instead of n+2 times.
template <typename Io>
void ShmComm::allReduceScatterGather(const Io& io, size_t count, const CallInfo& info) {
  const size_t es = elementSize(info.dtype);
  const size_t seg = options_.chunk_bytes / es;
  const size_t nseg = ceilDiv(count, seg);
  std::vector<const void*> srcs(size_);
  uint32_t prev = 0;
  for (size_t k = 0; k <= nseg; ++k) {
    const uint32_t s = nextStep();
    const size_t segBegin = k * seg;
    const size_t segLen = k < nseg ? std::min(seg, count - segBegin) : 0;
    if (k == 0) publishDescriptor(s, info, count);
    const auto [b, e] = sliceOf(rank_, segLen, size_);
    if (b) io.gather(slot(rank_, s), segBegin, b);
    if (e < segLen) io.gather(slot(rank_, s) + e * es, segBegin + e, segLen - e);
    arriveAndWait(s);
    if (k == 0) checkDescriptors(s, true);
    // Sources in rank order, ours from the input: the same sums bit for bit
    // as through the slot.
    char* outHalf = slot(rank_, s) + options_.chunk_bytes;
    io.forIn(segBegin + b, e - b, [&](const char* mine, size_t done, size_t n) {
      for (int r = 0; r < size_; ++r) srcs[r] = slot(r, s) + (b + done) * es;
      srcs[rank_] = mine;
      reduceInto(outHalf + (b + done) * es, srcs.data(), size_, n, info.dtype, info.op,
                 size_);
    });
    if (k > 0) {
      const size_t prevBegin = (k - 1) * seg;
      const size_t prevLen = std::min(seg, count - prevBegin);
      for (int r = 0; r < size_; ++r) {
        const auto [b, e] = sliceOf(r, prevLen, size_);
        if (e > b) {
          io.scatter(prevBegin + b, e - b, slot(r, prev) + options_.chunk_bytes + b * es);
        }
      }
    }
    prev = s;
  }
  // The last step read the previous step's slots after arriving, unlike every
  // other step of every collective. Skip one step number, so that the next
  // collective starts on the other half of the double buffer: a rank that
  // races ahead into it cannot overwrite what a slower rank is still
  // copying out. (Once it arrives at its own first step, everyone is past
  // this one.)
  nextStep();
}

// ---------------------------------------------------------------------------
// byte-moving collectives: one slot (two chunks) per rank per step

// The step loop the fixed-size collectives share: `total` units moved `per`
// units a step (at least one step, which carries the descriptor and the
// cross-rank check). Before each step `write(step, off, len)` fills this
// rank's slot; after everyone arrived `read(step, off, len)` consumes the
// peers' slots.
template <typename Write, typename Read>
void ShmComm::chunkedSteps(size_t total, size_t per, size_t count, const CallInfo& info,
                           Write&& write, Read&& read) {
  const size_t steps = std::max<size_t>(1, ceilDiv(total, per));
  for (size_t k = 0; k < steps; ++k) {
    const uint32_t s = nextStep();
    const size_t off = k * per;
    const size_t len = std::min(per, total - std::min(total, off));
    if (k == 0) publishDescriptor(s, info, count);
    if (len) write(s, off, len);
    arriveAndWait(s);
    if (k == 0) checkDescriptors(s, true);
    if (len) read(s, off, len);
  }
}

void ShmComm::broadcast(void* buf, size_t bytes, const CallInfo& info) {
  begin(info);
  if (size_ == 1) return;  // the root's buffer is already everyone's
  char* p = static_cast<char*>(buf);
  const bool stream = streams(bytes);
  chunkedSteps(
      bytes, slotBytes(), bytes, info,
      [&](uint32_t s, size_t off, size_t len) {
        if (rank_ == info.root) std::memcpy(slot(rank_, s), p + off, len);
      },
      [&](uint32_t s, size_t off, size_t len) {
        if (rank_ != info.root) copyOut(p + off, slot(info.root, s), len, stream);
      });
}

// Root reduces every chunk; the others only copy in. Rooted reductions are
// rare in training, so simplicity wins over spreading the work.
void ShmComm::reduce(const void* in, void* out, size_t count, const CallInfo& info) {
  begin(info);
  const size_t es = elementSize(info.dtype);
  if (size_ == 1) return copyOwn(out, in, count * es, streams(count * es));
  std::vector<const void*> srcs(size_);
  chunkedSteps(
      count, slotBytes() / es, count, info,
      [&](uint32_t s, size_t off, size_t len) {
        std::memcpy(slot(rank_, s), static_cast<const char*>(in) + off * es, len * es);
      },
      [&](uint32_t s, size_t off, size_t len) {
        if (rank_ != info.root) return;
        for (int r = 0; r < size_; ++r) srcs[r] = slot(r, s);
        reduceInto(static_cast<char*>(out) + off * es, srcs.data(), size_, len,
                   info.dtype, info.op, size_);
      });
}

void ShmComm::allGather(const void* in, size_t bytes, void* const* outs,
                        const CallInfo& info) {
  gather(in, bytes, outs, info);
}

// all_gather and gather share this loop: in gather only the root reads.
// Both go through the slots at every size. Reading each peer's input in
// place (process_vm_readv, one copy instead of two) won from 4 MB on one
// machine and lost up to 2x from 256 KB on another, whose kernel copy ran at
// a quarter of memcpy's speed; point-to-point keeps it, where it replaces
// gloo rather than a memcpy.
void ShmComm::gather(const void* in, size_t bytes, void* const* outs,
                     const CallInfo& info) {
  begin(info);
  if (size_ == 1) return copyOwn(outs[0], in, bytes, streams(bytes));
  const bool reads = info.kind == Collective::kAllGather || rank_ == info.root;
  const bool stream = streams(bytes * size_);
  chunkedSteps(
      bytes, slotBytes(), bytes, info,
      [&](uint32_t s, size_t off, size_t len) {
        std::memcpy(slot(rank_, s), static_cast<const char*>(in) + off, len);
      },
      [&](uint32_t s, size_t off, size_t len) {
        if (!reads) return;
        for (int r = 0; r < size_; ++r) {
          char* to = static_cast<char*>(outs[r]) + off;
          if (r != rank_) {
            copyOut(to, slot(r, s), len, stream);
            continue;
          }
          // Our own piece comes from our input, not back out of the segment.
          copyOwn(to, static_cast<const char*>(in) + off, len, stream);
        }
      });
}

void ShmComm::scatter(const void* const* ins, void* out, size_t bytes,
                      const CallInfo& info) {
  begin(info);
  if (size_ == 1) return copyOwn(out, ins[0], bytes, streams(bytes));
  const size_t per = slotBytes() / size_;  // root's slot holds n pieces
  chunkedSteps(
      bytes, per, bytes, info,
      [&](uint32_t s, size_t off, size_t len) {
        if (rank_ != info.root) return;
        for (int r = 0; r < size_; ++r) {
          std::memcpy(slot(rank_, s) + r * per, static_cast<const char*>(ins[r]) + off,
                      len);
        }
      },
      [&](uint32_t s, size_t off, size_t len) {
        std::memcpy(static_cast<char*>(out) + off, slot(info.root, s) + rank_ * per, len);
      });
}

void ShmComm::reduceScatter(const void* const* ins, void* out, size_t count,
                            const CallInfo& info) {
  const size_t es = elementSize(info.dtype);
  std::vector<void*> ptrs;
  for (int j = 0; j < size_; ++j) ptrs.push_back(const_cast<void*>(ins[j]));
  reduceScatter(BufferList(ptrs, std::vector<size_t>(size_, count), es), out, count,
                info);
}

// Each step carries the same element range of all n destination blocks; a
// rank reduces the pieces addressed to it straight into its output, reading
// its own block from the input, not through the segment.
void ShmComm::reduceScatter(const BufferList& in, void* out, size_t count,
                            const CallInfo& info) {
  const size_t es = elementSize(info.dtype);
  if (in.elementSize() != es || in.count() != count * size_) {
    throw std::invalid_argument(
        "dsp: reduce_scatter input must hold group size x count "
        "elements of the dtype");
  }
  begin(info);
  if (size_ == 1) {
    const bool stream = streams(count * es);
    return in.forRange(0, count, [&](char* p, size_t done, size_t k) {
      copyOwn(static_cast<char*>(out) + done * es, p, k * es, stream);
    });
  }
  const size_t per = slotBytes() / size_ / es;  // elements per block per step
  std::vector<const void*> srcs(size_);
  chunkedSteps(
      count, per, count, info,
      [&](uint32_t s, size_t off, size_t len) {
        for (int j = 0; j < size_; ++j) {
          if (j == rank_) continue;
          char* to = slot(rank_, s) + j * per * es;
          in.forRange(j * count + off, len, [&](char* p, size_t done, size_t k) {
            std::memcpy(to + done * es, p, k * es);
          });
        }
      },
      [&](uint32_t s, size_t off, size_t len) {
        // Sources in rank order (the same sums bit for bit whichever buffer
        // holds ours); `out` may be our own input block (reduceInto allows
        // dst == a source).
        in.forRange(rank_ * count + off, len, [&](char* p, size_t done, size_t k) {
          for (int r = 0; r < size_; ++r)
            srcs[r] = slot(r, s) + (rank_ * per + done) * es;
          srcs[rank_] = p;
          reduceInto(static_cast<char*>(out) + (off + done) * es, srcs.data(), size_, k,
                     info.dtype, info.op, size_);
        });
      });
}

// Uneven splits: each step moves up to slot/n bytes of every (src, dst) pair;
// the number of steps is the largest split anywhere, known to every rank
// once the first step's split tables are visible.
void ShmComm::allToAll(const void* const* ins, const size_t* send_bytes,
                       void* const* outs, const size_t* recv_bytes,
                       const CallInfo& info) {
  begin(info);
  const size_t per = slotBytes() / size_;
  size_t steps = 1;
  for (size_t k = 0; k < steps; ++k) {
    const uint32_t s = nextStep();
    const size_t off = k * per;
    if (k == 0) {
      publishDescriptor(s, info, 0);
      publishSplits(s, send_bytes, recv_bytes);
    }
    for (int j = 0; j < size_; ++j) {
      const size_t len = std::min(per, send_bytes[j] - std::min(send_bytes[j], off));
      if (len && j != rank_) {
        std::memcpy(slot(rank_, s) + j * per, static_cast<const char*>(ins[j]) + off,
                    len);
      }
    }
    arriveAndWait(s);
    if (k == 0) {
      checkDescriptors(s, false);
      checkSplits(s);
      steps = std::max<size_t>(1, ceilDiv(maxSendOverRanks(s), per));
    }
    for (int r = 0; r < size_; ++r) {
      const size_t len = std::min(per, recv_bytes[r] - std::min(recv_bytes[r], off));
      // This rank's own share goes straight from its input to its output
      // (one copy, not two through the segment); memmove: they may overlap
      // when the caller passes one buffer for both.
      const char* from = r == rank_ ? static_cast<const char*>(ins[rank_]) + off
                                    : slot(r, s) + rank_ * per;
      if (len) std::memmove(static_cast<char*>(outs[r]) + off, from, len);
    }
  }
}

void ShmComm::barrier() {
  CallInfo info;
  info.kind = Collective::kBarrier;
  begin(info);
  const uint32_t s = nextStep();
  publishDescriptor(s, info, 0);
  arriveAndWait(s);
  checkDescriptors(s, true);
}

}  // namespace dsp
