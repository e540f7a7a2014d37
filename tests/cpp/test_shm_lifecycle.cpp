// The segment's lifetime and safety (move-assignment, attach refusing a
// segment it does not own), and the comm driven the way the backend drives
// it: collectives on a worker thread while a caller thread reads the sequence
// number, changes the timeout and aborts. Built under ThreadSanitizer in CI
// (scripts/tsan.sh), where these must be free of data races.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "test_helpers.h"

namespace dsp {
namespace {

using testing::expectThrowWith;
using testing::messageOf;
using testing::runRanks;

bool exists(const std::string& name) {
  return access(("/dev/shm" + name).c_str(), F_OK) == 0;
}

TEST(Segment, MoveAssignReleasesTheOldSegmentAndTakesTheNew) {
  const std::string a_name = Segment::randomName();
  const std::string b_name = Segment::randomName();
  Segment a = Segment::create(a_name, 4096);
  Segment b = Segment::create(b_name, 8192);
  static_cast<char*>(b.data())[8191] = 42;
  a = std::move(b);
  EXPECT_FALSE(exists(a_name)) << "the replaced segment was not unlinked";
  EXPECT_EQ(a.name(), b_name);
  EXPECT_EQ(a.size(), 8192u);
  EXPECT_EQ(static_cast<char*>(a.data())[8191], 42);
  EXPECT_EQ(b.data(), nullptr);
  Segment c(std::move(a));
  EXPECT_EQ(c.name(), b_name);
  EXPECT_EQ(a.data(), nullptr);
  c.unlink();
  EXPECT_FALSE(exists(b_name));
}

TEST(Segment, AttachRefusesASegmentWithAnotherMode) {
  const std::string name = Segment::randomName();
  const mode_t old = umask(0);
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0644);
  umask(old);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  close(fd);
  expectThrowWith<std::runtime_error>(
      [&] {
        Segment::attach(name, 4096,
                        std::chrono::steady_clock::now() + std::chrono::seconds(1));
      },
      {name, "mode 644", "refusing"}, "a world-readable segment was attached");
  shm_unlink(name.c_str());
}

TEST(ShmComm, CreatorReportsTheSegmentBeforePeersLookForIt) {
  // The creation callback runs once on rank 0, before any peer can attach.
  std::atomic<int> calls{0};
  std::string error = "unset";
  const std::string name = Segment::randomName();
  std::thread creator([&] {
    ShmComm comm(name, 0, 2, testing::smallOptions(), [&](const std::string& e) {
      error = e;
      EXPECT_TRUE(exists(name));
      ++calls;
    });
    comm.barrier();
  });
  std::thread peer([&] {
    ShmComm comm(name, 1, 2, testing::smallOptions());
    comm.barrier();
  });
  creator.join();
  peer.join();
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(error, "");
}

CallInfo allReduceInfo(size_t n) {
  CallInfo i;
  i.kind = Collective::kAllReduce;
  i.dtype = DType::kInt64;
  i.shape = {static_cast<int64_t>(n)};
  return i;
}

// As the backend: collectives run on a worker thread while the caller thread
// reads the sequence number and sets the timeout.
TEST(ShmComm, CallerAndWorkerThreadsShareTheComm) {
  const int n = 3;
  auto errors = runRanks(n, [&](ShmComm& comm) {
    std::atomic<bool> done{false};
    std::thread worker([&] {
      std::vector<int64_t> v(1000);
      for (int it = 0; it < 50; ++it) {
        std::fill(v.begin(), v.end(), comm.rank() + 1);
        comm.allReduce(v.data(), v.data(), v.size(), allReduceInfo(v.size()));
        ASSERT_EQ(v[999], n * (n + 1) / 2);
      }
      done = true;
    });
    uint64_t last = 0;
    while (!done) {
      const uint64_t s = comm.sequenceNumber();
      EXPECT_GE(s, last);
      last = s;
      comm.setTimeout(std::chrono::seconds(20 + (s & 1)));
      std::this_thread::yield();
    }
    worker.join();
    EXPECT_EQ(comm.sequenceNumber(), 50u);
  });
  for (int r = 0; r < n; ++r) EXPECT_FALSE(errors[r]) << messageOf(errors[r]);
}

// Abort from another thread wakes a rank waiting for a peer that never comes
// and makes every later call raise the same reason.
TEST(ShmComm, AbortWakesAWaitingRankAndRefusesLaterWork) {
  std::atomic<bool> gave_up{false};
  auto errors = runRanks(2, [&](ShmComm& comm) {
    if (comm.rank() == 1) {
      // Stays out of the collective; leaves once rank 0 has given up.
      while (!gave_up) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    std::thread aborter([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      comm.abort("dsp: aborted by the test");
    });
    int64_t x = 1;
    expectThrowWith<PeerError>([&] { comm.allReduce(&x, &x, 1, allReduceInfo(1)); },
                               {"aborted by the test"},
                               "the abort did not wake the wait");
    aborter.join();
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
    expectThrowWith<PeerError>([&] { comm.barrier(); }, {"aborted by the test"},
                               "an aborted comm took more work");
    gave_up = true;
  });
  for (const auto& e : errors) EXPECT_FALSE(e) << messageOf(e);
}

}  // namespace
}  // namespace dsp
