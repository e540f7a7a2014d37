// ShmP2P with ranks as threads: matching by tag in posting order, messages
// that arrive before their receive, any-source receives, rings that wrap and
// fill up (both ways at once), messages sent as a head and a payload, messages
// read in place, and the errors: a size mismatch, a message too large, a
// receive or an in-place send that nothing answers. (Threads share one
// process, which can always read itself: the single-copy table is all true
// here.)
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <ctime>
#include <memory>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "test_helpers.h"

namespace dsp {
namespace {

using testing::expectThrowWith;
using testing::messageOf;
using testing::runRanks;

ShmOptions ringOptions(size_t ring_bytes) {
  ShmOptions o = testing::smallOptions();
  o.p2p_ring_bytes = ring_bytes;
  o.timeout = std::chrono::seconds(10);
  return o;
}

void expectNoErrors(const std::vector<std::exception_ptr>& errs) {
  for (size_t r = 0; r < errs.size(); ++r) {
    EXPECT_FALSE(errs[r]) << "rank " << r << ": " << messageOf(errs[r]);
  }
}

std::vector<int32_t> payload(int64_t tag, size_t n) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), static_cast<int32_t>(tag * 1000));
  return v;
}

}  // namespace

// Sent as tags 1, 2, 3 and 3 again; received 3 first, then 1 and 2 (they wait
// aside), then the second 3: each lands where its receive says.
TEST(ShmP2P, MatchesByTagInPostingOrder) {
  expectNoErrors(runRanks(2, [](ShmComm& c) {
    auto& p = c.p2p();
    if (c.rank() == 0) {
      for (int64_t tag : {1, 2, 3}) {
        auto v = payload(tag, 10 + tag);
        p.send(1, tag, v.data(), v.size() * 4);
      }
      auto v = payload(33, 13);
      p.send(1, 3, v.data(), v.size() * 4);
    } else {
      std::vector<int32_t> a(13), b(11), d(12), e(13);
      auto ra = p.postRecv(0, 3, a.data(), a.size() * 4);
      auto re = p.postRecv(0, 3, e.data(), e.size() * 4);  // the second tag-3 message
      p.wait(re);
      p.wait(ra);
      auto rb = p.postRecv(0, 1, b.data(), b.size() * 4);
      auto rd = p.postRecv(0, 2, d.data(), d.size() * 4);
      p.wait(rd);
      p.wait(rb);
      EXPECT_EQ(a, payload(3, 13));
      EXPECT_EQ(e, payload(33, 13));
      EXPECT_EQ(b, payload(1, 11));
      EXPECT_EQ(d, payload(2, 12));
      EXPECT_EQ(p.sourceOf(rb), 0);
    }
  }));
}

// A cancelled receive takes nothing: the message with its tag goes to the
// receive posted after it, and the cancelled buffer is left as it was.
TEST(ShmP2P, CancelledReceiveTakesNothing) {
  expectNoErrors(runRanks(2, [](ShmComm& c) {
    auto& p = c.p2p();
    if (c.rank() == 0) {
      c.barrier();  // the receiver has posted and cancelled by now
      auto v = payload(5, 8);
      p.send(1, 5, v.data(), v.size() * 4);
    } else {
      std::vector<int32_t> stale(8, -1), fresh(8);
      auto r = p.postRecv(0, 5, stale.data(), stale.size() * 4);
      p.cancel(r);
      c.barrier();
      auto next = p.postRecv(0, 5, fresh.data(), fresh.size() * 4);
      p.wait(next);
      EXPECT_EQ(fresh, payload(5, 8));
      EXPECT_EQ(stale, std::vector<int32_t>(8, -1));
      p.cancel(next);  // completed: a no-op
    }
  }));
}

