// All-reduce across hosts, hierarchically.
//
// A flat all-reduce over gloo moves every byte across the network from every
// rank. With H hosts of L ranks each, "dsp" instead:
//   1. reduce-scatters within the host over shared memory: local rank i ends
//      with the host's reduction of slice i (1/L of the tensor);
//   2. all-reduces slice i across hosts over gloo, among the ranks with local
//      rank i (one per host): L all-reduces run side by side, each on 1/L of
//      the data, so every rank's network link carries 1/L of the bytes;
//   3. all-gathers the slices within the host over shared memory.
// AVG is summed in both stages and each slice divided by the world size once,
// before the all-gather.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <vector>

#include "process_group_dsp.h"
#include "tensor_adapt.h"

namespace dsparallel {
namespace {

std::string listOf(const std::vector<int>& ranks) {
  std::string out = "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(ranks[i]);
  }
  return out + "]";
}

// Runs one stage, prefixing its error with where it ran: the shared-memory
// comm numbers this host's ranks from 0, which the user must map back.
template <typename Fn>
void stage(const char* where, const std::vector<int>& ranks, Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "dsp all_reduce across hosts failed ", where, " (global ranks ",
                listOf(ranks), ", numbered 0.. there): ", e.what());
  }
}

}  // namespace

void ProcessGroupDSP::hierarchicalAllReduce(const at::Tensor& t, c10d::ReduceOp op) {
  const bool avg = op == c10d::ReduceOp::AVG;
  const c10d::ReduceOp combine = avg ? c10d::ReduceOp(c10d::ReduceOp::SUM) : op;
  const auto dtype = checkedDType(t, "all_reduce");
  const dsp::ReduceOp intra_op = checkedReduceOp(combine, dtype, "all_reduce");
  const int local = topology_.local_size;
  at::Tensor data = t.contiguous();
  at::Tensor flat = data.view({-1});
  const int64_t n = flat.numel();
  // Pieces go through all three stages one after the other while they are
  // still in cache; a multiple of the host's ranks, so that only the last
  // piece can be ragged.
  const int64_t piece =
      std::max<int64_t>(local, hier_piece_bytes_ / t.element_size() / local * local);
  for (int64_t off = 0; off < std::max<int64_t>(n, 1); off += piece) {
    const int64_t len = std::min(piece, n - off);
    const int64_t per =
        (len + local - 1) / local;  // slice length; a ragged tail is padded
    const size_t slice_bytes = static_cast<size_t>(per) * t.element_size();
    const bool ragged = len % local != 0;
    at::Tensor buf =
        ragged ? at::zeros({local * per}, t.options()) : flat.narrow(0, off, len);
    if (ragged) buf.narrow(0, 0, len).copy_(flat.narrow(0, off, len));
    at::Tensor slice = at::empty({per}, t.options());
    char* base = static_cast<char*>(buf.data_ptr());
    std::vector<const void*> ins(local);
    std::vector<void*> outs(local);
    for (int i = 0; i < local; ++i) ins[i] = outs[i] = base + i * slice_bytes;

    // 1. Within the host.
    stage("within this host", topology_.host_ranks, [&] {
      comm_->reduceScatter(ins.data(), slice.data_ptr(), static_cast<size_t>(per),
                           callInfo(dsp::Collective::kReduceScatter, slice, intra_op));
    });
    // 2. Across hosts, this rank's slice.
    stage("between hosts", topology_.inter_ranks, [&] {
      std::vector<at::Tensor> across = {slice};
      c10d::AllreduceOptions opts;
      opts.reduceOp = combine;
      topology_.inter->allreduce(across, opts)->wait();
    });
    if (avg) slice.div_(getSize());  // on 1/L of the data, before it spreads
    // 3. Within the host again.
    stage("within this host", topology_.host_ranks, [&] {
      comm_->allGather(slice.data_ptr(), slice_bytes, outs.data(),
                       callInfo(dsp::Collective::kAllGather, slice, dsp::ReduceOp::kSum));
    });
    if (ragged) flat.narrow(0, off, len).copy_(buf.narrow(0, 0, len));
  }
  if (!data.is_same(t)) t.copy_(data);
  ++hierarchical_all_reduces_;
}

}  // namespace dsparallel
