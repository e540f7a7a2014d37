// The backend, the DDP reducer and the pipeline runtime driven from several
// threads without Python, for ThreadSanitizer (scripts/tsan.sh builds this
// beside the core's suite; tests/tsan/CMakeLists.txt). Ranks are threads of
// this process sharing a HashStore, each with its groups (and their worker
// threads); every scenario checks its results, so the run is also a test.
//
//   backend:  per rank, one thread issues async collectives, another waits
//             on them (dropping each Work at once), a third exchanges
//             point-to-point messages with the ring neighbours on a second
//             group while a fourth polls the same receive's Work;
//   hand-off: async collectives dropped by their callers just as the
//             worker hands them over: none freed on the worker;
//   completion: a receive waited on by one thread and polled by another,
//             completed once;
//   reducer:  DDP's bucketed all-reduce: hooks on the backward's thread,
//             all-reduces on the group's worker, the final wait, three
//             iterations (the buckets are rebuilt after the first), in
//             place and as bucket views;
//   pipeline: 1F1B over two ranks with C++ callbacks, a step whose stage
//             throws on one rank (both raise), then a step that must give
//             the one-process gradients.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "backend/process_group_dsp.h"
#include "core/pipeline/schedule.h"
#include "ddp/reducer.h"
#include "pipeline/runtime.h"

