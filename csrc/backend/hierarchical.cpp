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
//
// Broadcast, all-gather and reduce-scatter are hierarchical too, for the
// same reason: every byte crosses the network once per remote host, where
// gloo's flat versions send it over several ring or tree edges that span
// hosts (benchmarks/collectives.py --nodes 2 --link-mbit M measures them on a
// shaped link).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/reduce.h"
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

// Runs one stage of collective `what`, prefixing its error with where it ran:
// the shared-memory comm numbers this host's ranks from 0, which the user
// must map back.
template <typename Fn>
void stage(const char* what, bool within_host, const std::vector<int>& ranks, Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "dsp ", what, " across hosts failed ",
                within_host ? "within this host" : "between hosts", " (global ranks ",
                listOf(ranks), within_host ? ", numbered 0.. there" : "",
                "): ", e.what());
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
  // Pieces, a multiple of the host's ranks so that only the last can be
  // ragged, double-buffered: piece k+1 is reduce-scattered within the host
  // while piece k crosses the network on gloo's thread, and piece k is
  // all-gathered once it is back. The link does not idle during the
  // shared-memory stages, and every rank issues them in the same order.
  const int64_t piece =
      std::max<int64_t>(local, hier_piece_bytes_ / t.element_size() / local * local);
  const int64_t pieces = std::max<int64_t>(1, (n + piece - 1) / piece);
  const int64_t per_max = std::min(piece, (n + local - 1) / local * local) / local;
  at::Tensor slice_bufs[2] = {at::empty({per_max}, t.options()),
                              at::empty({per_max}, t.options())};
  struct Piece {
    int64_t off, len, per;
    bool ragged;  // buf is a padded copy, not the piece itself
    at::Tensor buf, slice;
    c10::intrusive_ptr<c10d::Work> across;
  };
  // 1. Within the host, then 2. across hosts (launched, not waited).
  auto start = [&](int64_t k) {
    Piece p;
    p.off = k * piece;
    p.len = std::min(piece, n - p.off);
    p.per = (p.len + local - 1) / local;  // slice length; a ragged tail is padded
    p.ragged = p.len % local != 0;
    p.buf =
        p.ragged ? at::zeros({local * p.per}, t.options()) : flat.narrow(0, p.off, p.len);
    if (p.ragged) p.buf.narrow(0, 0, p.len).copy_(flat.narrow(0, p.off, p.len));
    p.slice = slice_bufs[k % 2].narrow(0, 0, p.per);
    const size_t slice_bytes = static_cast<size_t>(p.per) * t.element_size();
    std::vector<const void*> ins(local);
    for (int i = 0; i < local; ++i)
      ins[i] = static_cast<char*>(p.buf.data_ptr()) + i * slice_bytes;
    stage("all_reduce", true, topology_.host_ranks, [&] {
      comm_->reduceScatter(ins.data(), p.slice.data_ptr(), static_cast<size_t>(p.per),
                           callInfo(dsp::Collective::kReduceScatter, p.slice, intra_op));
    });
    stage("all_reduce", false, topology_.inter_ranks, [&] {
      // After the first piece's shared-memory stage, so that a peer lost
      // on another host is reported here, between hosts, by every rank.
      if (k == 0)
        checkAcrossHosts(*topology_.inter, topology_.inter_ranks, "all_reduce", t,
                         static_cast<int64_t>(op.op_), -1);
      std::vector<at::Tensor> across = {p.slice};
      c10d::AllreduceOptions opts;
      opts.reduceOp = combine;
      p.across = topology_.inter->allreduce(across, opts);
    });
    return p;
  };
  // 3. Within the host again, once the piece is back from the network.
  auto finish = [&](Piece& p) {
    stage("all_reduce", false, topology_.inter_ranks, [&] { p.across->wait(); });
    if (avg) p.slice.div_(getSize());  // on 1/L of the data, before it spreads
    const size_t slice_bytes = static_cast<size_t>(p.per) * t.element_size();
    std::vector<void*> outs(local);
    for (int i = 0; i < local; ++i)
      outs[i] = static_cast<char*>(p.buf.data_ptr()) + i * slice_bytes;
    stage("all_reduce", true, topology_.host_ranks, [&] {
      comm_->allGather(
          p.slice.data_ptr(), slice_bytes, outs.data(),
          callInfo(dsp::Collective::kAllGather, p.slice, dsp::ReduceOp::kSum));
    });
    if (p.ragged) flat.narrow(0, p.off, p.len).copy_(p.buf.narrow(0, 0, p.len));
  };
  Piece in_flight = start(0);
  for (int64_t k = 1; k < pieces; ++k) {
    Piece next = start(k);
    finish(in_flight);
    in_flight = std::move(next);
  }
  finish(in_flight);
  if (!data.is_same(t)) t.copy_(data);
  ++hierarchical_calls_;
}