// Every rank sends to every other many messages of random sizes through a
// small ring (it wraps and fills up, and every pair sends both ways at once);
// every byte arrives in order.
TEST(ShmP2P, RingsWrapAndFillBothWays) {
  const size_t ring = 4096;
  for (int n : {2, 3, 4}) {
    expectNoErrors(runRanks(
        n,
        [n, ring](ShmComm& c) {
          auto& p = c.p2p();
          const size_t max_ints = p.maxMessageBytes() / 4;
          std::mt19937 gen(1234);  // the same sizes on every rank
          std::vector<size_t> sizes(300);
          for (auto& s : sizes) s = gen() % (max_ints + 1);
          // Post every receive first, then send everything, then wait.
          std::vector<std::vector<std::vector<int32_t>>> got(n);
          std::vector<ShmP2P::RequestPtr> reqs;
          for (int src = 0; src < n; ++src) {
            if (src == c.rank()) continue;
            got[src].resize(sizes.size());
            for (size_t i = 0; i < sizes.size(); ++i) {
              got[src][i].resize(sizes[i]);
              reqs.push_back(p.postRecv(src, static_cast<int64_t>(i % 7),
                                        got[src][i].data(), sizes[i] * 4));
            }
          }
          for (size_t i = 0; i < sizes.size(); ++i) {
            for (int dst = 0; dst < n; ++dst) {
              if (dst == c.rank()) continue;
              auto v = payload(static_cast<int64_t>(c.rank()) * 100000 + i, sizes[i]);
              p.send(dst, static_cast<int64_t>(i % 7), v.data(), v.size() * 4);
            }
          }
          for (auto& r : reqs) p.wait(r);
          for (int src = 0; src < n; ++src) {
            if (src == c.rank()) continue;
            for (size_t i = 0; i < sizes.size(); ++i) {
              ASSERT_EQ(got[src][i],
                        payload(static_cast<int64_t>(src) * 100000 + i, sizes[i]))
                  << "from " << src << " message " << i;
            }
          }
        },
        ringOptions(ring)));
  }
}

// Without receives posted ahead, two ranks that each send more than a ring
// holds to the other before receiving anything still finish: a sender waiting
// for room drains its own incoming ring.
TEST(ShmP2P, SendersThatBothOverfillDoNotDeadlock) {
  expectNoErrors(runRanks(
      2,
      [](ShmComm& c) {
        auto& p = c.p2p();
        const int peer = 1 - c.rank();
        const size_t ints = p.maxMessageBytes() / 4;
        for (int i = 0; i < 20; ++i) {
          auto v = payload(i, ints);
          p.send(peer, i, v.data(), v.size() * 4);
        }
        for (int i = 0; i < 20; ++i) {
          std::vector<int32_t> got(ints);
          p.wait(p.postRecv(peer, i, got.data(), got.size() * 4));
          ASSERT_EQ(got, payload(i, ints));
        }
      },
      ringOptions(4096)));
}

// A message sent as a head and a payload arrives as their concatenation, for
// every split (empty heads and payloads too), through a small ring that wraps,
// whether its receive was posted before it arrived or after; a message whose
// two parts together do not fit is refused.
TEST(ShmP2P, HeadAndPayloadArriveAsOneMessage) {
  expectNoErrors(runRanks(
      2,
      [](ShmComm& c) {
        auto& p = c.p2p();
        const size_t max = p.maxMessageBytes();
        std::mt19937 gen(99);  // the same sizes on both ranks
        std::vector<size_t> total(200), split(200);
        for (size_t i = 0; i < total.size(); ++i) {
          total[i] = gen() % (max + 1);
          split[i] = i % 5 == 0 ? 0 : i % 5 == 1 ? total[i] : gen() % (total[i] + 1);
        }
        auto bytes = [](size_t i, size_t n) {
          std::vector<uint8_t> v(n);
          for (size_t k = 0; k < n; ++k) v[k] = static_cast<uint8_t>(i * 31 + k * 7);
          return v;
        };
        if (c.rank() == 0) {
          for (size_t i = 0; i < total.size(); ++i) {
            const auto v = bytes(i, total[i]);
            p.send(1, static_cast<int64_t>(i), v.data(), split[i], v.data() + split[i],
                   total[i] - split[i]);
          }
          std::vector<uint8_t> big(max);
          EXPECT_THROW(p.send(1, 0, big.data(), 1, big.data(), max),
                       std::invalid_argument);
        } else {
          // Half posted ahead; the rest received after they arrived.
          std::vector<std::vector<uint8_t>> got(total.size());
          std::vector<ShmP2P::RequestPtr> reqs(total.size());
          for (size_t i = 0; i < total.size(); i += 2) {
            got[i].resize(total[i]);
            reqs[i] = p.postRecv(0, static_cast<int64_t>(i), got[i].data(), total[i]);
          }
          for (size_t i = 0; i < total.size(); ++i) {
            if (!reqs[i]) {
              got[i].resize(total[i]);
              reqs[i] = p.postRecv(0, static_cast<int64_t>(i), got[i].data(), total[i]);
            }
            p.wait(reqs[i]);
            ASSERT_EQ(got[i], bytes(i, total[i])) << "message " << i;
          }
        }
      },
      ringOptions(4096)));
}

