#include "flat_bucket.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace dsparallel {

FlatBucket FlatBucket::make(const std::vector<at::Tensor>& tensors,
                            std::vector<size_t> members, bool zeroed) {
  TORCH_INTERNAL_ASSERT(!members.empty(), "empty bucket");
  FlatBucket b;
  b.members = std::move(members);
  int64_t total = 0;
  const at::Tensor& first = tensors[b.members.front()];
  for (size_t idx : b.members) {
    const at::Tensor& t = tensors[idx];
    TORCH_INTERNAL_ASSERT(
        t.scalar_type() == first.scalar_type() && t.device() == first.device(),
        "a bucket mixes dtypes or devices");
    b.offsets.push_back(total);
    b.lengths.push_back(t.numel());
    total += t.numel();
  }
  const auto options = first.options().requires_grad(false);
  b.flat = zeroed ? at::zeros({total}, options) : at::empty({total}, options);
  return b;
}

at::Tensor FlatBucket::view(size_t k, const at::Tensor& like) const {
  return flat.narrow(0, offsets[k], lengths[k]).view(like.sizes());
}

// One _foreach_copy_ per direction: on a GPU it copies up to a hundred-odd
// tensors per kernel launch, where a copy_ per tensor pays a launch each
// (benchmarks/gpu.py packs 200 tensors).
void FlatBucket::pack(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> views, sources;
  views.reserve(members.size());
  sources.reserve(members.size());
  for (size_t k = 0; k < members.size(); ++k) {
    sources.push_back(tensors[members[k]]);
    views.push_back(view(k, sources.back()));
  }
  at::_foreach_copy_(views, sources);
}

void FlatBucket::unpack(const std::vector<at::Tensor>& tensors) const {
  std::vector<at::Tensor> views, targets;
  views.reserve(members.size());
  targets.reserve(members.size());
  for (size_t k = 0; k < members.size(); ++k) {
    targets.push_back(tensors[members[k]]);
    views.push_back(view(k, targets.back()));
  }
  at::_foreach_copy_(targets, views);
}

int64_t bucketGroupOf(const at::Tensor& t) {
  // dtype in the low bits, device type and index above: distinct per pair.
  return static_cast<int64_t>(t.scalar_type()) |
         (static_cast<int64_t>(t.device().type()) << 8) |
         (static_cast<int64_t>(t.device().index() + 1) << 16);
}

}  // namespace dsparallel