namespace {

using namespace std::chrono_literals;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

std::mutex g_print;
std::atomic<int> g_failures{0};

void check(bool ok, const std::string& what) {
  if (ok) return;
  std::lock_guard<std::mutex> lock(g_print);
  std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  ++g_failures;
}

Group makeGroup(const c10::intrusive_ptr<c10d::Store>& store, const std::string& name,
                int rank, int size) {
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(name, store);
  auto backend = c10::make_intrusive<dsparallel::ProcessGroupDSP>(prefixed, rank, size,
                                                                  60s, nullptr);
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(prefixed, rank, size);
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  return pg;
}

// Runs body(rank) on `size` threads; each builds its own groups from `store`.
void ranks(int size, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const std::exception& e) {
        check(false, "rank " + std::to_string(r) + ": " + e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
}

void backendScenario(int size) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  ranks(size, [&](int rank) {
    Group world = makeGroup(store, "world", rank, size);
    Group p2p = makeGroup(store, "p2p", rank, size);
    auto backend = world->getBackend(c10::DeviceType::CPU);
    constexpr int kRounds = 2000;
    std::mutex m;
    std::condition_variable cv;
    std::deque<std::pair<int, c10::intrusive_ptr<c10d::Work>>> issued;
    std::thread waiter([&] {
      for (int i = 0; i < kRounds; ++i) {
        std::unique_lock<std::mutex> lock(m);
        cv.wait(lock, [&] { return !issued.empty(); });
        auto [round, work] = std::move(issued.front());
        issued.pop_front();
        lock.unlock();
        // Three ways to wait: polling (the caller drops its reference the
        // moment the Work says it is complete, while the worker may still be
        // handing it over), bounded and unbounded.
        if (round % 3 == 0) {
          while (!work->isCompleted()) {
          }
        } else {
          work->wait(round % 3 == 1 ? std::chrono::milliseconds(10000) : ::kNoTimeout);
        }
        const at::Tensor out = work->result()[0];
        const double want = round * size * (size + 1) / 2.0;
        check(out.eq(want).all().item<bool>(),
              "all-reduce round " + std::to_string(round));
      }  // each Work dropped here, while the worker may still hold it
    });
    std::thread neighbours([&] {
      auto pb = p2p->getBackend(c10::DeviceType::CPU);
      const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
      std::mutex slot_mutex;
      c10::intrusive_ptr<c10d::Work> polled;  // the receive being waited on
      std::atomic<bool> stop{false};
      std::thread poller([&] {
        while (!stop.load()) {
          c10::intrusive_ptr<c10d::Work> w;
          {
            std::lock_guard<std::mutex> lock(slot_mutex);
            w = polled;
          }
          if (w) w->isCompleted();  // beside the wait on the other thread
          std::this_thread::yield();
        }
      });
      auto setPolled = [&](c10::intrusive_ptr<c10d::Work> w) {
        std::lock_guard<std::mutex> lock(slot_mutex);
        polled = std::move(w);
      };
      for (int i = 0; i < kRounds; ++i) {
        std::vector<at::Tensor> in = {at::empty({16})};
        auto recv = pb->recv(in, prev, i);
        setPolled(recv);
        std::vector<at::Tensor> out = {at::full({16}, rank * 1000.0 + i)};
        pb->send(out, next, i)->wait();
        recv->wait();
        setPolled({});
        check(in[0].eq(prev * 1000.0 + i).all().item<bool>(),
              "message " + std::to_string(i) + " from rank " + std::to_string(prev));
      }
      stop.store(true);
      poller.join();
    });
    for (int i = 0; i < kRounds; ++i) {
      std::vector<at::Tensor> t = {at::full({i % 3 == 0 ? 64 : 4096}, i * (rank + 1.0))};
      c10d::AllreduceOptions opts;
      opts.asyncOp = i % 2 == 0;  // half run on the caller's thread
      auto work = backend->allreduce(t, opts);
      {
        std::lock_guard<std::mutex> lock(m);
        issued.emplace_back(i, std::move(work));
      }
      cv.notify_one();
    }
    waiter.join();
    neighbours.join();
  });
  check(dsparallel::WorkDSP::freedOnWorker() == 0,
        std::to_string(dsparallel::WorkDSP::freedOnWorker()) +
            " Work(s) freed on a worker thread");
}

// A receive that one thread waits on while another polls isCompleted()
// completes once: its copy-back into a non-contiguous tensor (2 MB,
// transposed, milliseconds long) does not run again after the waiter has
// written its own value. (From Python the GIL keeps the poll and the write
// apart; a C++ caller has no such luck.)
void completionScenario() {
  auto store = c10::make_intrusive<c10d::HashStore>();
  ranks(2, [&](int rank) {
    Group pair = makeGroup(store, "pair", rank, 2);
    auto backend = pair->getBackend(c10::DeviceType::CPU);
    for (int i = 0; i < 20; ++i) {
      std::vector<at::Tensor> in = {at::zeros({512, 1024}).t()};
      auto recv = backend->recv(in, 1 - rank, i);
      std::atomic<bool> stop{false};
      std::thread poller([&] {
        while (!stop.load()) recv->isCompleted();
      });
      std::vector<at::Tensor> out = {at::full({1024, 512}, double(i))};
      backend->send(out, 1 - rank, i)->wait();
      recv->wait();
      in[0].fill_(-1.0);
      stop.store(true);
      poller.join();
      check(in[0].eq(-1.0).all().item<bool>(),
            "round " + std::to_string(i) + ": the receive was copied back again");
    }
  });
}

// Async collectives each dropped by their caller a little after their
// future completes (a delay swept over a few microseconds, to land in the
// worker's hand-off, which once decided by use_count() who frees the Work):
// none is freed on the worker thread.
void handOffScenario() {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const int64_t before = dsparallel::WorkDSP::freedOnWorker();
  ranks(2, [&](int rank) {
    Group pair = makeGroup(store, "handoff", rank, 2);
    auto backend = pair->getBackend(c10::DeviceType::CPU);
    c10d::AllreduceOptions opts;
    opts.asyncOp = true;
    for (int i = 0; i < 3000; ++i) {
      std::vector<at::Tensor> t = {at::ones({4})};
      auto work = backend->allreduce(t, opts);
      auto future = work->getFuture();
      while (!future->completed()) {
      }
      const auto until =
          std::chrono::steady_clock::now() + std::chrono::nanoseconds(i % 60 * 100);
      while (std::chrono::steady_clock::now() < until) {
      }
      work.reset();
    }
  });
  const int64_t freed = dsparallel::WorkDSP::freedOnWorker() - before;
  check(freed == 0, std::to_string(freed) + " Work(s) freed on a worker thread");
}

void reducerScenario(int size, bool as_view) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  ranks(size, [&](int rank) {
    Group world = makeGroup(store, "ddp", rank, size);
    // Its own generator: the global one is shared by the rank threads.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
    std::vector<at::Tensor> params = {at::randn({32, 32}, gen).requires_grad_(),
                                      at::randn({32}, gen).requires_grad_(),
                                      at::randn({32, 8}, gen).requires_grad_()};
    const auto inputOf = [](int r) { return at::ones({4, 32}) * (r + 1) / 10.0; };
    // Every rank's gradient, computed here: their average is the target.
    std::vector<at::Tensor> want;
    for (int r = 0; r < size; ++r) {
      auto copies = std::vector<at::Tensor>{};
      for (const auto& p : params) copies.push_back(p.detach().clone().requires_grad_());
      auto loss = (inputOf(r).mm(copies[0]) + copies[1]).tanh().mm(copies[2]).sum();
      torch::autograd::backward({loss});
      for (size_t i = 0; i < copies.size(); ++i) {
        if (r == 0)
          want.push_back(copies[i].grad() / size);
        else
          want[i] = want[i] + copies[i].grad() / size;
      }
    }
    dsparallel::ReducerOptions o;
    o.bucket_caps = {2048, 4096};
    o.gradient_as_bucket_view = as_view;
    dsparallel::Reducer reducer(params, {"w1", "b1", "w2"}, world, o);
    for (int it = 0; it < 3; ++it) {
      for (auto& p : params) p.mutable_grad() = at::Tensor();
      auto loss = (inputOf(rank).mm(params[0]) + params[1]).tanh().mm(params[2]).sum();
      reducer.prepareForBackward({loss});
      torch::autograd::backward({loss});
      for (size_t i = 0; i < params.size(); ++i) {
        check(
            at::allclose(params[i].grad(), want[i], 1e-5, 1e-6),
            "DDP gradient " + std::to_string(i) + " at iteration " + std::to_string(it));
      }
    }
  });
}

