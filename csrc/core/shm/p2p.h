// Point-to-point messages between the processes of one host, through rings in
// shared memory.
//
// Each ordered pair (src, dst) has a ring of `ring_bytes` that only src
// writes and only dst reads. A send copies the message (a small header, then
// the payload) into the ring and returns: the sender never waits for the
// receiver to post its receive, and nothing but the two processes' own
// threads moves the data (no helper thread, no socket). It waits only while
// the ring is full, and meanwhile drains its own incoming rings, so that
// ranks sending to each other (two, or a cycle) cannot block each other.
//
// Receives match messages by (source, tag) in the order they were posted,
// as MPI and gloo do: a message that arrives before its receive is posted is
// copied aside (the "unexpected" queue) to free the ring, up to a bound in
// bytes and in messages (Limits); past it the message stays in the ring and
// whoever drained it gets an error naming the bound. Progress happens
// in whichever thread tests or waits on a receive or an in-place send, or
// sends.
//
// Messages larger than maxMessageBytes() do not fit in a ring. Where the
// receiver may read the sender's memory (process_vm_readv; see
// enableSingleCopy), such a message is sent in place instead: the ring carries
// only its address, and the receiver copies it straight out of the sender's
// buffer, once, when it drains that record. Such a send completes only once
// the receiver has read it, as a large MPI or gloo send does. Elsewhere
// callers route large messages to another transport, by facts both ends know
// (the size, and singleCopy()).
//
// Thread-safe. Plain C++17, no torch.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "wait.h"

namespace dsp {

// What a rank sets aside for point-to-point receives not posted yet, from all
// peers together.
struct P2PLimits {
  size_t unexpected_bytes = size_t{1} << 30;
  size_t unexpected_messages = size_t{1} << 16;
};

class ShmP2P {
 public:
  // Bytes of shared memory needed for `size` ranks with rings of `ring_bytes`.
  static size_t regionBytes(int size, size_t ring_bytes);
  // The ring size used by default for `size` ranks: 1 MiB, less when there are
  // so many ranks that the rings would crowd /dev/shm.
  static size_t defaultRingBytes(int size);

  using Limits = P2PLimits;

  // `region`: regionBytes() zeroed bytes of shared memory, the same on every
  // rank. `peer_alive(r)`: false once rank r's process is gone.
  ShmP2P(char* region, int rank, int size, size_t ring_bytes,
         std::chrono::milliseconds timeout, WaitPolicy policy,
         std::function<bool(int)> peer_alive, Limits limits = {});

  size_t maxMessageBytes() const;
  // Turns on in-place sends; call before any traffic (not thread-safe).
  // `readable[reader * size + writer]`: whether `reader` can read `writer`'s
  // memory (the same table on every rank); `pid_of(r)`: rank r's process id.
  void enableSingleCopy(std::vector<bool> readable, std::function<int(int)> pid_of);
  // Whether messages of any size may go from `writer` to `reader` (in place
  // above maxMessageBytes()).
  bool singleCopy(int reader, int writer) const;
  // Copies `bytes` at address `from` in process `pid` into `to`
  // (process_vm_readv): 0, or the errno that refused it.
  static int readProcess(int pid, uint64_t from, void* to, size_t bytes);
  // Thread-safe; applies to the sends and receives that start after it.
  void setTimeout(std::chrono::milliseconds t);
  // Thread-safe: a send or receive waiting now (within a few ms) or later
  // throws `reason` instead of waiting.
  void abort(const std::string& reason);

  // Copies `bytes` from `data` into dst's ring. Throws std::runtime_error
  // (naming the peer) when the ring stays full past the timeout or the peer
  // has died, std::invalid_argument for a message that does not fit.
  void send(int dst, int64_t tag, const void* data, size_t bytes);
  // The same for one message made of `head_bytes` at `head`, then `bytes` at
  // `data`: a header and a payload that live apart travel as one message
  // without a copy that puts them together first.
  void send(int dst, int64_t tag, const void* head, size_t head_bytes, const void* data,
            size_t bytes);

