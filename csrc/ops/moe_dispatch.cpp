// Mixture-of-experts token dispatch and combine over an expert-parallel
// group, as ops under torch.ops.dsparallel:
//
//   moe_plan(expert_idx, num_experts, group)  -> (order, send_counts, recv_counts)
//       counting-sorts the (token, slot) assignments by expert (index -1 =
//       dropped) and exchanges the per-expert counts with one all-to-all;
//   moe_dispatch(x, order, send_counts, recv_counts, top_k, group) -> rows
//       gathers each assignment's token row and moves them with one uneven
//       all-to-all; the rows arrive as they were sent: by source rank, and
//       within a source by local expert (recv_counts[s, e] rows each). The
//       experts run on those chunks where they lie: regrouping them expert-
//       major (as Megatron does) would cost a copy of every row each way, in
//       forward and in backward; backward is the reverse all-to-all;
//   moe_combine(y, weights, order, send_counts, recv_counts, group) -> out
//       the reverse all-to-all of the expert outputs, then out[t] =
//       sum_j weights[t, j] * y[(t, j)] as one scatter-add (dropped slots
//       add nothing);
//       backward gives the gradients of y and of the weights.
//
// Experts are contiguous: global expert e lives on group rank e / L with
// L = num_experts / group size. send_counts[r, e] is how many rows this rank
// sends to rank r's local expert e, recv_counts[s, e] how many it receives
// from rank s for its own local expert e: each rank's recv_counts is the
// transpose of its peers' send_counts by construction, which an
// all_to_all_single with hand-made splits does not check (pytorch#32361).
// Backwards call ops through the dispatcher, so that they trace.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <vector>

#include "ops/group_collectives.h"

namespace dsparallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::vector<int64_t> rowSums(const at::Tensor& counts) {
  at::Tensor c = counts.to(at::kLong).contiguous();
  const int64_t rows = c.size(0), cols = c.size(1);
  const int64_t* p = c.data_ptr<int64_t>();
  std::vector<int64_t> out(rows, 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = 0; e < cols; ++e) out[r] += p[r * cols + e];
  return out;
}

at::Tensor allToAll(const GroupRef& g, const at::Tensor& rows,
                    std::vector<int64_t> out_splits, std::vector<int64_t> in_splits) {
  int64_t n = 0;
  for (auto s : out_splits) n += s;
  // Internal rows only (never an op's input), so a group of one may return them.
  if (g.size == 1) return rows.contiguous();
  at::Tensor out = at::empty({n, rows.size(1)}, rows.options());
  at::Tensor in = rows.contiguous();
  g.pg->alltoall_base(out, in, out_splits, in_splits)->wait();
  return out;
}

void checkPlan(const GroupRef& g, const at::Tensor& send_counts,
               const at::Tensor& recv_counts, const char* op) {
  for (const at::Tensor* t : {&send_counts, &recv_counts}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == g.size && !t->is_floating_point(), op,
                ": the counts must be integer [group size = ", g.size,
                ", local experts] tensors from moe_plan, got ", t->scalar_type(),
                t->sizes());
  }
}

// Token rows in assignment order -> the experts' ranks (by source, then expert).
at::Tensor sendToExperts(const GroupRef& g, const at::Tensor& rows,
                         const at::Tensor& send_counts, const at::Tensor& recv_counts) {
  return allToAll(g, rows, rowSums(recv_counts), rowSums(send_counts));
}

// The inverse: the experts' rows -> rows in this rank's assignment order.
at::Tensor returnFromExperts(const GroupRef& g, const at::Tensor& rows,
                             const at::Tensor& send_counts,
                             const at::Tensor& recv_counts) {
  return allToAll(g, rows, rowSums(send_counts), rowSums(recv_counts));
}

// ---------------------------------------------------------------- kernels

