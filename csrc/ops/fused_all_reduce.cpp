// torch.ops.dsparallel.fused_all_reduce: in-place all-reduce of a list of
// tensors (mixed dtypes and devices allowed) packed into as few flat buckets
// as fit under the cap, one collective per bucket, all launched before any
// is waited on.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include "core/bucket/assign.h"
#include "ddp/flat_bucket.h"

namespace dsparallel {
namespace {

void fusedAllReduce(at::TensorList tensor_list, c10::string_view op,
                    c10::string_view group_name, int64_t bucket_cap_bytes) {
  TORCH_CHECK(op == "sum" || op == "avg",
              "fused_all_reduce: op must be \"sum\" or \"avg\", got \"", op, "\"");
  TORCH_CHECK(bucket_cap_bytes > 0,
              "fused_all_reduce: bucket_cap_bytes must be positive, got ",
              bucket_cap_bytes);
  std::vector<at::Tensor> tensors(tensor_list.begin(), tensor_list.end());
  if (tensors.empty()) return;
  const bool avg = op == "avg";
  for (const auto& t : tensors) {
    TORCH_CHECK(t.layout() == c10::kStrided,
                "fused_all_reduce: sparse tensors are not supported");
    TORCH_CHECK(!avg || at::isFloatingType(t.scalar_type()),
                "fused_all_reduce: op \"avg\" needs floating-point tensors, got ",
                t.scalar_type());
  }
  auto group = c10d::resolve_process_group(std::string(group_name));
  std::vector<dsp::BucketTensor> sizes;
  for (const auto& t : tensors) sizes.push_back({t.nbytes(), bucketGroupOf(t)});
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  const auto assignment =
      dsp::assignBuckets(sizes, order, {static_cast<size_t>(bucket_cap_bytes)});

  std::vector<FlatBucket> buckets;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (const auto& members : assignment) {
    buckets.push_back(FlatBucket::make(tensors, members, /*zeroed=*/false));
    FlatBucket& b = buckets.back();
    b.pack(tensors);
    if (avg) b.flat.div_(group->getSize());
    std::vector<at::Tensor> t = {b.flat};
    works.push_back(group->allreduce(t));
  }
  for (size_t i = 0; i < buckets.size(); ++i) {
    works[i]->wait();
    buckets[i].unpack(tensors);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsparallel, m) {
  m.def(
      "fused_all_reduce(Tensor(a!)[] tensors, str op, str group_name, int "
      "bucket_cap_bytes) -> ()");
}

TORCH_LIBRARY_IMPL(dsparallel, CompositeExplicitAutograd, m) {
  m.impl("fused_all_reduce", &fusedAllReduce);
}

}  // namespace dsparallel
