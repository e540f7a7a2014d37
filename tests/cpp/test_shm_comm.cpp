// ShmComm collectives with ranks as threads: exact closed forms over sizes 0,
// 1, odd, and larger than a chunk; mismatch and timeout errors; more ranks
// than cores.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <numeric>
#include <vector>

#include "core/half.h"
#include "test_helpers.h"

namespace dsp {
namespace {

using testing::messageOf;
using testing::runRanks;

// 0, 1, odd, one-shot limit, several chunks (chunk = 4096 bytes).
const std::vector<size_t> kCounts = {0, 1, 13, 511, 1025, 5000};
const std::vector<int> kWorlds = {1, 2, 3, 4};  // 4 > the 2 cores of CI

CallInfo info(Collective kind, DType dt = DType::kInt32, ReduceOp op = ReduceOp::kSum,
              int root = -1, std::vector<int64_t> shape = {}) {
  CallInfo i;
  i.kind = kind;
  i.dtype = dt;
  i.op = op;
  i.root = root;
  i.shape = std::move(shape);
  return i;
}

void expectNoErrors(const std::vector<std::exception_ptr>& errs) {
  for (size_t r = 0; r < errs.size(); ++r) {
    EXPECT_FALSE(errs[r]) << "rank " << r << ": " << messageOf(errs[r]);
  }
}

TEST(ShmComm, AllReduceClosedForms) {
  for (int n : kWorlds) {
    expectNoErrors(runRanks(n, [n](ShmComm& c) {
      for (size_t count : kCounts) {
        std::vector<int32_t> v(count);
        for (size_t i = 0; i < count; ++i) v[i] = c.rank() + static_cast<int>(i % 5);
        c.allReduce(v.data(), v.data(), count, info(Collective::kAllReduce));
        for (size_t i = 0; i < count; ++i) {
          ASSERT_EQ(v[i], n * (n - 1) / 2 + n * static_cast<int>(i % 5))
              << "n=" << n << " count=" << count << " i=" << i;
        }
        std::vector<float> f(count, static_cast<float>(c.rank()));
        std::vector<float> out(count, -1.f);
        c.allReduce(f.data(), out.data(), count,
                    info(Collective::kAllReduce, DType::kFloat32, ReduceOp::kMax));
        for (float x : out) ASSERT_EQ(x, static_cast<float>(n - 1));
        c.allReduce(f.data(), out.data(), count,
                    info(Collective::kAllReduce, DType::kFloat32, ReduceOp::kAvg));
        for (float x : out) ASSERT_EQ(x, (n - 1) / 2.0f);
      }
    }));
  }
}

// Every dtype through both all-reduce algorithms (one-shot and pipelined
// reduce-scatter + all-gather), as raw bytes: rank r contributes r + 1 in
// each element, so SUM is n(n+1)/2 and MAX is n exactly in every dtype.
TEST(ShmComm, AllReduceEveryDTypeBothAlgorithms) {
  struct Case {
    DType dt;
    std::function<void(void*, size_t, int)> fill;
    std::function<double(const void*, size_t)> read;
  };
  auto native = [](auto zero) {
    using T = decltype(zero);
    return std::make_pair(
        std::function<void(void*, size_t, int)>(
            [](void* p, size_t i, int v) { static_cast<T*>(p)[i] = static_cast<T>(v); }),
        std::function<double(const void*, size_t)>(
            [](const void* p, size_t i) { return static_cast<const T*>(p)[i]; }));
  };
  std::vector<Case> cases;
  auto add = [&](DType dt, auto fr) { cases.push_back({dt, fr.first, fr.second}); };
  add(DType::kFloat32, native(0.f));
  add(DType::kFloat64, native(0.0));
  add(DType::kInt8, native(int8_t{0}));
  add(DType::kUInt8, native(uint8_t{0}));
  add(DType::kInt16, native(int16_t{0}));
  add(DType::kInt32, native(int32_t{0}));
  add(DType::kInt64, native(int64_t{0}));
  cases.push_back({DType::kFloat16,
                   [](void* p, size_t i, int v) {
                     static_cast<uint16_t*>(p)[i] = floatToHalf(static_cast<float>(v));
                   },
                   [](const void* p, size_t i) {
                     return static_cast<double>(
                         halfToFloat(static_cast<const uint16_t*>(p)[i]));
                   }});
  cases.push_back(
      {DType::kBFloat16,
       [](void* p, size_t i, int v) {
         static_cast<uint16_t*>(p)[i] = floatToBfloat16(static_cast<float>(v));
       },
       [](const void* p, size_t i) {
         return static_cast<double>(bfloat16ToFloat(static_cast<const uint16_t*>(p)[i]));
       }});
  for (int n : {2, 3}) {
    expectNoErrors(runRanks(n, [&](ShmComm& c) {
      for (const Case& k : cases) {
        for (size_t count : kCounts) {
          std::vector<char> buf(count * elementSize(k.dt) + 1);
          for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
            for (size_t i = 0; i < count; ++i) k.fill(buf.data(), i, c.rank() + 1);
            c.allReduce(buf.data(), buf.data(), count,
                        info(Collective::kAllReduce, k.dt, op));
            const double expect = op == ReduceOp::kSum ? n * (n + 1) / 2 : n;
            for (size_t i = 0; i < count; ++i) {
              ASSERT_EQ(k.read(buf.data(), i), expect)
                  << dtypeName(k.dt) << " " << reduceOpName(op) << " count " << count;
            }
          }
        }
      }
    }));
  }
}

// An all-reduce over a list of buffers (in place, no packing) equals the
// closed form in every element, with pieces that are empty, shorter than a
// chunk and straddling chunk and slice boundaries, through both algorithms.
TEST(ShmComm, AllReduceOverBufferListInPlace) {
  const std::vector<std::vector<size_t>> layouts = {
      {0}, {1}, {3, 0, 10}, {100, 411}, {1000, 0, 25, 1, 999}, {4096, 3, 0, 2000}};
  for (int n : kWorlds) {
    expectNoErrors(runRanks(n, [&](ShmComm& c) {
      for (const auto& counts : layouts) {
        std::vector<std::vector<int32_t>> bufs;
        std::vector<void*> ptrs;
        size_t at = 0;
        for (size_t k : counts) {
          bufs.emplace_back(k);
          for (size_t i = 0; i < k; ++i, ++at) {
            bufs.back()[i] = (c.rank() + 1) * static_cast<int>(at % 11);
          }
        }
        for (auto& b : bufs) ptrs.push_back(b.data());
        c.allReduce(BufferList(ptrs, counts, sizeof(int32_t)),
                    info(Collective::kAllReduce));
        at = 0;
        for (const auto& b : bufs) {
          for (int32_t x : b) {
            ASSERT_EQ(x, n * (n + 1) / 2 * static_cast<int>(at % 11)) << "element " << at;
            ++at;
          }
        }
      }
    }));
  }
}

// A pipelined all-reduce ends with a step whose ranks read the previous
// step's slots; a rank that races ahead into a collective writing whole slots
// (broadcast) must not overwrite them before the slow ranks have read. Run
// back to back many times, with more ranks than cores so that ranks fall
// behind, every result must be exact.
TEST(ShmComm, PipelinedAllReduceThenBroadcastBackToBack) {
  const int n = 4;
  expectNoErrors(runRanks(n, [n](ShmComm& c) {
    const size_t count = 3 * 1024 + 17;  // several 4 KiB chunks of int32
    for (int iter = 0; iter < 300; ++iter) {
      std::vector<int32_t> v(count);
      for (size_t i = 0; i < count; ++i)
        v[i] = (c.rank() + 1) * static_cast<int>(i % 7) + iter;
      c.allReduce(v.data(), v.data(), count, info(Collective::kAllReduce));
      for (size_t i = 0; i < count; ++i) {
        ASSERT_EQ(v[i], n * (n + 1) / 2 * static_cast<int>(i % 7) + n * iter)
            << "iter " << iter << " i " << i;
      }
      std::vector<int32_t> b(2048, c.rank() == 0 ? -iter : 0);
      c.broadcast(b.data(), b.size() * sizeof(int32_t),
                  info(Collective::kBroadcast, DType::kInt32, ReduceOp::kSum, 0));
      for (int32_t x : b) ASSERT_EQ(x, -iter);
    }
  }));
}

// Broadcasts back to back with rotating roots, sizes from under a slot to
// several slots, and collectives that write whole slots in between (an
// all-gather, a one-element broadcast): every rank must read exactly what
// the root sent, also with more ranks than cores, where some fall behind.
TEST(ShmComm, BroadcastsBackToBackWithRotatingRoots) {
  for (int n : {2, 4}) {
    expectNoErrors(runRanks(n, [n](ShmComm& c) {
      const std::vector<size_t> counts = {512, 1025, 2048, 5000, 9001};
      for (int iter = 0; iter < 60; ++iter) {
        const int root = iter % n;
        const size_t count = counts[iter % counts.size()];
        std::vector<int32_t> b(count, -1);
        if (c.rank() == root) {
          for (size_t i = 0; i < count; ++i) b[i] = iter * 7919 + static_cast<int>(i);
        }
        c.broadcast(b.data(), count * 4,
                    info(Collective::kBroadcast, DType::kInt32, ReduceOp::kSum, root));
        for (size_t i = 0; i < count; ++i) {
          ASSERT_EQ(b[i], iter * 7919 + static_cast<int>(i))
              << "n=" << n << " iter " << iter << " i " << i;
        }
        std::vector<int32_t> mine(1500, c.rank() + iter);
        std::vector<std::vector<int32_t>> all(n, std::vector<int32_t>(1500, -1));
        std::vector<void*> outs;
        for (auto& a : all) outs.push_back(a.data());
        c.allGather(mine.data(), mine.size() * 4, outs.data(),
                    info(Collective::kAllGather));
        for (int r = 0; r < n; ++r) {
          for (int32_t x : all[r]) ASSERT_EQ(x, r + iter) << "iter " << iter;
        }
        int32_t small = c.rank() == root ? iter : -1;
        c.broadcast(&small, 4,
                    info(Collective::kBroadcast, DType::kInt32, ReduceOp::kSum, root));
        ASSERT_EQ(small, iter);
      }
    }));
  }
}

TEST(ShmComm, BroadcastReduceGatherScatter) {
  for (int n : kWorlds) {
    expectNoErrors(runRanks(n, [n](ShmComm& c) {
      for (size_t count : kCounts) {
        const int root = n - 1;
        std::vector<int32_t> b(count, c.rank() == root ? 42 : -1);
        c.broadcast(b.data(), count * 4,
                    info(Collective::kBroadcast, DType::kInt32, ReduceOp::kSum, root));
        for (int32_t x : b) ASSERT_EQ(x, 42);

        std::vector<int64_t> in(count, c.rank() + 1), out(count, 0);
        c.reduce(in.data(), out.data(), count,
                 info(Collective::kReduce, DType::kInt64, ReduceOp::kProduct, 0));
        if (c.rank() == 0) {
          int64_t fact = 1;
          for (int r = 1; r <= n; ++r) fact *= r;
          for (int64_t x : out) ASSERT_EQ(x, fact);
        }

        std::vector<int32_t> mine(count, c.rank());
        std::vector<std::vector<int32_t>> all(n, std::vector<int32_t>(count, -1));
        std::vector<void*> outs;
        for (auto& a : all) outs.push_back(a.data());
        c.allGather(mine.data(), count * 4, outs.data(), info(Collective::kAllGather));
        for (int r = 0; r < n; ++r)
          for (int32_t x : all[r]) ASSERT_EQ(x, r);

        for (auto& a : all) std::fill(a.begin(), a.end(), -1);
        c.gather(mine.data(), count * 4, outs.data(),
                 info(Collective::kGather, DType::kInt32, ReduceOp::kSum, 0));
        if (c.rank() == 0) {
          for (int r = 0; r < n; ++r)
            for (int32_t x : all[r]) ASSERT_EQ(x, r);
        }

        std::vector<std::vector<int32_t>> pieces(n, std::vector<int32_t>(count));
        std::vector<const void*> ins;
        for (int r = 0; r < n; ++r) {
          std::fill(pieces[r].begin(), pieces[r].end(), 100 + r);
          ins.push_back(pieces[r].data());
        }
        std::vector<int32_t> got(count, -1);
        c.scatter(ins.data(), got.data(), count * 4,
                  info(Collective::kScatter, DType::kInt32, ReduceOp::kSum, 0));
        for (int32_t x : got) ASSERT_EQ(x, 100 + c.rank());
      }
    }));
  }
}

// The ZeRO-2 path: the input blocks spread over buffers whose boundaries do
// not fall on block boundaries (so a step's range spans several), with the
// output in place over this rank's own block; then the all-gather in place
// over the same array. Slots are small, so large counts take many steps.
TEST(ShmComm, ReduceScatterFromBufferListInPlaceThenAllGatherInPlace) {
  for (int n : kWorlds) {
    expectNoErrors(runRanks(n, [n](ShmComm& c) {
      for (size_t count : kCounts) {
        const size_t total = count * n;
        std::vector<int32_t> flat(total);
        for (size_t i = 0; i < total; ++i)
          flat[i] = static_cast<int32_t>(i % 97) + c.rank();
        // Cut into pieces of 7, 1, 300, ... elements (whatever is left last).
        std::vector<void*> ptrs;
        std::vector<size_t> counts;
        const size_t cuts[] = {7, 1, 300, 4096};
        size_t at = 0;
        for (size_t k = 0; at < total; ++k) {
          const size_t len = std::min(cuts[k % 4], total - at);
          ptrs.push_back(flat.data() + at);
          counts.push_back(len);
          at += len;
        }
        int32_t* mine = flat.data() + c.rank() * count;
        c.reduceScatter(BufferList(ptrs, counts, sizeof(int32_t)), mine, count,
                        info(Collective::kReduceScatter));
        const int32_t rankSum = n * (n - 1) / 2;
        for (size_t i = 0; i < count; ++i) {
          const size_t g = c.rank() * count + i;
          ASSERT_EQ(mine[i], n * static_cast<int32_t>(g % 97) + rankSum) << "at " << i;
        }
        std::vector<void*> outs;
        for (int r = 0; r < n; ++r) outs.push_back(flat.data() + r * count);
        c.allGather(mine, count * 4, outs.data(), info(Collective::kAllGather));
        for (size_t g = 0; g < total; ++g) {
          ASSERT_EQ(flat[g], n * static_cast<int32_t>(g % 97) + rankSum) << "at " << g;
        }
      }
    }));
  }
}

TEST(ShmComm, ReduceScatterAndAllToAll) {
  for (int n : kWorlds) {
    expectNoErrors(runRanks(n, [n](ShmComm& c) {
      for (size_t count : kCounts) {
        // block j of rank r holds r + j: rank j receives sum_r (r + j).
        std::vector<std::vector<int32_t>> blocks(n, std::vector<int32_t>(count));
        std::vector<const void*> ins;
        for (int j = 0; j < n; ++j) {
          std::fill(blocks[j].begin(), blocks[j].end(), c.rank() + j);
          ins.push_back(blocks[j].data());
        }
        std::vector<int32_t> out(count, -1);
        c.reduceScatter(ins.data(), out.data(), count, info(Collective::kReduceScatter));
        for (int32_t x : out) ASSERT_EQ(x, n * (n - 1) / 2 + n * c.rank());

        // Uneven all-to-all: rank i sends (count + i + j) bytes of value
        // i*16+j to rank j.
        std::vector<std::vector<uint8_t>> send(n), recv(n);
        std::vector<size_t> sb(n), rb(n);
        std::vector<const void*> sp(n);
        std::vector<void*> rp(n);
        for (int j = 0; j < n; ++j) {
          sb[j] = count + c.rank() + j;
          send[j].assign(sb[j], static_cast<uint8_t>(c.rank() * 16 + j));
          sp[j] = send[j].data();
          rb[j] = count + j + c.rank();
          recv[j].assign(rb[j], 0xff);
          rp[j] = recv[j].data();
        }
        c.allToAll(sp.data(), sb.data(), rp.data(), rb.data(),
                   info(Collective::kAllToAll, DType::kUInt8));
        for (int j = 0; j < n; ++j)
          for (uint8_t x : recv[j]) ASSERT_EQ(x, static_cast<uint8_t>(j * 16 + c.rank()));
      }
      c.barrier();
    }));
  }
}

TEST(ShmComm, MismatchRaisesSameErrorEverywhereAndGroupSurvives) {
  std::vector<std::string> msgs(3);
  auto errs = runRanks(3, [&](ShmComm& c) {
    std::vector<float> v(16, 1.f);
    const int64_t len = c.rank() == 1 ? 12 : 16;
    try {
      c.allReduce(
          v.data(), v.data(), len,
          info(Collective::kAllReduce, DType::kFloat32, ReduceOp::kSum, -1, {len}));
      ADD_FAILURE() << "no error on rank " << c.rank();
    } catch (const MismatchError& e) {
      msgs[c.rank()] = e.what();
    }
    // Still usable, in step on every rank.
    c.allReduce(v.data(), v.data(), 16, info(Collective::kAllReduce, DType::kFloat32));
    for (float x : v) ASSERT_EQ(x, 3.f);
  });
  expectNoErrors(errs);
  EXPECT_EQ(msgs[0], msgs[1]);
  EXPECT_EQ(msgs[0], msgs[2]);
  EXPECT_NE(msgs[0].find("collective #1"), std::string::npos) << msgs[0];
  EXPECT_NE(msgs[0].find("rank 1: all_reduce #1 float32[12]"), std::string::npos)
      << msgs[0];
}

TEST(ShmComm, DifferentCollectivesOrRootsAreNamed) {
  std::vector<std::string> msgs(2);
  expectNoErrors(runRanks(2, [&](ShmComm& c) {
    int32_t x = 1;
    try {
      if (c.rank() == 0) {
        c.broadcast(&x, 4,
                    info(Collective::kBroadcast, DType::kInt32, ReduceOp::kSum, 0));
      } else {
        c.broadcast(&x, 4,
                    info(Collective::kBroadcast, DType::kInt32, ReduceOp::kSum, 1));
      }
    } catch (const MismatchError& e) {
      msgs[c.rank()] = e.what();
    }
  }));
  EXPECT_EQ(msgs[0], msgs[1]);
  EXPECT_NE(msgs[0].find("root 0"), std::string::npos);
  EXPECT_NE(msgs[0].find("root 1"), std::string::npos);
}

TEST(ShmComm, LatePeerTimesOutNamingIt) {
  auto opts = testing::smallOptions();
  opts.timeout = std::chrono::milliseconds(300);
  std::atomic<bool> released{false};
  std::vector<std::string> msgs(3);
  auto errs = runRanks(
      3,
      [&](ShmComm& c) {
        if (c.rank() == 2) {
          while (!released.load())
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
          return;  // never calls the all-reduce
        }
        float v = 1.f;
        const auto t0 = std::chrono::steady_clock::now();
        try {
          c.allReduce(&v, &v, 1, info(Collective::kAllReduce, DType::kFloat32));
        } catch (const PeerError& e) {
          msgs[c.rank()] = e.what();
        }
        EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
        // Broken from now on, with a message that says why.
        EXPECT_THROW(c.barrier(), PeerError);
        released = true;
      },
      opts);
  expectNoErrors(errs);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(msgs[r].find("all_reduce #1"), std::string::npos) << msgs[r];
    EXPECT_NE(msgs[r].find("[2]"), std::string::npos) << msgs[r];
  }
}