TEST(ShmP2P, AnySourceReceivesEachSenderOnce) {
  const int n = 4;
  expectNoErrors(runRanks(n, [n](ShmComm& c) {
    auto& p = c.p2p();
    if (c.rank() == 0) {
      std::vector<int> seen;
      for (int k = 1; k < n; ++k) {
        int32_t v = -1;
        auto r = p.postRecv(-1, 7, &v, 4);
        p.wait(r);
        EXPECT_EQ(v, p.sourceOf(r) * 10);
        seen.push_back(p.sourceOf(r));
      }
      std::sort(seen.begin(), seen.end());
      EXPECT_EQ(seen, (std::vector<int>{1, 2, 3}));
    } else {
      int32_t v = c.rank() * 10;
      p.send(0, 7, &v, 4);
    }
  }));
}

TEST(ShmP2P, ErrorsNameThePeerTagAndSizes) {
  auto errs = runRanks(
      2,
      [](ShmComm& c) {
        auto& p = c.p2p();
        if (c.rank() == 0) {
          int64_t x[3] = {1, 2, 3};
          p.send(1, 5, x, sizeof(x));
          std::vector<char> big(p.maxMessageBytes() + 1);
          EXPECT_THROW(p.send(1, 6, big.data(), big.size()), std::invalid_argument);
        } else {
          int64_t y[2];
          expectThrowWith<std::runtime_error>(
              [&] { p.wait(p.postRecv(0, 5, y, sizeof(y))); },
              {"from rank 0", "tag 5", "24 bytes", "expects 16"},
              "a size mismatch went through");
          // Nobody sends tag 9: the receive times out, naming what it waited for.
          p.setTimeout(std::chrono::milliseconds(300));
          expectThrowWith<std::runtime_error>(
              [&] { p.wait(p.postRecv(0, 9, y, sizeof(y))); },
              {"from rank 0 (tag 9", "300 ms"}, "a receive nobody answered completed");
        }
      },
      ringOptions(4096));
  for (size_t r = 0; r < errs.size(); ++r) {
    EXPECT_FALSE(errs[r]) << "rank " << r << ": " << messageOf(errs[r]);
  }
}

// A receive's own timeout bounds its spin too: with a 5 s spin budget, a
// 50 ms wait on a silent peer still ends near 50 ms, not after the spin.
TEST(ShmP2P, TimeoutShorterThanTheSpinBudgetEndsTheWait) {
  ShmOptions o = ringOptions(4096);
  o.p2p_spin_us = 5'000'000;
  auto errs = runRanks(
      2,
      [](ShmComm& c) {
        if (c.rank() == 1) {
          auto& p = c.p2p();
          int64_t y = 0;
          const auto start = std::chrono::steady_clock::now();
          EXPECT_THROW(
              p.wait(p.postRecv(0, 3, &y, sizeof(y)), std::chrono::milliseconds(50)),
              std::runtime_error);
          EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
        }
        c.barrier();
      },
      o);
  expectNoErrors(errs);
}

