// Out-of-place collectives on a process group named by string, for the
// tensor-parallel ops. Each returns a fresh tensor (custom ops may not alias
// their inputs) and blocks until the collective is done, so the result can be
// used by the next kernel on the same device.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace dsparallel {

struct GroupRef {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  int64_t rank;
  int64_t size;
};

// Resolves `name` with c10d::resolve_process_group; a clear error when this
// rank is not in the group or the name is unknown.
GroupRef resolveGroup(c10::string_view name, const char* op);

at::Tensor allReduce(const GroupRef& g, const at::Tensor& x,
                     c10d::ReduceOp::RedOpType op = c10d::ReduceOp::SUM);

// torch.ops.dsparallel.all_reduce_'s kernel: `t` all-reduced in place with
// `op` ("sum", "avg", "product", "min", "max"), blocking.
at::Tensor& allReduceNamed(at::Tensor& t, c10::string_view group_name,
                           c10::string_view op);

// Concatenates every rank's `x` along `dim` (0 or the last dim).
at::Tensor allGatherAlong(const GroupRef& g, const at::Tensor& x, int64_t dim);

// Sum over ranks of `x`, then this rank's 1/size slice along dim 0.
at::Tensor reduceScatterDim0(const GroupRef& g, const at::Tensor& x);

// This rank's 1/size slice of `x` along `dim`, as a new contiguous tensor.
at::Tensor splitAlong(const GroupRef& g, const at::Tensor& x, int64_t dim,
                      const char* op);

}  // namespace dsparallel