// A peer process that dies mid-job: the survivor raises promptly (it polls
// the peer's liveness while asleep) instead of waiting out the timeout.
TEST(ShmComm, DeadPeerProcessIsDetected) {
  const std::string name = Segment::randomName();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ShmComm c(name, 1, 2, testing::smallOptions());
    c.barrier();
    _exit(0);  // dies without joining the all-reduce
  }
  auto opts = testing::smallOptions();
  opts.timeout = std::chrono::seconds(30);
  ShmComm c(name, 0, 2, opts);
  c.barrier();
  // Reap the child so it is gone, not a zombie (either is detected).
  int status = 0;
  waitpid(child, &status, 0);
  float v = 1.f;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    c.allReduce(&v, &v, 1, info(Collective::kAllReduce, DType::kFloat32));
    FAIL() << "no error";
  } catch (const PeerError& e) {
    EXPECT_NE(std::string(e.what()).find("has exited"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

TEST(ShmComm, SegmentNameIsGoneOnceEveryoneAttached) {
  const std::string name = Segment::randomName();
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] {
      ShmComm c(name, r, 2, testing::smallOptions());
      // Rank 0 unlinks right after the init step, before it arrives at the
      // next one: once any collective has returned, the name is gone.
      c.barrier();
      EXPECT_NE(access(("/dev/shm" + name).c_str(), F_OK), 0);
    });
  }
  for (auto& t : ts) t.join();
}

