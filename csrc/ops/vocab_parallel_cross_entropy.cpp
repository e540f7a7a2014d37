// Cross-entropy over logits whose vocabulary dimension is split across a
// tensor-parallel group, without ever gathering the logits:
//   max over the vocab (all-reduce MAX), then one all-reduce SUM of the
//   target logit, the sum of exponentials and a hit count per token.
// The softmax is kept for backward, which is local:
//   d loss / d logits = g * (softmax - onehot(target)).
// Rank r's vocabulary slice starts at the sum of the lower ranks' slice sizes
// (gathered once per call), so uneven splits work.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "ops/group_collectives.h"

namespace dsparallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kOp = "vocab_parallel_cross_entropy";

// Returns (per-token loss in the logits' dtype, softmax in float32 with the
// ignored rows zeroed, this rank's local target index or -1). Half-precision
// logits are computed in float32; float64 logits stay float64, so that a
// float64 run matches its one-process self to rounding.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forwardKernel(
    const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
    c10::string_view group_name) {
  const GroupRef g = resolveGroup(group_name, kOp);
  TORCH_CHECK(logits.dim() >= 1, kOp, ": logits need a vocabulary dimension");
  TORCH_CHECK(at::isFloatingType(logits.scalar_type()), kOp,
              ": logits must be floating point, got ", logits.scalar_type());
  TORCH_CHECK(
      !at::isFloatingType(target.scalar_type()) && target.scalar_type() != at::kBool, kOp,
      ": target must hold class indices (an integer tensor), got ", target.scalar_type());
  TORCH_CHECK(target.sizes() == logits.sizes().slice(0, logits.dim() - 1), kOp,
              ": target shape ", target.sizes(), " does not match logits shape ",
              logits.sizes(), " without its last (vocabulary) dimension");
  const int64_t local_vocab = logits.size(-1);

  // Where this rank's slice starts, and the whole vocabulary size.
  at::Tensor sizes =
      allGatherAlong(g, at::full({1}, local_vocab, logits.options().dtype(at::kLong)), 0)
          .cpu();
  const int64_t* s = sizes.data_ptr<int64_t>();
  int64_t start = 0, vocab = 0;
  for (int64_t r = 0; r < g.size; ++r) {
    if (r < g.rank) start += s[r];
    vocab += s[r];
  }

  at::Tensor x =
      logits.to(logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  at::Tensor max = std::get<0>(x.max(-1));
  max = allReduce(g, max, c10d::ReduceOp::MAX);
  at::Tensor shifted = x - max.unsqueeze(-1);

  at::Tensor tgt = target.to(at::kLong);
  at::Tensor valid = tgt != ignore_index;
  at::Tensor local = tgt - start;
  at::Tensor here = valid & (local >= 0) & (local < local_vocab);
  local = at::where(here, local, -1);

  // One all-reduce carries the target logit, the exp-sum and the hit count.
  at::Tensor stats = at::empty({3, max.numel()}, shifted.options());
  at::Tensor picked = shifted.gather(-1, local.clamp_min(0).unsqueeze(-1)).squeeze(-1);
  stats[0].copy_((picked * here).reshape(-1));
  at::Tensor exps = shifted.exp_();
  stats[1].copy_(exps.sum(-1).reshape(-1));
  stats[2].copy_(here.reshape(-1));
  stats = allReduce(g, stats);

  at::Tensor hits = stats[2].view(max.sizes());
  TORCH_CHECK(hits.eq(valid).all().item<bool>(), kOp,
              ": a target index is outside the vocabulary [0, ", vocab,
              ") (and is not ignore_index=", ignore_index, ")");
  at::Tensor sum_exp = stats[1].view(max.sizes());
  at::Tensor loss = (sum_exp.log() - stats[0].view(max.sizes())) * valid;
  at::Tensor softmax = exps.div_(sum_exp.unsqueeze(-1)).mul_(valid.unsqueeze(-1));
  return {loss.to(logits.scalar_type()), softmax, local};
}

at::Tensor lossKernel(const at::Tensor& logits, const at::Tensor& target,
                      int64_t ignore_index, c10::string_view group_name) {
  return std::get<0>(forwardKernel(logits, target, ignore_index, group_name));
}

class CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& target, int64_t ignore_index,
                            std::string group_name) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("dsparallel::_vocab_parallel_cross_entropy_forward", "")
            .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                const at::Tensor&, const at::Tensor&, int64_t, c10::string_view)>();
    at::AutoDispatchBelowADInplaceOrView below;
    auto [loss, softmax, local] = op.call(logits, target, ignore_index, group_name);
    ctx->save_for_backward({softmax, local});
    ctx->saved_data["dtype"] = logits.scalar_type();
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& softmax = saved[0];
    const at::Tensor& local = saved[1];
    const at::Tensor g = grads[0].to(softmax.scalar_type()).unsqueeze(-1);
    // softmax - onehot(local), with rows whose target lives elsewhere (or is
    // ignored) getting no -1.
    at::Tensor onehot = at::zeros_like(softmax).scatter_(
        -1, local.clamp_min(0).unsqueeze(-1),
        (local >= 0).unsqueeze(-1).to(softmax.scalar_type()));
    at::Tensor grad = (softmax - onehot) * g;
    return {grad.to(ctx->saved_data["dtype"].toScalarType()), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor lossAutograd(const at::Tensor& logits, const at::Tensor& target,
                        int64_t ignore_index, c10::string_view group_name) {
  return CrossEntropyFunction::apply(logits, target, ignore_index,
                                     std::string(group_name));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsparallel, m) {
  m.def(
      "vocab_parallel_cross_entropy(Tensor logits, Tensor target, int ignore_index, str "
      "group_name) -> Tensor");
  m.def(
      "_vocab_parallel_cross_entropy_forward(Tensor logits, Tensor target, int "
      "ignore_index, str group_name) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dsparallel, CompositeExplicitAutograd, m) {
  m.impl("vocab_parallel_cross_entropy", &lossKernel);
  m.impl("_vocab_parallel_cross_entropy_forward", &forwardKernel);
}

TORCH_LIBRARY_IMPL(dsparallel, Autograd, m) {
  m.impl("vocab_parallel_cross_entropy", &lossAutograd);
}

}  // namespace dsparallel
