// Collective latency of the torch-free core (dsp::ShmComm), ranks as
// processes: the same loop as mpi_latency.c runs over MPI, so that the two
// transports are compared without torch's or Python's per-call cost.
//
//   core_latency RANKS COLLECTIVE DATA SIZE_BYTES...   (one JSON line: size -> us)
//
// COLLECTIVE: all_reduce (float32 sum, in place), all_gather (SIZE is the
// output's bytes, as in benchmarks/collectives.py) or broadcast (from rank
// 0). DATA: "static" calls on the same data again and again; "fresh" first
// rewrites what this rank contributes (all of it for all_reduce, its piece
// for all_gather, the root's buffer for broadcast), as training does with
// each step's new values: a peer then cannot find it still in its own cache
// from the call before, and the rewrite's own time counts. Per size: untimed
// calls (an eighth of a round, at least 200), then 5 rounds, each ended by a
// barrier so that it lasts until the slowest rank is done; rank 0 prints the
// median round's time per call.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/shm/comm.h"
#include "core/shm/segment.h"

namespace {

// About 64 MiB moved per round: 16000 calls at 8 bytes, 200 from 64 KiB up.
int iterationsFor(size_t bytes) {
  return static_cast<int>(
      std::clamp<size_t>((size_t{64} << 20) / (8 * bytes + 4096), 200, 20000));
}

void runRank(const std::string& name, int rank, int n, const std::string& collective,
             bool fresh, const std::vector<size_t>& sizes) {
  dsp::ShmComm comm(name, rank, n, dsp::ShmOptions{});
  std::string json = "{";
  for (size_t bytes : sizes) {
    const size_t count = std::max<size_t>(n, bytes / 4) / n * n;  // whole pieces
    std::vector<float> v(count, 0.0f);  // zeros: the sums stay exact and finite
    std::vector<void*> pieces;          // all_gather: rank r's piece of v
    for (int r = 0; r < n; ++r) pieces.push_back(v.data() + count / n * r);
    dsp::CallInfo info;
    info.dtype = dsp::DType::kFloat32;
    info.op = dsp::ReduceOp::kSum;
    info.root = 0;
    info.shape = {static_cast<int64_t>(count)};
    std::function<void()> call;
    // What "fresh" rewrites before each call (zeros again: still exact).
    auto rewrite = [&](float* p, size_t k) {
      if (fresh) std::fill(p, p + k, 0.0f);
    };
    if (collective == "all_reduce") {
      info.kind = dsp::Collective::kAllReduce;
      call = [&] {
        rewrite(v.data(), count);
        comm.allReduce(v.data(), v.data(), count, info);
      };
    } else if (collective == "all_gather") {
      info.kind = dsp::Collective::kAllGather;
      info.shape = {static_cast<int64_t>(count / n)};
      call = [&] {
        rewrite(static_cast<float*>(pieces[rank]), count / n);
        comm.allGather(pieces[rank], count / n * 4, pieces.data(), info);
      };
    } else if (collective == "broadcast") {
      info.kind = dsp::Collective::kBroadcast;
      call = [&] {
        if (rank == 0) rewrite(v.data(), count);
        comm.broadcast(v.data(), count * 4, info);
      };
    } else {
      throw std::invalid_argument("unknown collective " + collective);
    }
    const int iters = iterationsFor(bytes);
    for (int i = 0; i < std::max(200, iters / 8); ++i) call();
    std::vector<double> rounds;
    for (int r = 0; r < 5; ++r) {
      comm.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) call();
      comm.barrier();
      rounds.push_back(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
              .count() /
          iters);
    }
    std::sort(rounds.begin(), rounds.end());
    json += (json.size() > 1 ? ", \"" : "\"") + std::to_string(bytes) +
            "\": " + std::to_string(rounds[2]);
  }
  if (rank == 0) std::printf("%s}\n", json.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string data = argc > 3 ? argv[3] : "";
  if (argc < 5 || (data != "static" && data != "fresh")) {
    std::fprintf(stderr, "usage: %s RANKS COLLECTIVE static|fresh SIZE_BYTES...\n",
                 argv[0]);
    return 2;
  }
  const int n = std::atoi(argv[1]);
  const std::string collective = argv[2];
  std::vector<size_t> sizes;
  for (int i = 4; i < argc; ++i) sizes.push_back(std::strtoull(argv[i], nullptr, 10));
  const std::string name = dsp::Segment::randomName();
  std::vector<pid_t> children;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      int code = 0;
      try {
        runRank(name, r, n, collective, data == "fresh", sizes);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        code = 1;
      }
      std::fflush(stdout);
      _exit(code);
    }
    children.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  return failed ? 1 : 0;
}