  // A send in place: complete once the receiver has read the message.
  struct SendTicket {
    int dst = -1;
    int64_t tag = 0;
    uint32_t seq = 0;  // this sender's in-place messages to dst, counted
  };
  // Puts the address of `bytes` at `data` into dst's ring; dst reads them
  // from there. `keep` (whatever owns the buffer) is held until then, so the
  // buffer outlives the send even when the caller stops waiting for it.
  // Throws std::invalid_argument where !singleCopy(dst, rank).
  SendTicket sendInPlace(int dst, int64_t tag, const void* data, size_t bytes,
                         std::shared_ptr<const void> keep);
  // Whether dst has read it (also drains our incoming rings, as a waiting
  // receive does).
  bool test(const SendTicket& t);
  // Blocks until dst has read it; throws on a dead peer or the timeout (the
  // group's, or `timeout` when positive), naming the peer and tag.
  void wait(const SendTicket& t,
            std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

  struct Request;
  using RequestPtr = std::shared_ptr<Request>;
  // Posts a receive of exactly `bytes` into `data` (which must stay valid
  // until it completes) from `src`, or from any rank when src is -1.
  RequestPtr postRecv(int src, int64_t tag, void* data, size_t bytes);
  // Withdraws a receive that has not completed: no message is delivered into
  // its memory afterwards, and the next message with its tag goes to the
  // next matching receive. A no-op once it has completed. Its owner calls
  // this before that memory goes (the Work's end, a failed wait).
  void cancel(const RequestPtr& r);
  // Makes progress without blocking; true once the receive has completed.
  // Throws the receive's error (a size mismatch).
  bool test(const RequestPtr& r);
  // Blocks until the receive completes; throws on a size mismatch, a dead
  // peer or the timeout (the group's, or `timeout` when positive), naming the
  // peer and tag.
  void wait(const RequestPtr& r,
            std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  // The rank the message came from (for any-source receives), once complete.
  int sourceOf(const RequestPtr& r) const;

 private:
  struct Channel;
  struct Watch;
  struct Unexpected {
    int64_t tag;
    std::vector<char> data;
    std::string error;  // an in-place message that could not be read
  };
  struct InFlight {
    uint32_t seq;
    std::shared_ptr<const void> keep;
  };

  Channel& channel(int src, int dst) const;
  // Rank r's any-source word: senders to r bump it while r waits on it.
  Watch& watch(int r) const;
  char* ring(int src, int dst) const;
  // Writes one record (header, then `head_bytes` from `head` and
  // `payload_bytes` from `payload`) into dst's ring, waiting while it is
  // full. Needs send_mutex_[dst].
  void writeRecord(int dst, int64_t tag, uint64_t bytes, uint64_t remote,
                   const void* head, size_t head_bytes, const void* payload,
                   size_t payload_bytes);
  // Reads `bytes` at `remote` in rank src's memory into `to`; "" or why not.
  std::string readInPlace(int src, int64_t tag, uint64_t remote, void* to,
                          size_t bytes) const;
  // Drops the buffers dst has read. Needs send_mutex_[dst].
  void releaseReadLocked(int dst);
  // Takes every message that has arrived from `src`, delivering each to the
  // oldest matching posted receive or to the unexpected queue. Needs mutex_.
  void drainLocked(int src);
  // drainLocked for every peer but `except` (-1: every peer). A rank blocked
  // on a full ring or a receive does this, so that no cycle of ranks, each
  // waiting on the next, can stall. Needs mutex_.
  void drainOthersLocked(int except);
  bool matchUnexpectedLocked(Request& r);
  // Throws, naming the bound, where setting aside one more message of
  // `bytes` would pass limits_. Needs mutex_.
  void setAsideCheckLocked(int src, int64_t tag, uint64_t bytes) const;
  static size_t ringsOffset(int size);
  [[noreturn]] void failWait(const Request& r, bool dead, int peer,
                             std::chrono::milliseconds limit = {}) const;
  std::chrono::milliseconds timeout() const {
    return std::chrono::milliseconds(timeout_ms_.load(std::memory_order_relaxed));
  }
  void throwIfAborted() const;

  char* region_;
  int rank_;
  int size_;
  size_t ring_bytes_;
  std::atomic<int64_t> timeout_ms_;
  std::atomic<bool> aborted_{false};
  std::string abort_reason_;  // under mutex_
  WaitPolicy policy_;
  std::function<bool(int)> peer_alive_;

  mutable std::mutex mutex_;                             // receive side
  std::vector<std::deque<Unexpected>> unexpected_;       // per source
  std::deque<RequestPtr> posted_;                        // in posting order
  std::vector<uint64_t> read_bytes_;                     // per source: ring tail
  std::vector<uint32_t> read_count_;                     // per source: messages taken
  std::vector<std::unique_ptr<std::mutex>> send_mutex_;  // per destination
  std::vector<uint64_t> written_bytes_;                  // per destination: ring head
  std::vector<uint32_t> written_count_;                  // per destination
  std::vector<uint32_t> in_place_count_;                 // per destination
  std::vector<std::deque<InFlight>> in_flight_;          // per destination
  std::vector<uint32_t> pulled_count_;                   // per source
  Limits limits_;
  size_t unexpected_bytes_ = 0, unexpected_messages_ = 0;  // under mutex_
  std::vector<bool> readable_;  // [reader * size + writer]; empty: none
  std::function<int(int)> pid_of_;
};

struct ShmP2P::Request {
  int src;  // -1: any
  int64_t tag;
  void* data;
  size_t bytes;
  bool done = false;
  int from = -1;
  std::string error;
};

}  // namespace dsp
