#include "ops/group_collectives.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

namespace dsparallel {

GroupRef resolveGroup(c10::string_view name, const char* op) {
  auto pg = c10d::resolve_process_group(std::string(name));
  TORCH_CHECK(pg, op, ": no process group named \"", name, "\"");
  const int64_t rank = pg->getRank();
  TORCH_CHECK(rank >= 0, op, ": this process is not a member of group \"", name, "\"");
  return {pg, rank, pg->getSize()};
}

at::Tensor allReduce(const GroupRef& g, const at::Tensor& x,
                     c10d::ReduceOp::RedOpType op) {
  std::vector<at::Tensor> t = {x.clone(at::MemoryFormat::Contiguous)};
  if (g.size == 1) return t[0];
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp(op);
  g.pg->allreduce(t, opts)->wait();
  return t[0];
}

at::Tensor allGatherAlong(const GroupRef& g, const at::Tensor& x, int64_t dim) {
  if (g.size == 1) return x.clone(at::MemoryFormat::Contiguous);
  at::Tensor in = x.contiguous();
  std::vector<int64_t> stacked = {g.size};
  for (auto s : in.sizes()) stacked.push_back(s);
  at::Tensor out = at::empty(stacked, in.options());
  g.pg->_allgather_base(out, in)->wait();
  // out is [size, *x.shape]: rank-major, which is already the dim-0
  // concatenation; any other dim needs the rank axis moved next to it.
  if (dim == 0) {
    std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
    shape[0] *= g.size;
    return out.view(shape);
  }
  std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
  shape[dim] *= g.size;
  return out.movedim(0, dim).reshape(shape);
}

at::Tensor reduceScatterDim0(const GroupRef& g, const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(0) % g.size == 0,
              "reduce_scatter_to_sequence_parallel_region: dim 0 (",
              x.dim() ? x.size(0) : 0, ") is not divisible by the group size (", g.size,
              ")");
  if (g.size == 1) return x.clone(at::MemoryFormat::Contiguous);
  at::Tensor in = x.contiguous();
  std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
  shape[0] /= g.size;
  at::Tensor out = at::empty(shape, in.options());
  g.pg->_reduce_scatter_base(out, in)->wait();
  return out;
}

at::Tensor splitAlong(const GroupRef& g, const at::Tensor& x, int64_t dim,
                      const char* op) {
  TORCH_CHECK(x.dim() >= 1, op, ": needs a tensor with at least one dimension");
  const int64_t n = x.size(dim);
  TORCH_CHECK(n % g.size == 0, op, ": dimension ", dim, " has size ", n,
              ", not divisible by the group size ", g.size);
  const int64_t part = n / g.size;
  return x.narrow(dim, g.rank * part, part).clone(at::MemoryFormat::Contiguous);
}

}  // namespace dsparallel
