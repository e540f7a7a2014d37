// dsparallel._C: the one Python module of the extension.
#include <pybind11/chrono.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/utils/pybind.h>

#include "backend/process_group_dsp.h"
#include "core/pipeline/schedule.h"
#include "ddp/reducer.h"
#include "ops/group_collectives.h"
#include "pipeline/runtime.h"
#include "pipeline/split_backward.h"

namespace py = pybind11;

namespace {

// Python objects of the classes below are destroyed without the GIL. Their
// destructors wait on other threads (our worker; gloo's work loop inside the
// group) that may themselves need the GIL to finish: dropping the last
// reference to a tensor Python created, or running a comm hook's Python
// callback. Destroying them with the GIL held deadlocks (it did: a dsp group
// over gloo, dropped by the frame that created it). torch binds its own
// process groups the same way.
template <typename Fn>
void withoutGil(Fn&& fn) {
  if (PyGILState_Check()) {
    py::gil_scoped_release release;
    fn();
  } else {
    fn();
  }
}

template <typename T>
class NoGilPtr {
 public:
  NoGilPtr() = default;
  NoGilPtr(const NoGilPtr&) = default;
  NoGilPtr(NoGilPtr&&) noexcept = default;
  NoGilPtr& operator=(const NoGilPtr&) = default;
  NoGilPtr& operator=(NoGilPtr&&) noexcept = default;
  /* implicit */ NoGilPtr(c10::intrusive_ptr<T> impl) : impl_(std::move(impl)) {}
  // pybind11 builds a holder from a raw pointer it was handed as new.
  explicit NoGilPtr(T* impl)
      : impl_(c10::intrusive_ptr<T>::unsafe_steal_from_new(impl)) {}
  ~NoGilPtr() {
    if (impl_) withoutGil([this] { impl_.reset(); });
  }
  T* get() const noexcept { return impl_.get(); }

 private:
  c10::intrusive_ptr<T> impl_;
};

struct DeleteWithoutGil {
  template <typename T>
  void operator()(T* p) const {
    withoutGil([p] { delete p; });
  }
};

}  // namespace

PYBIND11_DECLARE_HOLDER_TYPE(T, NoGilPtr<T>, true)