std::vector<int> ProcessGroupDSP::interGroupOf(int local) const {
  std::vector<int> ranks;
  for (const auto& host : topology_.hosts) ranks.push_back(host.at(local));
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

void ProcessGroupDSP::hierarchicalBroadcast(const at::Tensor& t, int root) {
  int root_local = -1;
  for (const auto& host : topology_.hosts) {
    auto it = std::find(host.begin(), host.end(), root);
    if (it != host.end()) root_local = static_cast<int>(it - host.begin());
  }
  TORCH_INTERNAL_ASSERT(root_local >= 0, "broadcast root ", root, " is on no host");
  stage("broadcast", false, topology_.inter_ranks, [&] {
    checkAcrossHosts(*topology_.inter, topology_.inter_ranks, "broadcast", t, -1, root);
  });
  ++hierarchical_calls_;
  Staged s(t);
  if (s.bytes() == 0) return;
  if (topology_.local_rank == root_local) {
    const auto& peers = topology_.inter_ranks;
    stage("broadcast", false, peers, [&] {
      // The staged buffer: the host's broadcast below hands it on.
      std::vector<at::Tensor> across = {s.tensor()};
      c10d::BroadcastOptions opts;
      opts.rootRank = static_cast<int64_t>(std::find(peers.begin(), peers.end(), root) -
                                           peers.begin());
      topology_.inter->broadcast(across, opts)->wait();
    });
  }
  stage("broadcast", true, topology_.host_ranks, [&] {
    comm_->broadcast(
        s.ptr(), s.bytes(),
        callInfo(dsp::Collective::kBroadcast, t, dsp::ReduceOp::kSum, root_local));
  });
  s.copyBack();
}

void ProcessGroupDSP::hierarchicalAllGather(const at::Tensor& in,
                                            const std::vector<at::Tensor>& outs) {
  const int hosts = static_cast<int>(topology_.hosts.size());
  const int local = topology_.local_size;
  const int64_t m = in.numel();
  stage("all_gather", false, topology_.inter_ranks, [&] {
    checkAcrossHosts(*topology_.inter, topology_.inter_ranks, "all_gather", in, -1, -1);
  });
  ++hierarchical_calls_;
  if (m == 0) return;
  at::Tensor mine = in.contiguous().view({-1});
  std::vector<Staged> staged = stageAll(outs);
  std::vector<at::Tensor> flat_outs;
  for (const auto& s : staged) flat_outs.push_back(s.tensor().view({-1}));
  std::vector<std::vector<int>> groups;  // groups[j]: local index j's ranks
  for (int j = 0; j < local; ++j) groups.push_back(interGroupOf(j));
  // Pieces, double-buffered: piece k+1 crosses the network (on gloo's
  // thread) while piece k is all-gathered within the host, so the link does
  // not idle during the shared-memory stage; the staging stays small.
  const int64_t piece =
      std::min(m, std::max<int64_t>(1, hier_piece_bytes_ / in.element_size() / hosts));
  at::Tensor across_bufs[2] = {at::empty({hosts * piece}, in.options()),
                               at::empty({hosts * piece}, in.options())};
  at::Tensor all_buf = at::empty({local * hosts * piece}, in.options());
  const int64_t pieces = (m + piece - 1) / piece;
  auto length = [&](int64_t k) { return std::min(piece, m - k * piece); };
  auto across = [&](int64_t k) {
    return across_bufs[k % 2].narrow(0, 0, hosts * length(k)).view({hosts, length(k)});
  };
  // 1. Across hosts: piece k of the inputs of this rank's inter group, in
  //    that group's rank order.
  auto launch = [&](int64_t k) {
    c10::intrusive_ptr<c10d::Work> work;
    stage("all_gather", false, topology_.inter_ranks, [&] {
      std::vector<std::vector<at::Tensor>> gathered = {across(k).unbind(0)};
      std::vector<at::Tensor> input = {mine.narrow(0, k * piece, length(k))};
      work = topology_.inter->allgather(gathered, input);
    });
    return work;
  };
  c10::intrusive_ptr<c10d::Work> next = launch(0);
  for (int64_t k = 0; k < pieces; ++k) {
    stage("all_gather", false, topology_.inter_ranks, [&] { next->wait(); });
    if (k + 1 < pieces) next = launch(k + 1);
    // 2. Within the host: every local rank's block, so all inputs are here.
    const int64_t len = length(k);
    at::Tensor block = across(k);
    at::Tensor all = all_buf.narrow(0, 0, local * hosts * len).view({local, hosts, len});
    std::vector<void*> blocks(local);
    for (int j = 0; j < local; ++j) blocks[j] = all[j].data_ptr();
    stage("all_gather", true, topology_.host_ranks, [&] {
      comm_->allGather(block.data_ptr(), block.nbytes(), blocks.data(),
                       callInfo(dsp::Collective::kAllGather, block));
    });
    for (int j = 0; j < local; ++j)
      for (int h = 0; h < hosts; ++h)
        flat_outs[groups[j][h]].narrow(0, k * piece, len).copy_(all[j][h]);
  }
  for (auto& s : staged) s.copyBack();
}

void ProcessGroupDSP::hierarchicalReduceScatter(const std::vector<at::Tensor>& chunks,
                                                const at::Tensor& out,
                                                c10d::ReduceOp op) {
  const bool avg = op == c10d::ReduceOp::AVG;
  const c10d::ReduceOp combine = avg ? c10d::ReduceOp(c10d::ReduceOp::SUM) : op;
  const dsp::DType dtype = checkedDType(out, "reduce_scatter");
  const dsp::ReduceOp intra_op = checkedReduceOp(combine, dtype, "reduce_scatter");
  const int hosts = static_cast<int>(topology_.hosts.size());
  const int local = topology_.local_size;
  const int64_t m = out.numel();
  ++hierarchical_calls_;
  if (m == 0) return;
  std::vector<at::Tensor> flat_chunks;
  for (const auto& c : chunks) flat_chunks.push_back(c.reshape({-1}));
  Staged dst(out);
  at::Tensor flat_out = dst.tensor().view({-1});
  std::vector<std::vector<int>> groups;  // groups[j]: local index j's ranks
  for (int j = 0; j < local; ++j) groups.push_back(interGroupOf(j));
  // Pieces of every chunk, double-buffered as in all-gather: piece k+1 is
  // reduced within the host while piece k is reduce-scattered across hosts.
  const int64_t piece = std::min(
      m, std::max<int64_t>(1, hier_piece_bytes_ / out.element_size() / hosts / local));
  const int64_t pieces = (m + piece - 1) / piece;
  auto length = [&](int64_t k) { return std::min(piece, m - k * piece); };
  at::Tensor ordered = at::empty({local * hosts * piece}, out.options());
  at::Tensor host_sums[2] = {at::empty({hosts * piece}, out.options()),
                             at::empty({hosts * piece}, out.options())};
  at::Tensor received[2] = {at::empty({hosts * piece}, out.options()),
                            at::empty({hosts * piece}, out.options())};
  struct Pending {
    c10::intrusive_ptr<c10d::Work> work;
    int64_t off = 0, len = 0;
    at::Tensor received;
  };
  // Each inter peer's partial sums of this rank's chunk arrive by one
  // all-to-all and are reduced here: gloo's own reduce-scatter is an
  // all-reduce underneath, which sends every byte twice.
  auto reduceArrived = [&](Pending& p) {
    stage("reduce_scatter", false, topology_.inter_ranks, [&] { p.work->wait(); });
    std::vector<const void*> parts(hosts);
    for (int h = 0; h < hosts; ++h) parts[h] = p.received[h].data_ptr();
    dsp::reduceInto(flat_out.narrow(0, p.off, p.len).data_ptr(), parts.data(), hosts,
                    static_cast<size_t>(p.len), dtype, intra_op, 1);
  };
  Pending in_flight;
  for (int64_t k = 0; k < pieces; ++k) {
    const int64_t off = k * piece, len = length(k);
    // 1. Within the host. The chunks in the order the reduce-scatter splits
    //    them: local rank j's block holds its inter group's chunks.
    at::Tensor blocks =
        ordered.narrow(0, 0, local * hosts * len).view({local, hosts, len});
    for (int j = 0; j < local; ++j)
      for (int h = 0; h < hosts; ++h)
        blocks[j][h].copy_(flat_chunks[groups[j][h]].narrow(0, off, len));
    std::vector<const void*> ins(local);
    for (int j = 0; j < local; ++j) ins[j] = blocks[j].data_ptr();
    at::Tensor host_sum = host_sums[k % 2].narrow(0, 0, hosts * len);
    stage("reduce_scatter", true, topology_.host_ranks, [&] {
      comm_->reduceScatter(ins.data(), host_sum.data_ptr(),
                           static_cast<size_t>(hosts * len),
                           callInfo(dsp::Collective::kReduceScatter, host_sum, intra_op));
    });
    // 2. Across hosts: launched; the previous piece, whose buffers the next
    //    one reuses, is finished meanwhile.
    Pending next;
    next.off = off;
    next.len = len;
    next.received = received[k % 2].narrow(0, 0, hosts * len).view({hosts, len});
    stage("reduce_scatter", false, topology_.inter_ranks, [&] {
      // After the first piece's shared-memory stage, as in all-reduce.
      if (k == 0)
        checkAcrossHosts(*topology_.inter, topology_.inter_ranks, "reduce_scatter", out,
                         static_cast<int64_t>(op.op_), -1);
      at::Tensor recv_flat = next.received.view({-1});
      std::vector<int64_t> equal_splits;
      c10d::AllToAllOptions opts;
      next.work = topology_.inter->alltoall_base(recv_flat, host_sum, equal_splits,
                                                 equal_splits, opts);
    });
    if (in_flight.work) reduceArrived(in_flight);
    in_flight = std::move(next);
  }
  reduceArrived(in_flight);
  if (avg) flat_out.div_(getSize());
  dst.copyBack();
}

}  // namespace dsparallel