void pipelineScenario() {
  constexpr int kMicro = 4;
  auto store = c10::make_intrusive<c10d::HashStore>();
  at::manual_seed(1);
  const at::Tensor w0 = at::randn({8, 8}), w1 = at::randn({8, 8}), x = at::randn({16, 8});
  // One process: the whole batch, loss summed over micro-batches.
  auto r0 = w0.clone().requires_grad_(), r1 = w1.clone().requires_grad_();
  torch::autograd::backward({x.mm(r0).tanh().mm(r1).tanh().sum()});
  const auto schedule = dsp::pipeline::makeSchedule("1f1b", 2, kMicro);
  ranks(2, [&](int rank) {
    Group pp = makeGroup(store, "pp", rank, 2);
    dsparallel::pipeline::Runtime runtime(schedule.ranks[rank], 2, 2, kMicro, pp);
    auto w = (rank == 0 ? w0 : w1).clone().requires_grad_();
    for (int step = 0; step < 2; ++step) {
      const bool faulty = step == 0;
      std::map<int, std::pair<at::Tensor, at::Tensor>> kept;  // mb -> (input, output)
      auto forward =
          [&](int, int mb,
              dsparallel::pipeline::MaybeTensor in) -> dsparallel::pipeline::MaybeTensor {
        if (faulty && rank == 1 && mb == 2) throw std::runtime_error("injected");
        at::Tensor input = rank == 0 ? x.chunk(kMicro)[mb] : in->requires_grad_();
        at::Tensor out = input.mm(w).tanh();
        kept[mb] = {input, out};
        if (rank == 1) return std::nullopt;
        return out.detach();
      };
      auto backward = [&](int, int mb, dsparallel::pipeline::MaybeTensor grad)
          -> dsparallel::pipeline::MaybeTensor {
        auto [input, out] = kept.at(mb);
        kept.erase(mb);
        if (rank == 1) {
          torch::autograd::backward({out.sum()});
          return input.grad();
        }
        torch::autograd::backward({out}, {*grad});
        return std::nullopt;
      };
      bool raised = false;
      try {
        runtime.step(forward, backward);
      } catch (const std::exception& e) {
        raised = std::string(e.what()).find("injected") != std::string::npos;
      }
      if (faulty) {
        check(raised, "rank " + std::to_string(rank) + ": the failed step did not raise");
        w.mutable_grad() = at::Tensor();
      } else {
        check(!raised, "rank " + std::to_string(rank) + ": the second step raised");
        check(at::allclose(w.grad(), (rank == 0 ? r0 : r1).grad(), 1e-5, 1e-6),
              "pipeline gradient on rank " + std::to_string(rank));
      }
    }
  });
}

}  // namespace

int main() {
  at::set_num_threads(1);  // torch's own pool is not instrumented
  backendScenario(3);
  completionScenario();
  handOffScenario();
  std::puts("backend: done");
  reducerScenario(2, false);
  reducerScenario(2, true);
  std::puts("reducer: done");
  pipelineScenario();
  std::puts("pipeline: done");
  if (g_failures.load() != 0) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures.load());
    return 1;
  }
  std::puts("harness: every check passed");
  return 0;
}