std::tuple<at::Tensor, at::Tensor, at::Tensor> planKernel(const at::Tensor& expert_idx,
                                                          int64_t num_experts,
                                                          c10::string_view group_name) {
  constexpr const char* op = "moe_plan";
  const GroupRef g = resolveGroup(group_name, op);
  TORCH_CHECK(expert_idx.dim() == 2 && !expert_idx.is_floating_point(), op,
              ": expert_idx must be an integer [tokens, top_k] tensor, got ",
              expert_idx.scalar_type(), expert_idx.sizes());
  TORCH_CHECK(num_experts > 0 && num_experts % g.size == 0, op, ": num_experts (",
              num_experts, ") must be a positive multiple of the expert-parallel size (",
              g.size, ")");
  const int64_t local = num_experts / g.size;
  at::Tensor idx = expert_idx.to(at::kCPU, at::kLong).contiguous();
  const int64_t n = idx.numel();
  const int64_t* e = idx.data_ptr<int64_t>();

  // Counts per expert, plus a last column that tells every peer whether
  // this rank's indices were valid, so that bad input raises on all ranks
  // (after the one exchange) instead of leaving the others in it.
  at::Tensor send = at::zeros({g.size, local + 1}, at::kLong);
  int64_t* cnt = send.data_ptr<int64_t>();
  auto slot = [&](int64_t expert) {
    return (expert / local) * (local + 1) + expert % local;
  };
  int64_t bad = -2, kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (e[i] == -1) continue;
    if (e[i] < -1 || e[i] >= num_experts) {
      if (bad == -2) bad = e[i];
      continue;
    }
    ++cnt[slot(e[i])];
    ++kept;
  }
  if (bad != -2)
    for (int64_t r = 0; r < g.size; ++r) cnt[r * (local + 1) + local] = 1;

  // A group of one receives what it sends (a copy: the op's two count
  // outputs must not alias).
  at::Tensor recv = g.size > 1 ? at::empty_like(send) : send.clone();
  if (g.size > 1) {
    std::vector<int64_t> equal;  // empty splits: the same share to every rank
    g.pg->alltoall_base(recv, send, equal, equal)->wait();
  }
  const int64_t* flags = recv.data_ptr<int64_t>();
  for (int64_t r = 0; r < g.size; ++r) {
    TORCH_CHECK(
        flags[r * (local + 1) + local] == 0, op, ": rank ", r,
        " of the expert-parallel group passed an expert index ",
        r == g.rank ? std::to_string(bad) : std::string("(see that rank's error)"),
        " outside [-1, ", num_experts, ") (-1 marks a dropped assignment)");
  }

  // Stable counting sort of the assignments by expert.
  std::vector<int64_t> next(num_experts, 0);
  for (int64_t x = 0, sum = 0; x < num_experts; ++x) {
    next[x] = sum;
    sum += cnt[slot(x)];
  }
  at::Tensor order = at::empty({kept}, at::kLong);
  int64_t* o = order.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    if (e[i] >= 0) o[next[e[i]]++] = i;

  using at::indexing::Slice;
  return {order.to(expert_idx.device()),
          send.index({Slice(), Slice(0, local)}).contiguous(),
          recv.index({Slice(), Slice(0, local)}).contiguous()};
}

at::Tensor checkedRows(const at::Tensor& x, const at::Tensor& order, int64_t top_k,
                       const char* op) {
  TORCH_CHECK(x.dim() == 2, op, ": expects [tokens, hidden] rows, got ", x.sizes());
  TORCH_CHECK(top_k >= 1, op, ": top_k must be positive, got ", top_k);
  TORCH_CHECK(order.dim() == 1 && !order.is_floating_point(), op,
              ": order must be the 1-D integer tensor from moe_plan");
  return order.div(top_k, "floor");
}

at::Tensor dispatchKernel(const at::Tensor& x, const at::Tensor& order,
                          const at::Tensor& send_counts, const at::Tensor& recv_counts,
                          int64_t top_k, c10::string_view group_name) {
  constexpr const char* op = "moe_dispatch";
  const GroupRef g = resolveGroup(group_name, op);
  checkPlan(g, send_counts, recv_counts, op);
  at::Tensor token = checkedRows(x, order, top_k, op);
  return sendToExperts(g, x.index_select(0, token), send_counts, recv_counts);
}

