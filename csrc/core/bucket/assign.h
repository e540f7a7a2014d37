// Bucket assignment for the fused gradient all-reduce: which tensors share a
// flat buffer. Plain C++17, no torch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dsp {

struct BucketTensor {
  size_t bytes;   // size of the tensor's data
  int64_t group;  // tensors only share a bucket within a group (dtype x device)
};

// Fills buckets in the sequence `order` (every tensor index exactly once):
// each group has its own open bucket; a tensor is added whole (never split)
// and a bucket closes once it holds at least its cap. The k-th bucket of a
// group has cap caps[min(k, caps.size() - 1)], so {1 MiB, 25 MiB} gives
// torch DDP's small first bucket. Buckets come out in the order in which
// their first tensor appears in `order` (the order they are launched in);
// within a bucket, tensors keep their `order` sequence.
std::vector<std::vector<size_t>> assignBuckets(const std::vector<BucketTensor>& tensors,
                                               const std::vector<size_t>& order,
                                               const std::vector<size_t>& caps);

// The same for the common case: order = reverse of registration.
std::vector<size_t> reverseOrder(size_t n);

}  // namespace dsp
