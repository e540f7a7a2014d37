#include "p2p.h"

#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace dsp {
namespace {

constexpr size_t kLine = 64;
constexpr size_t kPage = 4096;

size_t roundUp(size_t x, size_t to) { return (x + to - 1) / to * to; }

// Leads every message in a ring, on a line of its own; the payload follows
// on the next line. `skip` marks the unused end of the ring: the message is
// at the start. `remote`, when not 0, is the address of a message sent in
// place: no payload follows, the receiver reads it from the sender.
struct MsgHeader {
  int64_t tag;
  uint64_t bytes;
  uint64_t skip;
  uint64_t remote;
};
static_assert(sizeof(MsgHeader) <= kLine, "MsgHeader: one line");

size_t recordBytes(size_t payload) { return kLine + roundUp(payload, kLine); }

std::string tagText(int64_t tag) { return "tag " + std::to_string(tag); }

std::string sizeMismatch(int rank, int src, int64_t tag, uint64_t has, size_t expects) {
  return "dsp recv on rank " + std::to_string(rank) + " from rank " +
         std::to_string(src) + " (" + tagText(tag) + "): the message has " +
         std::to_string(has) + " bytes, the receive expects " + std::to_string(expects);
}

// A blocked send or receive waits on a peer's counter in slices of 2 ms,
// re-checking its own exit conditions (a dead peer, a receive that another
// thread completed) between them. Only the first slice spins for the
// policy's spin_us (and lasts at least that long): a wait that outlasts it
// is a long one, better asleep. No slice runs past the wait's deadline.
class SlicedWait {
 public:
  SlicedWait(const WaitPolicy& policy, std::chrono::steady_clock::time_point deadline)
      : policy_(policy), deadline_(deadline) {}
  void slice(const WaitWord& word, uint32_t target,
             std::chrono::steady_clock::time_point now) {
    const auto length = std::max<std::chrono::microseconds>(
        std::chrono::milliseconds(2), std::chrono::microseconds(policy_.spin_us));
    waitFor(word, target, std::min(deadline_, now + length), policy_,
            [] { return true; });
    policy_.spin_us = 0;
  }

 private:
  WaitPolicy policy_;
  std::chrono::steady_clock::time_point deadline_;
};

}  // namespace

// Shared between the two ends of one ring; each field on its own line.
struct alignas(kLine) ShmP2P::Channel {
  WaitWord sent;  // messages published by the sender
  char pad0[kLine - sizeof(WaitWord)];
  WaitWord freed;  // messages consumed by the receiver
  char pad1[kLine - sizeof(WaitWord)];
  std::atomic<uint64_t> tail;  // bytes consumed by the receiver, ever
  char pad2[kLine - sizeof(std::atomic<uint64_t>)];
  WaitWord pulled;  // in-place messages the receiver has read
  char pad3[kLine - sizeof(WaitWord)];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "tail crosses processes");

// One per receiving rank. An any-source receive cannot sleep on one sender's
// counter: while it waits, `watchers` is non-zero, and every sender to this
// rank bumps `arrivals` after publishing a message. (seq_cst on both sides,
// as in advance(): either the sender sees the watcher, or the watcher's
// drain sees the message.) Other receives leave it at zero: a send costs
// one load of this line.
struct alignas(kLine) ShmP2P::Watch {
  WaitWord arrivals;
  std::atomic<uint32_t> watchers;
  char pad[kLine - sizeof(WaitWord) - sizeof(std::atomic<uint32_t>)];
};

size_t ShmP2P::ringsOffset(int size) {
  const size_t pairs = static_cast<size_t>(size) * size;
  return roundUp(pairs * sizeof(Channel) + size * sizeof(Watch), kPage);
}

size_t ShmP2P::regionBytes(int size, size_t ring_bytes) {
  return ringsOffset(size) + static_cast<size_t>(size) * size * ring_bytes;
}