TEST(ShmComm, ManyMoreRanksThanCores) {
  // 8 ranks on 2 cores: spin-then-sleep must keep this quick.
  const int n = 8;
  expectNoErrors(runRanks(n, [n](ShmComm& c) {
    for (int it = 0; it < 200; ++it) {
      int64_t v = c.rank();
      c.allReduce(&v, &v, 1, info(Collective::kAllReduce, DType::kInt64));
      ASSERT_EQ(v, n * (n - 1) / 2);
    }
  }));
}

}  // namespace
}  // namespace dsp

namespace dsp {
namespace {

TEST(Segment, CreatedOwnerOnlyAndExclusive) {
  const std::string name = Segment::randomName();
  EXPECT_EQ(name.size(), std::string("/dsp-").size() + 32);
  EXPECT_NE(name, Segment::randomName());
  const mode_t old = umask(0);  // a permissive umask must not widen the mode
  Segment seg = Segment::create(name, 4096);
  umask(old);
  struct stat st{};
  ASSERT_EQ(stat(("/dev/shm" + name).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_THROW(Segment::create(name, 4096), std::runtime_error);  // O_EXCL
  seg.unlink();
  EXPECT_NE(access(("/dev/shm" + name).c_str(), F_OK), 0);
}

}  // namespace
}  // namespace dsp
