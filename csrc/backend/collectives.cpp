// The c10d collectives of ProcessGroupDSP. Each one validates its tensors in
// the caller's thread (errors raise before anything is queued), then queues a
// closure that stages the tensors contiguously, calls the core, and copies
// results back.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "process_group_dsp.h"
#include "tensor_adapt.h"

namespace dsparallel {
namespace {

using dsp::Collective;

void checkRoot(int64_t root, int size, const char* what) {
  TORCH_CHECK(root >= 0 && root < size, "dsp ", what, ": root rank ", root,
              " is not in the group of size ", size);
}

void checkListSize(size_t got, int size, const char* what, const char* which) {
  TORCH_CHECK(got == static_cast<size_t>(size), "dsp ", what, ": ", which,
              " must hold one tensor per rank (", size, "), got ", got);
}

// The root's per-rank list of a rooted collective (gather's outputs,
// scatter's inputs), checked against `ref`; empty on the other ranks, which
// must not pass one.
std::vector<at::Tensor> rootList(const std::vector<std::vector<at::Tensor>>& lists,
                                 const at::Tensor& ref, bool root, int64_t root_rank,
                                 int size, const char* what) {
  if (!root) {
    TORCH_CHECK(lists.empty() || lists[0].empty(), "dsp ", what, ": only the root rank ",
                root_rank, " passes a ", what, " list");
    return {};
  }
  TORCH_CHECK(lists.size() == 1, "dsp ", what, ": the root expects one ", what, " list");
  checkListSize(lists[0].size(), size, what, "the list");
  checkSameAs(lists[0], ref, what);
  return lists[0];
}

std::vector<void*> pointers(std::vector<Staged>& staged) {
  std::vector<void*> out;
  for (auto& s : staged) out.push_back(s.ptr());
  return out;
}

// Splits (in rows of dim 0) to byte counts and byte offsets for all_to_all;
// empty splits mean equal parts.
void splitBytes(const at::Tensor& t, const std::vector<int64_t>& splits, int size,
                const char* which, std::vector<size_t>& bytes,
                std::vector<size_t>& offsets) {
  const int64_t rows = t.dim() > 0 ? t.size(0) : 1;
  const size_t rowBytes = rows ? t.nbytes() / rows : 0;
  bytes.assign(size, 0);
  offsets.assign(size, 0);
  if (splits.empty()) {
    TORCH_CHECK(rows % size == 0, "dsp all_to_all: ", which, " has ", rows,
                " rows along dim 0, not divisible by the group size ", size,
                " (pass split sizes)");
  } else {
    checkListSize(splits.size(), size, "all_to_all", which);
  }
  int64_t total = 0;
  for (int r = 0; r < size; ++r) {
    const int64_t n = splits.empty() ? rows / size : splits[r];
    TORCH_CHECK(n >= 0, "dsp all_to_all: negative split size ", n);
    offsets[r] = static_cast<size_t>(total) * rowBytes;
    bytes[r] = static_cast<size_t>(n) * rowBytes;
    total += n;
  }
  TORCH_CHECK(total == rows, "dsp all_to_all: ", which, " split sizes sum to ", total,
              " but the tensor has ", rows, " rows");
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::allreduce(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  const at::Tensor& t = single(tensors, "all_reduce");
  if (auto* b = route(t, "all_reduce", /*across_hosts=*/!hierarchical())) {
    return b->allreduce(tensors, opts);
  }
  const auto dt = checkedDType(t, "all_reduce");
  auto info = callInfo(Collective::kAllReduce, t,
                       checkedReduceOp(opts.reduceOp, dt, "all_reduce"));
  if (hierarchical()) {
    return enqueue(
        c10d::OpType::ALLREDUCE, nullptr, tensors,
        [this, t, op = opts.reduceOp] { hierarchicalAllReduce(t, op); }, blocking(opts));
  }
  return enqueue(
      c10d::OpType::ALLREDUCE, nullptr, tensors,
      [this, t, info] {
        Staged s(t);
        comm_->allReduce(s.ptr(), s.ptr(), s.count(), info);
        s.copyBack();
      },
      blocking(opts));
}

// One all-reduce over all the tensors taken as one array: one
// synchronisation for the lot instead of one per tensor.
c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  if (auto* b = route(tensors, "all_reduce_coalesced", /*across_hosts=*/!hierarchical()))
    return b->allreduce_coalesced(tensors, opts);
  TORCH_CHECK(!tensors.empty(), "dsp all_reduce_coalesced: no tensors given");
  for (const auto& t : tensors) {
    checkedDType(t, "all_reduce_coalesced");
    TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(),
                "dsp all_reduce_coalesced: all tensors must share one dtype, "
                "got ",
                tensors[0].scalar_type(), " and ", t.scalar_type());
  }
  const auto dt = checkedDType(tensors[0], "all_reduce_coalesced");
  auto info = callInfo(Collective::kAllReduce, tensors[0],
                       checkedReduceOp(opts.reduceOp, dt, "all_reduce_coalesced"));
  int64_t total = 0;
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& t : tensors) {
    total += t.numel();
    shapes.push_back(t.sizes().vec());
  }
  info.shape = {total};
  info.tensors = static_cast<uint32_t>(tensors.size());
  info.shapes_hash = dsp::hashShapes(shapes);
  if (hierarchical()) {
    // Across hosts: one flat buffer, so that the lot crosses the network as
    // one hierarchical all-reduce (its slices split evenly among the host's
    // ranks), not one per tensor.
    return enqueue(
        c10d::OpType::ALLREDUCE_COALESCED, nullptr, tensors,
        [this, tensors, op = opts.reduceOp] {
          std::vector<at::Tensor> flat_views;
          for (const auto& t : tensors) flat_views.push_back(t.reshape({-1}));
          at::Tensor flat = at::cat(flat_views);
          hierarchicalAllReduce(flat, op);
          int64_t off = 0;
          for (const auto& t : tensors) {
            t.copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
            off += t.numel();
          }
        },
        blocking(opts));
  }
  return enqueue(
      c10d::OpType::ALLREDUCE_COALESCED, nullptr, tensors,
      [this, tensors, info] {
        // In place, tensor by tensor: no packing copy in or out
        // (only a non-contiguous tensor is staged).
        std::vector<Staged> staged = stageAll(tensors);
        std::vector<void*> ptrs;
        std::vector<size_t> counts;
        for (const auto& s : staged) {
          ptrs.push_back(s.ptr());
          counts.push_back(s.count());
        }
        comm_->allReduce(dsp::BufferList(std::move(ptrs), std::move(counts),
                                         tensors[0].element_size()),
                         info);
        for (auto& s : staged) s.copyBack();
      },
      blocking(opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::broadcast(
    std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) {
  if (auto* b = route(tensors, "broadcast", /*across_hosts=*/!hierarchical()))
    return b->broadcast(tensors, opts);
  const at::Tensor& t = single(tensors, "broadcast");
  checkRoot(opts.rootRank, getSize(), "broadcast");
  if (hierarchical()) {
    checkedDType(t, "broadcast");
    return enqueue(
        c10d::OpType::BROADCAST, nullptr, tensors,
        [this, t, root = static_cast<int>(opts.rootRank)] {
          hierarchicalBroadcast(t, root);
        },
        blocking(opts));
  }
  auto info = callInfo(Collective::kBroadcast, t, dsp::ReduceOp::kSum,
                       static_cast<int>(opts.rootRank));
  return enqueue(
      c10d::OpType::BROADCAST, nullptr, tensors,
      [this, t, info] {
        Staged s(t);
        comm_->broadcast(s.ptr(), s.bytes(), info);
        s.copyBack();
      },
      blocking(opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  if (auto* b = route(tensors, "reduce")) return b->reduce(tensors, opts);
  const at::Tensor& t = single(tensors, "reduce");
  checkRoot(opts.rootRank, getSize(), "reduce");
  const auto dt = checkedDType(t, "reduce");
  auto info =
      callInfo(Collective::kReduce, t, checkedReduceOp(opts.reduceOp, dt, "reduce"),
               static_cast<int>(opts.rootRank));
  return enqueue(
      c10d::OpType::REDUCE, nullptr, tensors,
      [this, t, info] {
        Staged s(t);
        comm_->reduce(s.ptr(), s.ptr(), s.count(), info);
        if (getRank() == info.root) s.copyBack();
      },
      blocking(opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (auto* b = route(inputs, "all_gather", /*across_hosts=*/!hierarchical()))
    return b->allgather(outputs, inputs, opts);
  const at::Tensor& in = single(inputs, "all_gather");
  TORCH_CHECK(outputs.size() == 1, "dsp all_gather: expects one output list");
  checkListSize(outputs[0].size(), getSize(), "all_gather", "the output list");
  checkSameAs(outputs[0], in, "all_gather");
  auto info = callInfo(Collective::kAllGather, in);
  auto outs = outputs[0];
  if (hierarchical()) {
    return enqueue(
        c10d::OpType::ALLGATHER, nullptr, outs,
        [this, in, outs] { hierarchicalAllGather(in, outs); }, blocking(opts));
  }
  return enqueue(
      c10d::OpType::ALLGATHER, nullptr, outs,
      [this, in, outs, info] {
        Staged src(in);
        auto staged = stageAll(outs);
        auto ptrs = pointers(staged);
        comm_->allGather(src.ptr(), src.bytes(), ptrs.data(), info);
        for (auto& s : staged) s.copyBack();
      },
      blocking(opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  if (auto* b =
          route(input, "all_gather_into_tensor", /*across_hosts=*/!hierarchical())) {
    if (b != cuda_.get() && output.is_contiguous() && input.dim() > 0 &&
        output.numel() == input.numel() * getSize()) {
      // torch allows a stacked output, (size, *input.shape); gloo takes only
      // the concatenated one, (size * input.shape[0], ...): the same memory.
      std::vector<int64_t> shape = input.sizes().vec();
      shape[0] *= getSize();
      at::Tensor concatenated = output.view(shape);
      return b->_allgather_base(concatenated, input, opts);
    }
    return b->_allgather_base(output, input, opts);
  }
  checkedDType(output, "all_gather_into_tensor");
  TORCH_CHECK(output.scalar_type() == input.scalar_type() &&
                  output.numel() == input.numel() * getSize(),
              "dsp all_gather_into_tensor: output must be ", input.scalar_type(),
              " with ", input.numel() * getSize(), " elements (group size ", getSize(),
              " x input ", input.sizes(), "), got ", output.scalar_type(), " ",
              output.sizes());
  if (hierarchical()) {
    return enqueue(
        c10d::OpType::_ALLGATHER_BASE, nullptr, {output},
        [this, input, output] {
          hierarchicalAllGather(input, output.view({getSize(), -1}).unbind(0));
        },
        blocking(opts));
  }
  auto info = callInfo(Collective::kAllGather, input);
  return enqueue(
      c10d::OpType::_ALLGATHER_BASE, nullptr, {output},
      [this, input, output, info] {
        Staged src(input);
        Staged dst(output);
        std::vector<void*> ptrs;
        for (int r = 0; r < getSize(); ++r) {
          ptrs.push_back(static_cast<char*>(dst.ptr()) + r * src.bytes());
        }
        comm_->allGather(src.ptr(), src.bytes(), ptrs.data(), info);
        dst.copyBack();
      },
      blocking(opts));
}

// torch's layout: outputs[r][i] receives rank r's inputs[i]. One Work for
// the lot (see coalesced()): its error is any member's.
c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (auto* b = route(inputs, "all_gather_coalesced", /*across_hosts=*/!hierarchical()))
    return b->allgather_coalesced(outputs, inputs, opts);
  TORCH_CHECK(!inputs.empty(), "dsp all_gather_coalesced: no input tensors given");
  checkListSize(outputs.size(), getSize(), "all_gather_coalesced", "the output lists");
  for (size_t r = 0; r < outputs.size(); ++r) {
    TORCH_CHECK(outputs[r].size() == inputs.size(),
                "dsp all_gather_coalesced: output list ", r, " holds ", outputs[r].size(),
                " tensors for ", inputs.size(), " inputs (one per input)");
  }
  std::vector<at::Tensor> all_outputs;
  for (const auto& list : outputs)
    all_outputs.insert(all_outputs.end(), list.begin(), list.end());
  return coalesced(c10d::OpType::ALLGATHER_COALESCED, "all_gather_coalesced", all_outputs,
                   inputs, [&](size_t i) {
                     std::vector<std::vector<at::Tensor>> o(1);
                     for (const auto& list : outputs) o[0].push_back(list[i]);
                     std::vector<at::Tensor> in = {inputs[i]};
                     allgather(o, in, opts);
                   });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (auto* b = route(inputs, "all_gather_into_tensor_coalesced",
                      /*across_hosts=*/!hierarchical())) {
    return b->allgather_into_tensor_coalesced(outputs, inputs, opts);
  }
  TORCH_CHECK(outputs.size() == inputs.size() && !inputs.empty(),
              "dsp all_gather_into_tensor_coalesced: ", outputs.size(), " outputs for ",
              inputs.size(), " inputs");
  return coalesced(c10d::OpType::COALESCED, "all_gather_into_tensor_coalesced", outputs,
                   inputs,
                   [&](size_t i) { _allgather_base(outputs[i], inputs[i], opts); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  if (auto* b = route(inputs, "gather")) return b->gather(outputs, inputs, opts);
  const at::Tensor& in = single(inputs, "gather");
  checkRoot(opts.rootRank, getSize(), "gather");
  const auto outs = rootList(outputs, in, getRank() == opts.rootRank, opts.rootRank,
                             getSize(), "gather");
  auto info = callInfo(Collective::kGather, in, dsp::ReduceOp::kSum,
                       static_cast<int>(opts.rootRank));
  return enqueue(
      c10d::OpType::GATHER, nullptr, outs,
      [this, in, outs, info] {
        Staged src(in);
        auto staged = stageAll(outs);
        auto ptrs = pointers(staged);
        comm_->gather(src.ptr(), src.bytes(), ptrs.data(), info);
        for (auto& s : staged) s.copyBack();
      },
      blocking(opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  if (auto* b = route(outputs, "scatter")) return b->scatter(outputs, inputs, opts);
  const at::Tensor& out = single(outputs, "scatter");
  checkRoot(opts.rootRank, getSize(), "scatter");
  const auto ins = rootList(inputs, out, getRank() == opts.rootRank, opts.rootRank,
                            getSize(), "scatter");
  auto info = callInfo(Collective::kScatter, out, dsp::ReduceOp::kSum,
                       static_cast<int>(opts.rootRank));
  return enqueue(
      c10d::OpType::SCATTER, nullptr, outputs,
      [this, out, ins, info] {
        auto staged = stageAll(ins);
        std::vector<const void*> ptrs;
        for (auto& s : staged) ptrs.push_back(s.ptr());
        Staged dst(out);
        comm_->scatter(ptrs.data(), dst.ptr(), dst.bytes(), info);
        dst.copyBack();
      },
      blocking(opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (auto* b = route(outputs, "reduce_scatter", /*across_hosts=*/!hierarchical()))
    return b->reduce_scatter(outputs, inputs, opts);
  const at::Tensor& out = single(outputs, "reduce_scatter");
  TORCH_CHECK(inputs.size() == 1, "dsp reduce_scatter: expects one input list");
  checkListSize(inputs[0].size(), getSize(), "reduce_scatter", "the input list");
  checkSameAs(inputs[0], out, "reduce_scatter");
  const auto dt = checkedDType(out, "reduce_scatter");
  auto info = callInfo(Collective::kReduceScatter, out,
                       checkedReduceOp(opts.reduceOp, dt, "reduce_scatter"));
  auto ins = inputs[0];
  if (hierarchical()) {
    return enqueue(
        c10d::OpType::REDUCE_SCATTER, nullptr, outputs,
        [this, out, ins, op = opts.reduceOp] { hierarchicalReduceScatter(ins, out, op); },
        blocking(opts));
  }
  return enqueue(
      c10d::OpType::REDUCE_SCATTER, nullptr, outputs,
      [this, out, ins, info] {
        auto staged = stageAll(ins);
        std::vector<const void*> ptrs;
        for (auto& s : staged) ptrs.push_back(s.ptr());
        Staged dst(out);
        comm_->reduceScatter(ptrs.data(), dst.ptr(), dst.count(), info);
        dst.copyBack();
      },
      blocking(opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  if (auto* b = route(input, "reduce_scatter_tensor", /*across_hosts=*/!hierarchical()))
    return b->_reduce_scatter_base(output, input, opts);
  const auto dt = checkedDType(output, "reduce_scatter_tensor");
  TORCH_CHECK(input.scalar_type() == output.scalar_type() &&
                  input.numel() == output.numel() * getSize(),
              "dsp reduce_scatter_tensor: input must be ", output.scalar_type(), " with ",
              output.numel() * getSize(), " elements (group size ", getSize(),
              " x output ", output.sizes(), "), got ", input.scalar_type(), " ",
              input.sizes());
  auto info = callInfo(Collective::kReduceScatter, output,
                       checkedReduceOp(opts.reduceOp, dt, "reduce_scatter_tensor"));
  if (hierarchical()) {
    return enqueue(
        c10d::OpType::_REDUCE_SCATTER_BASE, nullptr, {output},
        [this, input, output, op = opts.reduceOp] {
          hierarchicalReduceScatter(input.reshape({getSize(), -1}).unbind(0), output, op);
        },
        blocking(opts));
  }
  return enqueue(
      c10d::OpType::_REDUCE_SCATTER_BASE, nullptr, {output},
      [this, input, output, info] {
        Staged src(input);
        Staged dst(output);
        std::vector<const void*> ptrs;
        for (int r = 0; r < getSize(); ++r) {
          ptrs.push_back(static_cast<const char*>(src.ptr()) + r * dst.bytes());
        }
        comm_->reduceScatter(ptrs.data(), dst.ptr(), dst.count(), info);
        dst.copyBack();
      },
      blocking(opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::reduceScatterFromList(
    std::vector<at::Tensor> inputs, at::Tensor output, c10d::ReduceOp op) {
  TORCH_CHECK(!multiHost() && output.device().is_cpu(),
              "dsp reduce_scatter from a list: one host and CPU tensors only");
  const auto dt = checkedDType(output, "reduce_scatter");
  int64_t total = 0;
  for (const auto& t : inputs) {
    TORCH_CHECK(t.scalar_type() == output.scalar_type() && t.is_contiguous() &&
                    t.device().is_cpu(),
                "dsp reduce_scatter from a list: inputs must be contiguous CPU ",
                output.scalar_type(), " tensors, got ", t.scalar_type(), " ", t.sizes());
    total += t.numel();
  }
  TORCH_CHECK(output.is_contiguous() && total == output.numel() * getSize(),
              "dsp reduce_scatter from a list: the inputs hold ", total,
              " elements, expected group size ", getSize(), " x ", output.numel());
  auto info = callInfo(Collective::kReduceScatter, output,
                       checkedReduceOp(op, dt, "reduce_scatter"));
  return enqueue(
      c10d::OpType::_REDUCE_SCATTER_BASE, nullptr, {output},
      [this, inputs = std::move(inputs), output, info] {
        std::vector<void*> ptrs;
        std::vector<size_t> counts;
        for (const auto& t : inputs) {
          ptrs.push_back(t.data_ptr());
          counts.push_back(static_cast<size_t>(t.numel()));
        }
        comm_->reduceScatter(
            dsp::BufferList(std::move(ptrs), std::move(counts), output.element_size()),
            output.data_ptr(), static_cast<size_t>(output.numel()), info);
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (auto* b = route(inputs, "reduce_scatter_tensor_coalesced",
                      /*across_hosts=*/!hierarchical())) {
    return b->reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  }
  TORCH_CHECK(outputs.size() == inputs.size() && !inputs.empty(),
              "dsp reduce_scatter_tensor_coalesced: ", outputs.size(), " outputs for ",
              inputs.size(), " inputs");
  // OpType::REDUCE_SCATTER_TENSOR_COALESCED is newer than torch 2.11.
  return coalesced(c10d::OpType::COALESCED, "reduce_scatter_tensor_coalesced", outputs,
                   inputs,
                   [&](size_t i) { _reduce_scatter_base(outputs[i], inputs[i], opts); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::coalesced(
    c10d::OpType type, const char* what, const std::vector<at::Tensor>& outputs,
    const std::vector<at::Tensor>& inputs, const std::function<void(size_t)>& member) {
  // Every member must be served here: one on another device would be handed
  // to another engine and escape the batch.
  for (const auto& t : inputs) {
    TORCH_CHECK(t.device() == inputs[0].device(), "dsp ", what,
                ": all tensors must be on one device, got ", inputs[0].device(), " and ",
                t.device());
  }
  // Each member is checked here (raising before anything is queued) and its
  // closure collected instead of queued.
  std::vector<std::function<void()>> runs;
  {
    BatchScope batch(&runs);
    for (size_t i = 0; i < inputs.size(); ++i) member(i);
  }
  return enqueue(type, nullptr, outputs, [runs = std::move(runs), what] {
    // Every member runs even after one fails: a mismatch raises on every
    // rank and leaves the ranks in step, so the next member is still sound
    // (and a broken group fails it at once). The first error is the call's.
    std::exception_ptr first;
    size_t failed = 0;
    for (size_t i = 0; i < runs.size(); ++i) {
      try {
        runs[i]();
      } catch (...) {
        if (!first) {
          first = std::current_exception();
          failed = i;
        }
      }
    }
    if (!first) return;
    try {
      std::rethrow_exception(first);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "dsp ", what, ": tensor ", failed, " of ", runs.size(), ": ",
                  e.what());
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts) {
  if (auto* b = route(input, "all_to_all_single")) {
    return b->alltoall_base(output, input, output_split_sizes, input_split_sizes, opts);
  }
  const auto dt = checkedDType(input, "all_to_all");
  checkedDType(output, "all_to_all");
  TORCH_CHECK(input.scalar_type() == output.scalar_type(), "dsp all_to_all: input is ",
              input.scalar_type(), " but output is ", output.scalar_type());
  std::vector<size_t> sb, so, rb, ro;
  splitBytes(input, input_split_sizes, getSize(), "input", sb, so);
  splitBytes(output, output_split_sizes, getSize(), "output", rb, ro);
  dsp::CallInfo info;
  info.kind = Collective::kAllToAll;
  info.dtype = dt;
  return enqueue(
      c10d::OpType::ALLTOALL_BASE, nullptr, {output},
      [this, input, output, sb, so, rb, ro, info] {
        Staged src(input);
        Staged dst(output);
        std::vector<const void*> ins;
        std::vector<void*> outs;
        for (int r = 0; r < getSize(); ++r) {
          ins.push_back(static_cast<const char*>(src.ptr()) + so[r]);
          outs.push_back(static_cast<char*>(dst.ptr()) + ro[r]);
        }
        comm_->allToAll(ins.data(), sb.data(), outs.data(), rb.data(), info);
        dst.copyBack();
      },
      blocking(opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::alltoall(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  if (auto* b = route(inputs, "all_to_all")) return b->alltoall(outputs, inputs, opts);
  checkListSize(inputs.size(), getSize(), "all_to_all", "the input list");
  checkListSize(outputs.size(), getSize(), "all_to_all", "the output list");
  TORCH_CHECK(!inputs.empty());
  dsp::CallInfo info;
  info.kind = Collective::kAllToAll;
  info.dtype = checkedDType(inputs[0], "all_to_all");
  for (const auto& t : inputs) {
    TORCH_CHECK(checkedDType(t, "all_to_all") == info.dtype,
                "dsp all_to_all: all tensors must share one dtype");
  }
  for (const auto& t : outputs) {
    TORCH_CHECK(checkedDType(t, "all_to_all") == info.dtype,
                "dsp all_to_all: all tensors must share one dtype");
  }
  return enqueue(
      c10d::OpType::ALLTOALL, nullptr, outputs,
      [this, inputs, outputs, info] {
        auto src = stageAll(inputs);
        auto dst = stageAll(outputs);
        std::vector<const void*> ins;
        std::vector<size_t> sb, rb;
        for (auto& s : src) {
          ins.push_back(s.ptr());
          sb.push_back(s.bytes());
        }
        for (auto& d : dst) rb.push_back(d.bytes());
        auto outs = pointers(dst);
        comm_->allToAll(ins.data(), sb.data(), outs.data(), rb.data(), info);
        for (auto& d : dst) d.copyBack();
      },
      blocking(opts));
}

void ProcessGroupDSP::monitoredBarrier(const c10d::BarrierOptions& opts,
                                       bool wait_all_ranks) {
  // gloo's monitored barrier (which names the ranks that did not arrive),
  // after the work already queued here, like any collective of this group.
  auto work = enqueue(c10d::OpType::BARRIER, nullptr, {}, [this, opts, wait_all_ranks] {
    flat("monitored_barrier").monitoredBarrier(opts, wait_all_ranks);
  });
  work->wait();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::barrier(
    const c10d::BarrierOptions& opts) {
  if (multiHost()) {
    // Queued like any collective, so that it waits for the work already
    // queued on this group before gloo's barrier runs.
    return enqueue(
        c10d::OpType::BARRIER, nullptr, {},
        [this, opts] { flat("barrier").barrier(opts)->wait(); }, blocking(opts));
  }
  return enqueue(
      c10d::OpType::BARRIER, nullptr, {}, [this] { comm_->barrier(); }, blocking(opts));
}

}  // namespace dsparallel
