// All-reduce latency of the torch-free core (dsp::ShmComm), ranks as
// processes: the same loop as mpi_latency.c runs over MPI_Allreduce, so that
// the two transports are compared without torch's or Python's per-call cost.
//
//   core_latency RANKS SIZE_BYTES...   (prints one JSON line: size -> us)
//
// float32 sum, in place. Per size: untimed calls (an eighth of a round, at
// least 200), then 5 rounds, each ended by a barrier so that it lasts until
// the slowest rank is done; rank 0 prints the median round's time per call.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
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

void runRank(const std::string& name, int rank, int n, const std::vector<size_t>& sizes) {
  dsp::ShmComm comm(name, rank, n, dsp::ShmOptions{});
  std::string json = "{";
  for (size_t bytes : sizes) {
    const size_t count = std::max<size_t>(1, bytes / 4);
    std::vector<float> v(count, 0.0f);  // zeros: the sums stay exact and finite
    dsp::CallInfo info;
    info.kind = dsp::Collective::kAllReduce;
    info.dtype = dsp::DType::kFloat32;
    info.op = dsp::ReduceOp::kSum;
    info.shape = {static_cast<int64_t>(count)};
    auto call = [&] { comm.allReduce(v.data(), v.data(), count, info); };
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
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s RANKS SIZE_BYTES...\n", argv[0]);
    return 2;
  }
  const int n = std::atoi(argv[1]);
  std::vector<size_t> sizes;
  for (int i = 2; i < argc; ++i) sizes.push_back(std::strtoull(argv[i], nullptr, 10));
  const std::string name = dsp::Segment::randomName();
  std::vector<pid_t> children;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      int code = 0;
      try {
        runRank(name, r, n, sizes);
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
