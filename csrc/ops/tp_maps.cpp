// The tensor-parallel region maps as ops under torch.ops.dsparallel, each a
// C++ autograd Function whose backward is another map:
//
//   map                                         forward          backward
//   copy_to_tensor_parallel_region              identity         all-reduce
//   reduce_from_tensor_parallel_region          all-reduce       identity
//   scatter_to_tensor_parallel_region           split last dim   all-gather last dim
//   gather_from_tensor_parallel_region          all-gather last  split last dim
//   scatter_to_sequence_parallel_region         split dim 0      all-gather dim 0
//   gather_from_sequence_parallel_region        all-gather dim 0 reduce-scatter dim 0
//   reduce_scatter_to_sequence_parallel_region  reduce-scatter 0 all-gather dim 0
//
// Backwards call the maps through the dispatcher, so they are differentiable
// again and traceable. The group is named by string and resolved here, as in
// torch's functional collectives.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>

#include "ops/group_collectives.h"

namespace dsparallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

enum Map : int64_t {
  kCopy,
  kReduce,
  kScatter,
  kGather,
  kSpScatter,
  kSpGather,
  kSpReduceScatter,
  kNumMaps,
  kIdentity = kNumMaps,
};

constexpr std::array<const char*, kNumMaps> kNames = {
    "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region",
    "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
};

constexpr std::array<Map, kNumMaps> kBackward = {
    kReduce, kIdentity, kGather, kScatter, kSpGather, kSpReduceScatter, kSpGather,
};

at::Tensor runMap(Map m, const at::Tensor& x, c10::string_view group_name) {
  const char* name = kNames[m];
  const GroupRef g = resolveGroup(group_name, name);
  switch (m) {
    case kCopy:
      return x.clone(at::MemoryFormat::Contiguous);
    case kReduce:
      return allReduce(g, x);
    case kScatter:
      return splitAlong(g, x, x.dim() - 1, name);
    case kGather:
      TORCH_CHECK(x.dim() >= 1, name, ": needs a tensor with at least one dimension");
      return allGatherAlong(g, x, x.dim() - 1);
    case kSpScatter:
      return splitAlong(g, x, 0, name);
    case kSpGather:
      TORCH_CHECK(x.dim() >= 1, name, ": needs a tensor with at least one dimension");
      return allGatherAlong(g, x, 0);
    case kSpReduceScatter:
      return reduceScatterDim0(g, x);
    default:
      TORCH_CHECK(false, "unknown tensor-parallel map ", static_cast<int64_t>(m));
  }
}

template <Map M>
at::Tensor mapKernel(const at::Tensor& x, c10::string_view group_name) {
  return runMap(M, x, group_name);
}

// Calls a map through the dispatcher (autograd included when enabled).
at::Tensor callMap(Map m, const at::Tensor& x, const std::string& group_name) {
  using Sig = at::Tensor(const at::Tensor&, c10::string_view);
  static const auto handles = [] {
    std::vector<c10::TypedOperatorHandle<Sig>> h;
    for (const char* name : kNames) {
      h.push_back(c10::Dispatcher::singleton()
                      .findSchemaOrThrow((std::string("dsparallel::") + name).c_str(), "")
                      .typed<Sig>());
    }
    return h;
  }();
  return handles[m].call(x, group_name);
}

class MapFunction : public torch::autograd::Function<MapFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t map,
                            std::string group_name) {
    ctx->saved_data["map"] = map;
    ctx->saved_data["group"] = group_name;
    at::AutoDispatchBelowADInplaceOrView below;
    return callMap(static_cast<Map>(map), x, group_name);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto map = static_cast<Map>(ctx->saved_data["map"].toInt());
    const std::string group = ctx->saved_data["group"].toStringRef();
    const Map back = kBackward[map];
    at::Tensor g = grads[0];
    if (back != kIdentity && g.defined()) g = callMap(back, g, group);
    return {g, at::Tensor(), at::Tensor()};
  }
};

template <Map M>
at::Tensor mapAutograd(const at::Tensor& x, c10::string_view group_name) {
  return MapFunction::apply(x, static_cast<int64_t>(M), std::string(group_name));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsparallel, m) {
  for (const char* name : kNames) {
    m.def((std::string(name) + "(Tensor x, str group_name) -> Tensor").c_str());
  }
}

TORCH_LIBRARY_IMPL(dsparallel, CompositeExplicitAutograd, m) {
  m.impl(kNames[kCopy], &mapKernel<kCopy>);
  m.impl(kNames[kReduce], &mapKernel<kReduce>);
  m.impl(kNames[kScatter], &mapKernel<kScatter>);
  m.impl(kNames[kGather], &mapKernel<kGather>);
  m.impl(kNames[kSpScatter], &mapKernel<kSpScatter>);
  m.impl(kNames[kSpGather], &mapKernel<kSpGather>);
  m.impl(kNames[kSpReduceScatter], &mapKernel<kSpReduceScatter>);
}

TORCH_LIBRARY_IMPL(dsparallel, Autograd, m) {
  m.impl(kNames[kCopy], &mapAutograd<kCopy>);
  m.impl(kNames[kReduce], &mapAutograd<kReduce>);
  m.impl(kNames[kScatter], &mapAutograd<kScatter>);
  m.impl(kNames[kGather], &mapAutograd<kGather>);
  m.impl(kNames[kSpScatter], &mapAutograd<kSpScatter>);
  m.impl(kNames[kSpGather], &mapAutograd<kSpGather>);
  m.impl(kNames[kSpReduceScatter], &mapAutograd<kSpReduceScatter>);
}

}  // namespace dsparallel