size_t ShmP2P::defaultRingBytes(int size) {
  if (size <= 1) return kPage;
  // About 64 MiB of rings at most (reserved in /dev/shm with the segment),
  // 1 MiB each for small groups; a power of two between 64 KiB and 1 MiB.
  const size_t budget = (size_t{64} << 20) / (static_cast<size_t>(size) * (size - 1));
  size_t ring = size_t{1} << 20;
  while (ring > budget && ring > (size_t{64} << 10)) ring >>= 1;
  return ring;
}

ShmP2P::ShmP2P(char* region, int rank, int size, size_t ring_bytes,
               std::chrono::milliseconds timeout, WaitPolicy policy,
               std::function<bool(int)> peer_alive, Limits limits)
    : region_(region),
      rank_(rank),
      size_(size),
      ring_bytes_(ring_bytes),
      timeout_ms_(timeout.count()),
      policy_(policy),
      peer_alive_(std::move(peer_alive)),
      unexpected_(size),
      read_bytes_(size, 0),
      read_count_(size, 0),
      written_bytes_(size, 0),
      written_count_(size, 0),
      in_place_count_(size, 0),
      in_flight_(size),
      pulled_count_(size, 0),
      limits_(limits) {
  if (ring_bytes_ < 4 * kLine || ring_bytes_ % kLine != 0) {
    throw std::invalid_argument("dsp: point-to-point rings of " +
                                std::to_string(ring_bytes_) +
                                " bytes (need a multiple of 64, at least 256)");
  }
  for (int r = 0; r < size; ++r) send_mutex_.push_back(std::make_unique<std::mutex>());
}

size_t ShmP2P::maxMessageBytes() const { return ring_bytes_ / 2 - kLine; }

void ShmP2P::enableSingleCopy(std::vector<bool> readable,
                              std::function<int(int)> pid_of) {
  if (readable.size() != static_cast<size_t>(size_) * size_) {
    throw std::invalid_argument("dsp: the single-copy table needs size x size entries");
  }
  readable_ = std::move(readable);
  pid_of_ = std::move(pid_of);
}

bool ShmP2P::singleCopy(int reader, int writer) const {
  return !readable_.empty() && readable_[static_cast<size_t>(reader) * size_ + writer];
}

int ShmP2P::readProcess(int pid, uint64_t from, void* to, size_t bytes) {
  size_t done = 0;
  while (done < bytes) {
    iovec local{static_cast<char*>(to) + done, bytes - done};
    iovec remote{reinterpret_cast<void*>(from + done), bytes - done};
    const ssize_t got = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (got <= 0) return got < 0 ? errno : EFAULT;
    done += static_cast<size_t>(got);
  }
  return 0;
}

std::string ShmP2P::readInPlace(int src, int64_t tag, uint64_t remote, void* to,
                                size_t bytes) const {
  const int err = readProcess(pid_of_(src), remote, to, bytes);
  if (err == 0) return "";
  return "dsp recv on rank " + std::to_string(rank_) + " from rank " +
         std::to_string(src) + " (" + tagText(tag) + ", " + std::to_string(bytes) +
         " bytes): reading the message in place failed (" +
         (peer_alive_(src) ? std::string(std::strerror(err))
                           : std::string("the peer process has exited")) +
         ")";
}

void ShmP2P::setTimeout(std::chrono::milliseconds t) {
  timeout_ms_.store(t.count(), std::memory_order_relaxed);
}

void ShmP2P::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (abort_reason_.empty()) abort_reason_ = reason;
  }
  aborted_.store(true, std::memory_order_release);
}