at::Tensor dispatchBackwardKernel(const at::Tensor& grad, const at::Tensor& order,
                                  const at::Tensor& send_counts,
                                  const at::Tensor& recv_counts, int64_t top_k,
                                  c10::SymInt num_tokens, c10::string_view group_name) {
  constexpr const char* op = "moe_dispatch_backward";
  const GroupRef g = resolveGroup(group_name, op);
  at::Tensor back = returnFromExperts(g, grad, send_counts, recv_counts);
  at::Tensor gx = at::zeros({num_tokens.expect_int(), grad.size(1)}, grad.options());
  return gx.index_add_(0, order.div(top_k, "floor"), back);
}

// The gate of each kept assignment, in the plan's (expert-sorted) order.
at::Tensor sortedGates(const at::Tensor& weights, const at::Tensor& order) {
  return weights.reshape(-1).index_select(0, order).unsqueeze(1);
}

// Returns the combined tokens and the rows that came back (in the plan's
// order), which backward needs for the gates' gradient.
std::tuple<at::Tensor, at::Tensor> combineForwardKernel(const at::Tensor& y,
                                                        const at::Tensor& weights,
                                                        const at::Tensor& order,
                                                        const at::Tensor& send_counts,
                                                        const at::Tensor& recv_counts,
                                                        c10::string_view group_name) {
  constexpr const char* op = "moe_combine";
  const GroupRef g = resolveGroup(group_name, op);
  checkPlan(g, send_counts, recv_counts, op);
  TORCH_CHECK(y.dim() == 2, op, ": expects [rows, hidden] expert outputs, got ",
              y.sizes());
  TORCH_CHECK(weights.dim() == 2, op, ": weights must be [tokens, top_k], got ",
              weights.sizes());
  TORCH_CHECK(weights.scalar_type() == y.scalar_type(), op, ": weights (",
              weights.scalar_type(), ") and expert outputs (", y.scalar_type(),
              ") must have one dtype");
  at::Tensor back = returnFromExperts(g, y, send_counts, recv_counts);
  TORCH_CHECK(order.numel() == back.size(0), op, ": the plan has ", order.numel(),
              " assignments but ", back.size(0), " rows came back");
  // out[t] = sum over t's kept slots of gate * row, as one scatter-add
  // (dropped slots add nothing).
  at::Tensor token = order.div(weights.size(1), "floor");
  at::Tensor out = at::zeros({weights.size(0), y.size(1)}, y.options());
  out.index_add_(0, token, back * sortedGates(weights, order));
  return {out, back};
}

at::Tensor combineKernel(const at::Tensor& y, const at::Tensor& weights,
                         const at::Tensor& order, const at::Tensor& send_counts,
                         const at::Tensor& recv_counts, c10::string_view group_name) {
  return std::get<0>(
      combineForwardKernel(y, weights, order, send_counts, recv_counts, group_name));
}

std::tuple<at::Tensor, at::Tensor> combineBackwardKernel(
    const at::Tensor& grad, const at::Tensor& back, const at::Tensor& weights,
    const at::Tensor& order, const at::Tensor& send_counts, const at::Tensor& recv_counts,
    c10::SymInt num_rows, c10::string_view group_name) {
  constexpr const char* op = "moe_combine_backward";
  const GroupRef g = resolveGroup(group_name, op);
  const int64_t k = weights.size(1);
  // Each kept slot's share of its token's gradient.
  at::Tensor g_rows = grad.index_select(0, order.div(k, "floor"));
  at::Tensor gw = at::zeros({weights.numel()}, weights.options())
                      .index_copy_(0, order, (g_rows * back).sum(1))
                      .view(weights.sizes());
  at::Tensor gy = sendToExperts(g, g_rows.mul_(sortedGates(weights, order)), send_counts,
                                recv_counts);
  TORCH_CHECK(gy.size(0) == num_rows.expect_int(), op, ": ", gy.size(0),
              " gradient rows for ", num_rows, " expert outputs");
  return {gy, gw};
}

// ---------------------------------------------------------------- autograd

template <typename Sig>
c10::TypedOperatorHandle<Sig> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

