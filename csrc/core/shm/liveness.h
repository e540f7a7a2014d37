// Whether a peer process of this host still runs, in a way a reused process
// id cannot fool.
//
// A pid alone can name another process once its owner has exited and been
// reaped: kill(pid, 0) would then call a dead peer alive until the group's
// timeout (30 minutes by default). So once every peer has arrived (its pid
// known to be its own), each is watched through a pidfd (pidfd_open, Linux
// 5.3), which refers to that process and no other, or where the kernel has
// none through its start time in /proc, which a new process with the same
// pid does not share (start times count clock ticks of 10 ms, and a peer
// that has joined a group has lived longer than one). Peers must be in this PID namespace: ranks in another
// one are another host (see the backend's host identity).
//
// Plain C++17, no torch.
#pragma once

#include <cstdint>
#include <vector>

namespace dsp {

// kill(pid, 0) and /proc: alive unless it has exited (a zombie counts as
// exited). pid <= 0 (not published yet) counts as alive.
bool processAlive(int pid);

class PeerLiveness {
 public:
  // use_pidfd false: by start time alone, as on a kernel without pidfds.
  explicit PeerLiveness(int size, bool use_pidfd = true);
  ~PeerLiveness();
  PeerLiveness(const PeerLiveness&) = delete;
  PeerLiveness& operator=(const PeerLiveness&) = delete;

  // Pins rank r to process `pid`, which must be running now. Not
  // thread-safe: call for every peer before alive() is called elsewhere.
  void watch(int r, int pid);
  // Whether rank r's process runs. Before watch(r, ...): processAlive(pid).
  bool alive(int r, int pid) const;
  // How rank r is watched: "pidfd", "start time" or "pid".
  const char* how(int r) const;

 private:
  struct Peer {
    int pid = 0;
    int pidfd = -1;
    uint64_t start_time = 0;  // /proc/<pid>/stat field 22; 0: unknown
  };
  std::vector<Peer> peers_;
  bool use_pidfd_;
};

// /proc/<pid>/stat's start time (clock ticks after boot); 0 if unreadable.
uint64_t processStartTime(int pid);

}  // namespace dsp