// Messages larger than a ring go in place: matched by tag among ring
// messages in posting order, read before their receive is posted (set aside)
// or into it; the send completes only once read, and the sender's buffer is
// held until then even though the caller let go of it.
TEST(ShmP2P, LargeMessagesAreReadInPlace) {
  std::atomic<bool> sent{false}, checked{false};
  expectNoErrors(runRanks(
      2,
      [&](ShmComm& c) {
        auto& p = c.p2p();
        const size_t big = p.maxMessageBytes() / 4 * 10;  // ints: 10 rings' worth
        if (c.rank() == 0) {
          ASSERT_TRUE(p.singleCopy(1, 0));
          std::vector<ShmP2P::SendTicket> tickets;
          std::weak_ptr<const void> held;
          for (int64_t tag : {1, 3}) {
            auto v = std::make_shared<std::vector<int32_t>>(payload(tag, big + tag));
            if (tag == 3) held = v;
            tickets.push_back(p.sendInPlace(1, tag, v->data(), v->size() * 4, v));
            auto small = payload(tag + 1, 5);
            p.send(1, tag + 1, small.data(), small.size() * 4);
          }
          sent = true;
          EXPECT_FALSE(p.test(tickets[1]));  // nobody has read it yet
          EXPECT_FALSE(held.expired());
          checked = true;
          for (const auto& t : tickets) p.wait(t);
          EXPECT_TRUE(held.expired());
        } else {
          while (!checked) std::this_thread::yield();
          ASSERT_TRUE(sent);
          std::vector<int32_t> a(big + 3), b(5), d(big + 1), e(5);
          auto ra = p.postRecv(0, 3, a.data(), a.size() * 4);
          p.wait(ra);  // drains tags 1 and 2 aside on the way
          p.wait(p.postRecv(0, 1, d.data(), d.size() * 4));
          p.wait(p.postRecv(0, 4, e.data(), e.size() * 4));
          p.wait(p.postRecv(0, 2, b.data(), b.size() * 4));
          EXPECT_EQ(a, payload(3, big + 3));
          EXPECT_EQ(d, payload(1, big + 1));
          EXPECT_EQ(b, payload(2, 5));
          EXPECT_EQ(e, payload(4, 5));
        }
      },
      ringOptions(4096)));
}

// Two ranks each send the other a message in place and wait for it to be
// read before receiving anything: each waiting sender reads the other's.
TEST(ShmP2P, InPlaceSendsBothWaysDoNotDeadlock) {
  expectNoErrors(runRanks(
      2,
      [](ShmComm& c) {
        auto& p = c.p2p();
        const int peer = 1 - c.rank();
        const size_t ints = p.maxMessageBytes();
        auto v = payload(c.rank(), ints);
        p.wait(p.sendInPlace(peer, 0, v.data(), v.size() * 4, nullptr));
        std::vector<int32_t> got(ints);
        p.wait(p.postRecv(peer, 0, got.data(), got.size() * 4));
        EXPECT_EQ(got, payload(peer, ints));
      },
      ringOptions(4096)));
}

TEST(ShmP2P, InPlaceErrorsNameThePeerTagAndSizes) {
  auto errs = runRanks(
      2,
      [](ShmComm& c) {
        auto& p = c.p2p();
        std::vector<char> big(p.maxMessageBytes() * 3);
        if (c.rank() == 0) {
          // A receive of the wrong size fails; the send still completes.
          p.wait(p.sendInPlace(1, 5, big.data(), big.size(), nullptr));
          // Sent once rank 1 has stopped draining (it would set the message
          // aside, reading it): nobody receives tag 9, and the send's wait
          // times out, naming it.
          c.barrier();
          auto t = p.sendInPlace(1, 9, big.data(), big.size(), nullptr);
          expectThrowWith<std::runtime_error>(
              [&] { p.wait(t, std::chrono::milliseconds(100)); },
              {"to rank 1 (tag 9", "did not take the message within 100 ms"},
              "an in-place send nobody read completed");
          c.barrier();
        } else {
          std::vector<char> small(big.size() - 1);
          expectThrowWith<std::runtime_error>(
              [&] { p.wait(p.postRecv(0, 5, small.data(), small.size())); },
              {"from rank 0", "tag 5", std::to_string(big.size()) + " bytes",
               "expects " + std::to_string(small.size())},
              "a size mismatch went through");
          c.barrier();
          c.barrier();
          // Take tag 9 now, or rank 0's buffer would go while still announced.
          p.wait(p.postRecv(0, 9, big.data(), big.size()));
        }
      },
      ringOptions(4096));
  expectNoErrors(errs);
}