class DispatchFunction : public torch::autograd::Function<DispatchFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& order, const at::Tensor& send_counts,
                            const at::Tensor& recv_counts, int64_t top_k,
                            std::string group) {
    ctx->save_for_backward({order, send_counts, recv_counts});
    ctx->saved_data["top_k"] = top_k;
    ctx->saved_data["tokens"] = x.sym_size(0);
    ctx->saved_data["group"] = group;
    at::AutoDispatchBelowADInplaceOrView below;
    static auto op = handle<decltype(dispatchKernel)>("dsparallel::moe_dispatch");
    return op.call(x, order, send_counts, recv_counts, top_k, group);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    at::Tensor gx;
    if (grads[0].defined()) {
      static auto op =
          handle<decltype(dispatchBackwardKernel)>("dsparallel::_moe_dispatch_backward");
      gx = op.call(grads[0], saved[0], saved[1], saved[2],
                   ctx->saved_data["top_k"].toInt(), ctx->saved_data["tokens"].toSymInt(),
                   ctx->saved_data["group"].toStringRef());
    }
    return {gx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class CombineFunction : public torch::autograd::Function<CombineFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& y,
                            const at::Tensor& weights, const at::Tensor& order,
                            const at::Tensor& send_counts, const at::Tensor& recv_counts,
                            std::string group) {
    at::AutoDispatchBelowADInplaceOrView below;
    static auto op =
        handle<decltype(combineForwardKernel)>("dsparallel::_moe_combine_forward");
    auto [out, back] = op.call(y, weights, order, send_counts, recv_counts, group);
    ctx->save_for_backward({back, weights, order, send_counts, recv_counts});
    ctx->saved_data["rows"] = y.sym_size(0);
    ctx->saved_data["group"] = group;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    if (!grads[0].defined()) return variable_list(6);
    static auto op =
        handle<decltype(combineBackwardKernel)>("dsparallel::_moe_combine_backward");
    auto [gy, gw] = op.call(grads[0], s[0], s[1], s[2], s[3], s[4],
                            ctx->saved_data["rows"].toSymInt(),
                            ctx->saved_data["group"].toStringRef());
    return {gy, gw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor dispatchAutograd(const at::Tensor& x, const at::Tensor& order,
                            const at::Tensor& send_counts, const at::Tensor& recv_counts,
                            int64_t top_k, c10::string_view group) {
  return DispatchFunction::apply(x, order, send_counts, recv_counts, top_k,
                                 std::string(group));
}

at::Tensor combineAutograd(const at::Tensor& y, const at::Tensor& weights,
                           const at::Tensor& order, const at::Tensor& send_counts,
                           const at::Tensor& recv_counts, c10::string_view group) {
  return CombineFunction::apply(y, weights, order, send_counts, recv_counts,
                                std::string(group));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsparallel, m) {
  m.def(
      "moe_plan(Tensor expert_idx, int num_experts, str group_name) -> "
      "(Tensor, Tensor, Tensor)");
  m.def(
      "moe_dispatch(Tensor x, Tensor order, Tensor send_counts, Tensor recv_counts, "
      "int top_k, str group_name) -> Tensor");
  m.def(
      "_moe_dispatch_backward(Tensor grad, Tensor order, Tensor send_counts, "
      "Tensor recv_counts, int top_k, SymInt num_tokens, str group_name) -> Tensor");
  m.def(
      "moe_combine(Tensor y, Tensor weights, Tensor order, Tensor send_counts, "
      "Tensor recv_counts, str group_name) -> Tensor");
  m.def(
      "_moe_combine_forward(Tensor y, Tensor weights, Tensor order, Tensor send_counts, "
      "Tensor recv_counts, str group_name) -> (Tensor, Tensor)");
  m.def(
      "_moe_combine_backward(Tensor grad, Tensor back, Tensor weights, Tensor order, "
      "Tensor send_counts, Tensor recv_counts, SymInt num_rows, str group_name) -> "
      "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dsparallel, CompositeExplicitAutograd, m) {
  m.impl("moe_plan", &planKernel);
  m.impl("moe_dispatch", &dispatchKernel);
  m.impl("_moe_dispatch_backward", &dispatchBackwardKernel);
  m.impl("moe_combine", &combineKernel);
  m.impl("_moe_combine_forward", &combineForwardKernel);
  m.impl("_moe_combine_backward", &combineBackwardKernel);
}

TORCH_LIBRARY_IMPL(dsparallel, Autograd, m) {
  m.impl("moe_dispatch", &dispatchAutograd);
  m.impl("moe_combine", &combineAutograd);
}

}  // namespace dsparallel