void ShmP2P::throwIfAborted() const {
  if (!aborted_.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(mutex_);
  throw std::runtime_error(abort_reason_);
}

ShmP2P::Channel& ShmP2P::channel(int src, int dst) const {
  return reinterpret_cast<Channel*>(region_)[static_cast<size_t>(src) * size_ + dst];
}

ShmP2P::Watch& ShmP2P::watch(int r) const {
  const size_t pairs = static_cast<size_t>(size_) * size_;
  return reinterpret_cast<Watch*>(region_ + pairs * sizeof(Channel))[r];
}

char* ShmP2P::ring(int src, int dst) const {
  return region_ + ringsOffset(size_) +
         (static_cast<size_t>(src) * size_ + dst) * ring_bytes_;
}

void ShmP2P::send(int dst, int64_t tag, const void* data, size_t bytes) {
  send(dst, tag, nullptr, 0, data, bytes);
}

void ShmP2P::send(int dst, int64_t tag, const void* head, size_t head_bytes,
                  const void* data, size_t bytes) {
  const size_t total = head_bytes + bytes;
  if (dst < 0 || dst >= size_ || dst == rank_) {
    throw std::invalid_argument("dsp send: rank " + std::to_string(rank_) +
                                " cannot send to rank " + std::to_string(dst) +
                                " of a group of " + std::to_string(size_));
  }
  if (total > maxMessageBytes()) {
    throw std::invalid_argument("dsp send: " + std::to_string(total) +
                                " bytes exceed the shared-memory ring's " +
                                std::to_string(maxMessageBytes()));
  }
  std::lock_guard<std::mutex> send_lock(*send_mutex_[dst]);
  writeRecord(dst, tag, total, 0, head, head_bytes, data, bytes);
}

void ShmP2P::writeRecord(int dst, int64_t tag, uint64_t bytes, uint64_t remote,
                         const void* head_piece, size_t head_bytes, const void* payload,
                         size_t payload_bytes) {
  Channel& c = channel(rank_, dst);
  char* base = ring(rank_, dst);
  uint64_t head = written_bytes_[dst];
  const size_t rec = recordBytes(head_bytes + payload_bytes);
  const size_t off = head % ring_bytes_;
  const size_t waste = ring_bytes_ - off < rec ? ring_bytes_ - off : 0;
  const uint64_t end = head + waste + rec;
  const auto deadline = std::chrono::steady_clock::now() + timeout();
  SlicedWait waiting(policy_, deadline);
  throwIfAborted();
  while (end - c.tail.load(std::memory_order_acquire) > ring_bytes_) {
    throwIfAborted();
    // The ring is full. Drain what every peer sent us meanwhile: a peer may
    // itself be waiting for room in its ring to us (directly, or through a
    // cycle of ranks each sending to the next).
    {
      std::lock_guard<std::mutex> lock(mutex_);
      drainOthersLocked(-1);
    }
    const uint32_t freed = c.freed.value.load(std::memory_order_acquire);
    if (end - c.tail.load(std::memory_order_acquire) <= ring_bytes_) break;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline || !peer_alive_(dst)) {
      throw std::runtime_error(
          "dsp send to rank " + std::to_string(dst) + " (" + tagText(tag) +
          ") from rank " + std::to_string(rank_) + ": " +
          (peer_alive_(dst)
               ? "its receive ring stayed full for " + std::to_string(timeout().count()) +
                     " ms (it received none of the messages before)"
               : std::string("the peer process has exited")));
    }
    waiting.slice(c.freed, freed + 1, now);
  }
  if (waste) {
    reinterpret_cast<MsgHeader*>(base + off)->skip = 1;
    head += waste;
  }
  char* at = base + head % ring_bytes_;
  auto* h = reinterpret_cast<MsgHeader*>(at);
  h->tag = tag;
  h->bytes = bytes;
  h->skip = 0;
  h->remote = remote;
  if (head_bytes) std::memcpy(at + kLine, head_piece, head_bytes);
  if (payload_bytes) std::memcpy(at + kLine + head_bytes, payload, payload_bytes);
  written_bytes_[dst] = head + rec;
  advance(c.sent, ++written_count_[dst]);  // publishes the message (seq_cst)
  Watch& w = watch(dst);
  if (w.watchers.load(std::memory_order_seq_cst) != 0) bump(w.arrivals);
}

