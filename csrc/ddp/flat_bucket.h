// A flat buffer that holds several tensors back to back, so that one
// collective moves them all. Shared by the DDP reducer and the
// fused_all_reduce op.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace dsparallel {

struct FlatBucket {
  std::vector<size_t> members;  // indices into the caller's tensor list
  std::vector<int64_t> offsets;
  std::vector<int64_t> lengths;
  at::Tensor flat;

  // A buffer for tensors[members], with their dtype and device (all members
  // must share them). Zeroed unless the caller packs every member anyway.
  static FlatBucket make(const std::vector<at::Tensor>& tensors,
                         std::vector<size_t> members, bool zeroed = true);

  // The slice of member k, shaped like `like`.
  at::Tensor view(size_t k, const at::Tensor& like) const;
  void pack(const std::vector<at::Tensor>& tensors);
  void unpack(const std::vector<at::Tensor>& tensors) const;
};

// Groups tensors for bucketing: one group per (dtype, device).
int64_t bucketGroupOf(const at::Tensor& t);

}  // namespace dsparallel