PYBIND11_MODULE(_C, m) {
  m.doc() = "dsparallel C++ extension";

  py::class_<dsparallel::ProcessGroupDSP, c10d::Backend,
             NoGilPtr<dsparallel::ProcessGroupDSP>>(m, "ProcessGroupDSP")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout,
                       c10::intrusive_ptr<c10d::Backend> p2p, int local_rank,
                       int local_size, c10::intrusive_ptr<c10d::Backend> inter,
                       std::vector<int> host_ranks, std::vector<int> inter_ranks,
                       int machine_ranks, c10::intrusive_ptr<c10d::Backend> cuda,
                       std::vector<std::vector<int>> hosts) {
             dsparallel::Topology topology{local_rank,
                                           local_size,
                                           std::move(inter),
                                           std::move(host_ranks),
                                           std::move(inter_ranks),
                                           std::move(hosts),
                                           machine_ranks};
             return NoGilPtr<dsparallel::ProcessGroupDSP>(
                 c10::make_intrusive<dsparallel::ProcessGroupDSP>(
                     store, rank, size, timeout, std::move(p2p), std::move(topology),
                     std::move(cuda)));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("p2p") = nullptr, py::arg("local_rank") = -1,
           py::arg("local_size") = -1, py::arg("inter") = nullptr,
           py::arg("host_ranks") = std::vector<int>{},
           py::arg("inter_ranks") = std::vector<int>{}, py::arg("machine_ranks") = -1,
           py::arg("cuda") = nullptr, py::arg("hosts") = std::vector<std::vector<int>>{},
           // Construction rendezvouses with the peers: never hold the GIL.
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("segment_name", &dsparallel::ProcessGroupDSP::segmentName)
      .def_property_readonly("segment_bytes", &dsparallel::ProcessGroupDSP::segmentBytes)
      .def_property_readonly("hierarchical", &dsparallel::ProcessGroupDSP::hierarchical)
      .def_property_readonly("multi_host", &dsparallel::ProcessGroupDSP::multiHost)
      .def_property_readonly("hierarchical_calls",
                             &dsparallel::ProcessGroupDSP::hierarchicalCalls);

  // Works freed on a group's worker thread, process-wide (tests: always 0).
  m.def("works_freed_on_worker", &dsparallel::WorkDSP::freedOnWorker);

  using ReducerPtr = std::unique_ptr<dsparallel::Reducer, DeleteWithoutGil>;
  py::class_<dsparallel::Reducer, ReducerPtr>(m, "Reducer")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<std::string> names,
                       c10::intrusive_ptr<c10d::ProcessGroup> group,
                       std::vector<size_t> bucket_caps, bool find_unused,
                       bool gradient_as_bucket_view, bool static_graph, int zero_stage) {
             dsparallel::ReducerOptions o;
             o.zero_stage = zero_stage;
             o.bucket_caps = std::move(bucket_caps);
             o.find_unused_parameters = find_unused;
             o.gradient_as_bucket_view = gradient_as_bucket_view;
             o.static_graph = static_graph;
             return ReducerPtr(new dsparallel::Reducer(
                 std::move(params), std::move(names), std::move(group), std::move(o)));
           }),
           py::arg("params"), py::arg("names"), py::arg("group"), py::arg("bucket_caps"),
           py::arg("find_unused_parameters"), py::arg("gradient_as_bucket_view"),
           py::arg("static_graph"), py::arg("zero_stage") = 0)
      .def("prepare_for_backward", &dsparallel::Reducer::prepareForBackward,
           py::arg("outputs"), py::call_guard<py::gil_scoped_release>())
      .def(
          "register_comm_hook",
          [](dsparallel::Reducer& r, py::object state, py::object hook) {
            r.registerCommHook(std::make_unique<c10d::PythonCommHook>(std::move(state),
                                                                      std::move(hook)));
          },
          py::arg("state"), py::arg("hook"))
      .def("bucket_indices", &dsparallel::Reducer::bucketIndices)
      .def_property_readonly("in_place_buckets", &dsparallel::Reducer::inPlaceBuckets)
      .def_property_readonly("buckets_rebuilt", &dsparallel::Reducer::bucketsRebuilt)
      .def("bucket_offsets", &dsparallel::Reducer::bucketOffsets)
      .def("padded_numels", &dsparallel::Reducer::paddedNumels)
      .def("grad_shards", &dsparallel::Reducer::gradShards)
      .def("zero_grad_shards", &dsparallel::Reducer::zeroGradShards,
           py::arg("set_to_none"))
      .def("params_with_gradients", &dsparallel::Reducer::paramsWithGradients)
      .def_property_readonly("staging_bytes", &dsparallel::Reducer::stagingBytes)
      .def("set_reduce_dtype", &dsparallel::Reducer::setReduceDType, py::arg("dtype"));

  namespace pp = dsp::pipeline;
  py::class_<pp::Action>(m, "PipelineAction")
      .def_property_readonly("kind",
                             [](const pp::Action& a) {
                               const std::string t = pp::toString({a.type, 0, 0});
                               return t.substr(1, t.size() - 2);  // strip the zeros
                             })
      .def_readonly("stage", &pp::Action::stage)
      .def_readonly("microbatch", &pp::Action::microbatch)
      .def("__str__", &pp::toString)
      .def("__repr__", &pp::toString)
      .def("__eq__", &pp::Action::operator==)
      .def_static("parse", &pp::parseAction, py::arg("text"));
  py::class_<pp::ScheduleStats>(m, "PipelineScheduleStats")
      .def_readonly("makespan", &pp::ScheduleStats::makespan)
      .def_readonly("bubble", &pp::ScheduleStats::bubble)
      .def_readonly("peak_in_flight", &pp::ScheduleStats::peak_in_flight)
      .def_readonly("start_slots", &pp::ScheduleStats::start_slots);
  py::class_<pp::Schedule>(m, "PipelineSchedule")
      .def(py::init([](int stages, int microbatches,
                       const std::vector<std::vector<std::string>>& ranks) {
             pp::Schedule s;
             s.num_stages = stages;
             s.num_microbatches = microbatches;
             s.num_ranks = static_cast<int>(ranks.size());
             for (const auto& r : ranks) {
               s.ranks.emplace_back();
               for (const auto& text : r) s.ranks.back().push_back(pp::parseAction(text));
             }
             return s;
           }),
           py::arg("num_stages"), py::arg("num_microbatches"), py::arg("ranks"))
      // "loop" (stage s on rank s % ranks) or "v" (rank r: stages r and 2 ranks - 1 - r).
      .def_property_readonly("placement",
                             [](const pp::Schedule& s) {
                               return s.placement == pp::Placement::kV ? "v" : "loop";
                             })
      .def_readonly("num_stages", &pp::Schedule::num_stages)
      .def_readonly("num_ranks", &pp::Schedule::num_ranks)
      .def_readonly("num_microbatches", &pp::Schedule::num_microbatches)
      .def_readonly("ranks", &pp::Schedule::ranks)
      // costs: (F, B, I, W) durations in any integer unit (default: one slot
      // each), or a list of them, one per stage.
      .def(
          "validate",
          [](const pp::Schedule& s, std::optional<std::tuple<int, int, int, int>> costs) {
            pp::Costs c;
            if (costs) std::tie(c.forward, c.backward, c.input, c.weight) = *costs;
            return pp::validate(s, c);
          },
          py::arg("costs") = std::nullopt)
      .def(
          "validate",
          [](const pp::Schedule& s,
             const std::vector<std::tuple<int, int, int, int>>& costs) {
            std::vector<pp::Costs> per_stage(costs.size());
            for (size_t i = 0; i < costs.size(); ++i) {
              auto& c = per_stage[i];
              std::tie(c.forward, c.backward, c.input, c.weight) = costs[i];
            }
            return pp::validate(s, per_stage);
          },
          py::arg("costs"));
  py::class_<dsparallel::pipeline::Runtime>(m, "PipelineRuntime")
      .def(py::init([](std::vector<pp::Action> actions, int stages, int ranks, int mbs,
                       c10::intrusive_ptr<c10d::ProcessGroup> group,
                       const std::string& placement) {
             return std::make_unique<dsparallel::pipeline::Runtime>(
                 std::move(actions), stages, ranks, mbs, std::move(group),
                 placement == "v" ? pp::Placement::kV : pp::Placement::kLoop);
           }),
           py::arg("actions"), py::arg("num_stages"), py::arg("num_ranks"),
           py::arg("num_microbatches"), py::arg("group"), py::arg("placement") = "loop")
      // Waits on peers: without the GIL (the callbacks take it to compute).
      .def("step", &dsparallel::pipeline::Runtime::step, py::arg("forward"),
           py::arg("backward"), py::arg("weight") = nullptr,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("trace", &dsparallel::pipeline::Runtime::trace)
      .def_property_readonly("transfer_trace",
                             &dsparallel::pipeline::Runtime::transferTrace);
  m.def("make_schedule", &pp::makeSchedule, py::arg("name"), py::arg("num_stages"),
        py::arg("num_microbatches"), py::arg("stages_per_rank") = 1);
  m.def(
      "rank_of_stage",
      [](int stage, int ranks, const std::string& placement) {
        return pp::rankOfStage(
            stage, ranks, placement == "v" ? pp::Placement::kV : pp::Placement::kLoop);
      },
      py::arg("stage"), py::arg("num_ranks"), py::arg("placement") = "loop");
  // torch.ops.dsparallel.all_reduce_ without the dispatcher's boxed call from
  // Python: dsparallel.ops.all_reduce_ calls this for tensors outside autograd
  // (the boxed call costs a few microseconds, as much as a small all-reduce;
  // benchmarks/collectives.py times both). Bumps the version counter, as an
  // in-place op does.
  m.def(
      "all_reduce_",
      [](at::Tensor t, const std::string& group_name, const std::string& op) {
        dsparallel::allReduceNamed(t, group_name, op);
        t.unsafeGetTensorImpl()->bump_version();
      },
      py::arg("tensor"), py::arg("group_name"), py::arg("op") = "sum",
      py::call_guard<py::gil_scoped_release>());
  // The weight-gradient store of the split backward (tests and opt-in use).
  m.def("weight_grad_begin",
        [] { dsparallel::pipeline::WeightGradStore::standalone().begin(); });
  m.def("weight_grad_end",
        [] { return dsparallel::pipeline::WeightGradStore::standalone().end(); });
  m.def(
      "weight_grad_run",
      [](int64_t key) {
        return dsparallel::pipeline::WeightGradStore::standalone().run(key);
      },
      py::arg("key"), py::call_guard<py::gil_scoped_release>());
  m.def("weight_grad_pending",
        [] { return dsparallel::pipeline::WeightGradStore::standalone().pending(); });
}