ShmP2P::SendTicket ShmP2P::sendInPlace(int dst, int64_t tag, const void* data,
                                       size_t bytes, std::shared_ptr<const void> keep) {
  if (dst < 0 || dst >= size_ || dst == rank_ || !singleCopy(dst, rank_)) {
    throw std::invalid_argument("dsp send: rank " + std::to_string(rank_) +
                                " cannot send in place to rank " + std::to_string(dst) +
                                " of a group of " + std::to_string(size_));
  }
  std::lock_guard<std::mutex> send_lock(*send_mutex_[dst]);
  releaseReadLocked(dst);
  const SendTicket t{dst, tag, in_place_count_[dst] + 1};
  // Held before the record is visible: the receiver may read at once.
  in_flight_[dst].push_back({t.seq, std::move(keep)});
  try {
    writeRecord(dst, tag, bytes, reinterpret_cast<uintptr_t>(data), nullptr, 0, nullptr,
                0);
  } catch (...) {
    in_flight_[dst].pop_back();
    throw;
  }
  in_place_count_[dst] = t.seq;
  return t;
}

void ShmP2P::releaseReadLocked(int dst) {
  const uint32_t pulled =
      channel(rank_, dst).pulled.value.load(std::memory_order_acquire);
  auto& q = in_flight_[dst];
  while (!q.empty() && reached(pulled, q.front().seq)) q.pop_front();
}

bool ShmP2P::test(const SendTicket& t) {
  throwIfAborted();
  {
    // A peer may wait on us to read its own message in place before it
    // reads ours.
    std::lock_guard<std::mutex> lock(mutex_);
    drainOthersLocked(-1);
  }
  const bool done =
      reached(channel(rank_, t.dst).pulled.value.load(std::memory_order_acquire), t.seq);
  if (done) {
    std::lock_guard<std::mutex> send_lock(*send_mutex_[t.dst]);
    releaseReadLocked(t.dst);
  }
  return done;
}

void ShmP2P::wait(const SendTicket& t, std::chrono::milliseconds timeout) {
  const auto limit = timeout.count() > 0 ? timeout : this->timeout();
  const auto deadline = std::chrono::steady_clock::now() + limit;
  SlicedWait waiting(policy_, deadline);
  const WaitWord& pulled = channel(rank_, t.dst).pulled;
  for (;;) {
    throwIfAborted();
    if (test(t)) return;
    const auto now = std::chrono::steady_clock::now();
    if (!peer_alive_(t.dst) || now >= deadline) {
      throw std::runtime_error(
          "dsp send to rank " + std::to_string(t.dst) + " (" + tagText(t.tag) +
          ") from rank " + std::to_string(rank_) + ": " +
          (peer_alive_(t.dst) ? "the receiver did not take the message within " +
                                    std::to_string(limit.count()) + " ms"
                              : std::string("the peer process has exited")));
    }
    waiting.slice(pulled, t.seq, now);
  }
}

