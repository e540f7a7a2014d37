// PeerLiveness: a peer that exits is seen as gone, also when a new process
// has taken its process id (which kill(pid, 0) calls alive).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "core/shm/liveness.h"

namespace dsp {
namespace {

pid_t sleeper() {
  const pid_t pid = fork();
  if (pid == 0) {
    pause();
    _exit(0);
  }
  return pid;
}

void stop(pid_t pid) {
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

// A new process with process id `pid`, through ns_last_pid (root, and no
// other process forking in between); -1 when this machine will not.
pid_t sleeperWithPid(pid_t pid) {
  for (int attempt = 0; attempt < 20; ++attempt) {
    {
      std::ofstream last("/proc/sys/kernel/ns_last_pid");
      if (!(last << pid - 1)) return -1;
    }
    const pid_t got = sleeper();
    if (got == pid) return got;
    stop(got);
  }
  return -1;
}

}  // namespace

// Both ways of watching: a pidfd, and the start time where there is none.
class PeerLivenessBy : public ::testing::TestWithParam<bool> {};

TEST_P(PeerLivenessBy, AnExitedPeerIsGone) {
  PeerLiveness live(2, GetParam());
  const pid_t peer = sleeper();
  live.watch(1, peer);
  EXPECT_STREQ(live.how(1), GetParam() ? "pidfd" : "start time");
  EXPECT_TRUE(live.alive(1, peer));
  kill(peer, SIGKILL);
  // Not reaped yet (a zombie) and then reaped: gone both times.
  for (int i = 0; i < 200 && live.alive(1, peer); ++i) usleep(1000);
  EXPECT_FALSE(live.alive(1, peer));
  waitpid(peer, nullptr, 0);
  EXPECT_FALSE(live.alive(1, peer));
}

TEST_P(PeerLivenessBy, AReusedPidDoesNotBringAPeerBack) {
  PeerLiveness live(2, GetParam());
  const pid_t peer = sleeper();
  live.watch(1, peer);
  // Start times count clock ticks (10 ms): a process that lived for less
  // than one can share its successor's. A peer that has joined a group has
  // lived longer than that.
  usleep(30000);
  stop(peer);
  const pid_t impostor = sleeperWithPid(peer);
  if (impostor < 0)
    GTEST_SKIP() << "cannot place a process at a given pid here (not root?)";
  EXPECT_TRUE(processAlive(peer)) << "the pid alone calls the impostor the peer";
  EXPECT_FALSE(live.alive(1, peer)) << "watched by " << live.how(1);
  stop(impostor);
}

INSTANTIATE_TEST_SUITE_P(PidfdOrStartTime, PeerLivenessBy, ::testing::Bool());

TEST(PeerLiveness, StartTimeTellsProcessesApart) {
  const pid_t a = sleeper();
  const uint64_t t = processStartTime(a);
  EXPECT_GT(t, 0u);
  EXPECT_EQ(processStartTime(a), t);
  EXPECT_EQ(processStartTime(getpid()) <= t, true);
  stop(a);
  EXPECT_EQ(processStartTime(a), 0u);
}

}  // namespace dsp
