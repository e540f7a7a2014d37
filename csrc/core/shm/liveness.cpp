#include "liveness.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <sstream>
#include <string>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434  // the same number on every architecture
#endif

namespace dsp {
namespace {

// The fields of /proc/<pid>/stat after the command name, which may itself
// hold spaces and parentheses: field 3 (the state) is the first.
bool statFields(int pid, std::string* rest) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return false;
  *rest = line.substr(close + 2);
  return true;
}

}  // namespace

bool processAlive(int pid) {
  if (pid <= 0) return true;  // not published yet: cannot tell
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  // An exited child that nobody reaped yet still answers kill(): read its
  // state from /proc ('Z' zombie, 'X' dead).
  std::string rest;
  if (!statFields(pid, &rest)) {
    // Reaped between the kill() and the read (a parent waiting on it): gone
    // now, unless /proc is not there to read at all.
    return !(kill(pid, 0) != 0 && errno == ESRCH);
  }
  return rest[0] != 'Z' && rest[0] != 'X';
}

uint64_t processStartTime(int pid) {
  std::string rest;
  if (!statFields(pid, &rest)) return 0;
  std::istringstream in(rest);
  std::string field;
  for (int i = 3; i <= 22 && (in >> field); ++i) {
    if (i == 22) return std::stoull(field);
  }
  return 0;
}

PeerLiveness::PeerLiveness(int size, bool use_pidfd)
    : peers_(size), use_pidfd_(use_pidfd) {}

PeerLiveness::~PeerLiveness() {
  for (const Peer& p : peers_) {
    if (p.pidfd >= 0) close(p.pidfd);
  }
}

void PeerLiveness::watch(int r, int pid) {
  Peer& p = peers_[r];
  p.pid = pid;
  p.pidfd = use_pidfd_ ? static_cast<int>(syscall(SYS_pidfd_open, pid, 0)) : -1;
  if (p.pidfd < 0) p.start_time = processStartTime(pid);
}

bool PeerLiveness::alive(int r, int pid) const {
  const Peer& p = peers_[r];
  if (p.pid == 0 || p.pid != pid) return processAlive(pid);
  if (p.pidfd >= 0) {
    // Readable once the process has exited (a zombie included).
    pollfd fd{p.pidfd, POLLIN, 0};
    return poll(&fd, 1, 0) == 0;
  }
  if (!processAlive(pid)) return false;
  return p.start_time == 0 || processStartTime(pid) == p.start_time;
}

const char* PeerLiveness::how(int r) const {
  const Peer& p = peers_[r];
  if (p.pid == 0) return "pid";
  return p.pidfd >= 0 ? "pidfd" : (p.start_time ? "start time" : "pid");
}

}  // namespace dsp
