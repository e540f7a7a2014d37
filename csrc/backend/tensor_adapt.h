// Adapting at::Tensor and c10d options to the torch-free core: dtype and op
// mapping with the checks that must fail before anything is sent, and the
// staging of non-contiguous tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <torch/csrc/distributed/c10d/Types.hpp>
#include <vector>

#include "core/shm/comm.h"

namespace dsparallel {

// Raises (TORCH_CHECK) on a tensor the backend cannot move: not on the CPU,
// sparse, or of an unsupported dtype. `what` names the collective.
dsp::DType checkedDType(const at::Tensor& t, const char* what);

// Maps a c10d reduce op, raising for ops or (dtype, op) pairs we refuse.
dsp::ReduceOp checkedReduceOp(const c10d::ReduceOp& op, dsp::DType dtype,
                              const char* what);

// The one tensor of a call that takes one per rank (raises otherwise).
const at::Tensor& single(const std::vector<at::Tensor>& ts, const char* what);

// All tensors must share dtype and element count with `ref` (the list forms
// of all_gather, scatter, ...).
void checkSameAs(const at::TensorList tensors, const at::Tensor& ref, const char* what);

dsp::CallInfo callInfo(dsp::Collective kind, const at::Tensor& t,
                       dsp::ReduceOp op = dsp::ReduceOp::kSum, int root = -1);

// A contiguous tensor to hand to the core and, for outputs, the copy back
// into a non-contiguous original once the collective is done.
class Staged {
 public:
  explicit Staged(const at::Tensor& t) : original_(t), data_(t.contiguous()) {}
  void* ptr() const { return data_.data_ptr(); }
  size_t bytes() const { return data_.nbytes(); }
  size_t count() const { return static_cast<size_t>(data_.numel()); }
  const at::Tensor& tensor() const { return data_; }
  void copyBack() {
    if (!data_.is_same(original_)) original_.copy_(data_);
  }

 private:
  at::Tensor original_;
  at::Tensor data_;
};

std::vector<Staged> stageAll(const std::vector<at::Tensor>& ts);

}  // namespace dsparallel