void ShmP2P::drainLocked(int src) {
  Channel& c = channel(src, rank_);
  char* base = ring(src, rank_);
  while (c.sent.value.load(std::memory_order_acquire) != read_count_[src]) {
    uint64_t tail = read_bytes_[src];
    auto* h = reinterpret_cast<const MsgHeader*>(base + tail % ring_bytes_);
    if (h->skip) {
      tail += ring_bytes_ - tail % ring_bytes_;
      h = reinterpret_cast<const MsgHeader*>(base);
    }
    const char* payload = reinterpret_cast<const char*>(h) + kLine;
    if (h->remote == 0 && h->bytes > maxMessageBytes()) {
      throw std::runtime_error("dsp recv on rank " + std::to_string(rank_) +
                               ": a corrupt message from rank " + std::to_string(src) +
                               " (" + std::to_string(h->bytes) + " bytes in a ring of " +
                               std::to_string(ring_bytes_) + ")");
    }
    const auto match =
        std::find_if(posted_.begin(), posted_.end(), [&](const RequestPtr& r) {
          return (r->src == src || r->src == -1) && r->tag == h->tag;
        });
    if (match != posted_.end()) {
      Request& r = **match;
      r.from = src;
      if (r.bytes != h->bytes) {
        r.error = sizeMismatch(rank_, src, h->tag, h->bytes, r.bytes);
      } else if (h->remote) {
        r.error = readInPlace(src, h->tag, h->remote, r.data, h->bytes);
      } else if (h->bytes) {
        std::memcpy(r.data, payload, h->bytes);
      }
      r.done = true;
      posted_.erase(match);
    } else {
      setAsideCheckLocked(src, h->tag, h->bytes);
      if (h->remote) {
        // Read now all the same: the sender waits for it, and it may be
        // waiting on us in turn.
        Unexpected u{h->tag, std::vector<char>(h->bytes), ""};
        u.error = readInPlace(src, h->tag, h->remote, u.data.data(), h->bytes);
        unexpected_[src].push_back(std::move(u));
      } else {
        unexpected_[src].push_back(
            {h->tag, std::vector<char>(payload, payload + h->bytes), ""});
      }
      unexpected_bytes_ += h->bytes;
      ++unexpected_messages_;
    }
    // The buffer read in place is the sender's again (in ring order).
    if (h->remote) advance(c.pulled, ++pulled_count_[src]);
    tail += recordBytes(h->remote ? 0 : h->bytes);
    read_bytes_[src] = tail;
    ++read_count_[src];
    c.tail.store(tail, std::memory_order_release);
    advance(c.freed, read_count_[src]);
  }
}

void ShmP2P::setAsideCheckLocked(int src, int64_t tag, uint64_t bytes) const {
  if (unexpected_messages_ < limits_.unexpected_messages &&
      bytes <= limits_.unexpected_bytes -
                   std::min(unexpected_bytes_, limits_.unexpected_bytes)) {
    return;
  }
  // The message stays in the ring: nothing is lost, and its receive, once
  // posted, still gets it.
  throw std::runtime_error(
      "dsp recv on rank " + std::to_string(rank_) + ": rank " + std::to_string(src) +
      " sent a message (" + tagText(tag) + ", " + std::to_string(bytes) +
      " bytes) that no posted receive takes, and the " +
      std::to_string(unexpected_messages_) + " messages (" +
      std::to_string(unexpected_bytes_) +
      " bytes) already set aside for receives not posted yet reach the bound (" +
      std::to_string(limits_.unexpected_messages) + " messages, " +
      std::to_string(limits_.unexpected_bytes) +
      " bytes: DSP_P2P_UNEXPECTED_MESSAGES, DSP_P2P_UNEXPECTED_BYTES); post the "
      "receives as the peer sends, or raise the bound");
}

void ShmP2P::drainOthersLocked(int except) {
  for (int s = 0; s < size_; ++s) {
    if (s != rank_ && s != except) drainLocked(s);
  }
}

bool ShmP2P::matchUnexpectedLocked(Request& r) {
  for (int s = 0; s < size_; ++s) {
    if (r.src != -1 && s != r.src) continue;
    auto& q = unexpected_[s];
    const auto it = std::find_if(q.begin(), q.end(),
                                 [&](const Unexpected& u) { return u.tag == r.tag; });
    if (it == q.end()) continue;
    r.from = s;
    if (!it->error.empty()) {
      r.error = it->error;
    } else if (it->data.size() != r.bytes) {
      r.error = sizeMismatch(rank_, s, r.tag, it->data.size(), r.bytes);
    } else if (r.bytes) {
      std::memcpy(r.data, it->data.data(), r.bytes);
    }
    r.done = true;
    unexpected_bytes_ -= it->data.size();
    --unexpected_messages_;
    q.erase(it);
    return true;
  }
  return false;
}

