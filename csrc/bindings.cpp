// dsparallel._C: the one Python module of the extension.
#include <pybind11/chrono.h>
#include <torch/csrc/utils/pybind.h>

#include "backend/process_group_dsp.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "dsparallel C++ extension";

  py::class_<dsparallel::ProcessGroupDSP, c10d::Backend,
             c10::intrusive_ptr<dsparallel::ProcessGroupDSP>>(m, "ProcessGroupDSP")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout,
                       c10::intrusive_ptr<c10d::Backend> p2p) {
             return c10::make_intrusive<dsparallel::ProcessGroupDSP>(
                 store, rank, size, timeout, std::move(p2p));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("p2p") = nullptr,
           // Construction rendezvouses with the peers: never hold the GIL.
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("segment_name", &dsparallel::ProcessGroupDSP::segmentName);
}