// With single copy off, nothing goes in place.
TEST(ShmP2P, SingleCopyCanBeTurnedOff) {
  ShmOptions o = ringOptions(4096);
  o.p2p_single_copy = false;
  expectNoErrors(runRanks(
      2,
      [](ShmComm& c) {
        auto& p = c.p2p();
        EXPECT_FALSE(p.singleCopy(1 - c.rank(), c.rank()));
        char x = 0;
        EXPECT_THROW(p.sendInPlace(1 - c.rank(), 0, &x, 1, nullptr),
                     std::invalid_argument);
      },
      o));
}

}  // namespace dsp

namespace dsp {

// An any-source receive that waits sleeps as the others do: over a quiet
// 400 ms its thread uses a fraction of the CPU (it spun on sched_yield, all
// of it, before). The sender's message still wakes it.
TEST(ShmP2P, AnySourceReceiveSleepsWhileItWaits) {
  expectNoErrors(runRanks(2, [](ShmComm& c) {
    auto& p = c.p2p();
    if (c.rank() == 0) {
      c.barrier();
      std::this_thread::sleep_for(std::chrono::milliseconds(400));
      int32_t v = 42;
      p.send(1, 3, &v, 4);
    } else {
      int32_t v = 0;
      auto r = p.postRecv(-1, 3, &v, 4);
      timespec cpu0{}, cpu1{};
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu0);
      const auto t0 = std::chrono::steady_clock::now();
      c.barrier();
      p.wait(r);
      const double wall =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu1);
      const double cpu =
          (cpu1.tv_sec - cpu0.tv_sec) + (cpu1.tv_nsec - cpu0.tv_nsec) * 1e-9;
      EXPECT_EQ(v, 42);
      EXPECT_EQ(p.sourceOf(r), 0);
      EXPECT_GT(wall, 0.3);
      EXPECT_LT(cpu, 0.25 * wall) << "cpu " << cpu << " s over " << wall << " s";
    }
  }));
}

// Messages nobody has posted a receive for are set aside up to a bound; the
// one past it stays in the ring, the drain that meets it raises naming the
// bound, and once its receive is posted it arrives intact, as do the others.
TEST(ShmP2P, UnexpectedMessagesAreBounded) {
  ShmOptions o = ringOptions(4096);
  o.p2p_limits.unexpected_messages = 3;
  o.p2p_limits.unexpected_bytes = 1 << 20;
  expectNoErrors(runRanks(
      2,
      [](ShmComm& c) {
        auto& p = c.p2p();
        if (c.rank() == 0) {
          for (int64_t tag = 0; tag < 4; ++tag) {
            auto v = payload(tag, 4);
            p.send(1, tag, v.data(), v.size() * 4);
          }
          c.barrier();
        } else {
          c.barrier();  // all four are in the ring
          std::vector<int32_t> got(4);
          auto other = p.postRecv(0, 99, got.data(), 16);
          expectThrowWith<std::runtime_error>(
              [&] { p.test(other); },
              {"rank 0", "tag 3", "3 messages", "bound", "DSP_P2P_UNEXPECTED_MESSAGES"},
              "a fourth message was set aside");
          p.cancel(other);
          for (int64_t tag : {3, 0, 1, 2}) {
            auto r = p.postRecv(0, tag, got.data(), got.size() * 4);
            p.wait(r);
            EXPECT_EQ(got, payload(tag, 4)) << "tag " << tag;
          }
        }
      },
      o));
}

}  // namespace dsp