ShmP2P::RequestPtr ShmP2P::postRecv(int src, int64_t tag, void* data, size_t bytes) {
  if (src < -1 || src >= size_ || src == rank_) {
    throw std::invalid_argument("dsp recv: rank " + std::to_string(rank_) +
                                " cannot receive from rank " + std::to_string(src) +
                                " of a group of " + std::to_string(size_));
  }
  auto r = std::make_shared<Request>();
  r->src = src;
  r->tag = tag;
  r->data = data;
  r->bytes = bytes;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!matchUnexpectedLocked(*r)) posted_.push_back(r);
  return r;
}

void ShmP2P::cancel(const RequestPtr& r) {
  // Under the receive lock: a drain that has not taken the request by now
  // never will, and one that has is over.
  std::lock_guard<std::mutex> lock(mutex_);
  if (r->done) return;
  const auto it = std::find(posted_.begin(), posted_.end(), r);
  if (it != posted_.end()) posted_.erase(it);
}

bool ShmP2P::test(const RequestPtr& r) {
  std::lock_guard<std::mutex> lock(mutex_);
  // After an abort nothing is drained: a posted receive's memory may be gone.
  if (!r->done && aborted_.load(std::memory_order_acquire)) {
    throw std::runtime_error(abort_reason_);
  }
  if (!r->done) {
    for (int s = 0; s < size_; ++s) {
      if (s != rank_ && (r->src == -1 || r->src == s)) drainLocked(s);
    }
  }
  if (!r->done) return false;
  if (!r->error.empty()) throw std::runtime_error(r->error);
  return true;
}

void ShmP2P::wait(const RequestPtr& r, std::chrono::milliseconds timeout) {
  const auto limit = timeout.count() > 0 ? timeout : this->timeout();
  const auto deadline = std::chrono::steady_clock::now() + limit;
  SlicedWait waiting(policy_, deadline);
  // An any-source receive sleeps on this rank's arrivals word, which
  // senders bump only while someone watches it.
  struct Watching {
    Watch* w;
    explicit Watching(Watch* w) : w(w) {
      if (w) w->watchers.fetch_add(1, std::memory_order_seq_cst);
    }
    ~Watching() {
      if (w) w->watchers.fetch_sub(1, std::memory_order_seq_cst);
    }
  } watching(r->src < 0 ? &watch(rank_) : nullptr);
  for (;;) {
    throwIfAborted();
    uint32_t seen = 0;
    if (r->src >= 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      seen = read_count_[r->src];
    } else {
      seen = watch(rank_).arrivals.value.load(std::memory_order_seq_cst);
    }
    if (test(r)) return;
    if (r->src >= 0) {
      // Take in what the other peers sent meanwhile, as a blocked send does:
      // a peer may be blocked sending to us while the rank we wait for is
      // itself blocked behind that peer (a cycle through full rings).
      std::lock_guard<std::mutex> lock(mutex_);
      drainOthersLocked(r->src);
    }
    const auto now = std::chrono::steady_clock::now();
    if (r->src >= 0) {
      if (!peer_alive_(r->src)) failWait(*r, true, r->src);
      if (now >= deadline) failWait(*r, false, r->src, limit);
      waiting.slice(channel(r->src, rank_).sent, seen + 1, now);
    } else {
      for (int s = 0; s < size_; ++s) {
        if (s != rank_ && !peer_alive_(s)) failWait(*r, true, s);
      }
      if (now >= deadline) failWait(*r, false, -1, limit);
      waiting.slice(watch(rank_).arrivals, seen + 1, now);
    }
  }
}

int ShmP2P::sourceOf(const RequestPtr& r) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return r->from;
}

void ShmP2P::failWait(const Request& r, bool dead, int peer,
                      std::chrono::milliseconds limit) const {
  const std::string from = r.src >= 0 ? "rank " + std::to_string(r.src) : "any rank";
  throw std::runtime_error(
      "dsp recv on rank " + std::to_string(rank_) + " from " + from + " (" +
      tagText(r.tag) + ", " + std::to_string(r.bytes) + " bytes): " +
      (dead ? "rank " + std::to_string(peer) + " has exited"
            : "nothing arrived within " + std::to_string(limit.count()) + " ms"));
}

}  // namespace dsp
