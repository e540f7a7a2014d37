// torch.ops.dsparallel.all_reduce_: an in-place all-reduce on a group named by
// string, for latency-bound callers (tensor-parallel layers, inference).
//
// It asks the group's backend for a blocking all-reduce directly, which on
// "dsp" runs on the caller's thread: what it skips is torch.distributed's
// Python wrapper and the c10d dispatcher op, about 2 us of the ~5 us an
// 8-byte dist.all_reduce takes at 2 ranks (benchmarks/collectives.py
// measures both). Any backend works; only "dsp" runs it inline.
// dsparallel.ops.all_reduce_ calls the same kernel through our pybind module
// (allReduceNamed), skipping the dispatcher's boxed call from Python too.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "group_collectives.h"

namespace dsparallel {
namespace {

c10d::ReduceOp parseOp(c10::string_view op) {
  if (op == "sum") return c10d::ReduceOp::SUM;
  if (op == "avg") return c10d::ReduceOp::AVG;
  if (op == "product") return c10d::ReduceOp::PRODUCT;
  if (op == "min") return c10d::ReduceOp::MIN;
  if (op == "max") return c10d::ReduceOp::MAX;
  TORCH_CHECK(false, "all_reduce_: op must be \"sum\", \"avg\", \"product\", \"min\" or ",
              "\"max\", got \"", op, "\"");
}

}  // namespace

at::Tensor& allReduceNamed(at::Tensor& t, c10::string_view group_name,
                           c10::string_view op) {
  const c10d::ReduceOp reduce = parseOp(op);
  const GroupRef g = resolveGroup(group_name, "all_reduce_");
  c10d::AllreduceOptions opts;
  opts.reduceOp = reduce;
  opts.asyncOp = false;  // blocking: "dsp" runs it on this thread
  std::vector<at::Tensor> tensors = {t};
  g.pg->getBackend(t.device().type())->allreduce(tensors, opts)->wait();
  return t;
}

namespace {

at::Tensor& allReduceMeta(at::Tensor& t, c10::string_view, c10::string_view) { return t; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsparallel, m) {
  m.def("all_reduce_(Tensor(a!) t, str group_name, str op=\"sum\") -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(dsparallel, CompositeExplicitAutograd, m) {
  m.impl("all_reduce_", &allReduceNamed);
}

TORCH_LIBRARY_IMPL(dsparallel, Meta, m) { m.impl("all_reduce_", &allReduceMeta); }

}  // namespace dsparallel
