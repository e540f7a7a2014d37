// Context parallelism's communication in attention, as ops under
// torch.ops.dsparallel, each a C++ autograd Function:
//
//   ring_attention(q, k, v, group_name, causal, doc_ids, scale) -> out
//     q [batch, heads, s, dim], k and v [batch, kv heads, s, dim]: this
//     rank's s positions of sequences split over the group. Keys and values
//     travel the ring (each rank sends its block to the next and receives
//     the previous rank's), every block's attention is merged into the
//     output by the log-sum-exp rule; the backward runs the flash backward
//     per block with the final output and log-sum-exp (exact, no merge) and
//     sends each block's key/value gradients along with it, one hop further
//     than the block itself, so that they end on the block's owner.
//     Causal attention expects the load-balanced layout: rank r holds
//     chunks r and 2C-1-r of the sequence cut into 2C (shard_sequence), so
//     each step attends half of the block pairs on every rank: the local
//     block causally at step 0; a block from an earlier rank with all
//     queries against its first half of keys; one from a later rank with
//     the second half of queries against all of its keys. doc_ids [batch,
//     s] (packed documents; every rank's gathered once) turn each step
//     into a masked attention: the same document, and causal by global
//     position when causal.
//
//   ulysses_all_to_all(x, group_name, scatter_dim, gather_dim) -> y
//     x cut into C chunks along scatter_dim, chunk j sent to rank j, the
//     received chunks concatenated along gather_dim in rank order
//     (DeepSpeed-Ulysses' sequence <-> heads exchange); its backward is the
//     exchange with the dims swapped.
//
// The CPU flash attention kernel returns the log-sum-exp the merge needs and
// takes grouped-query keys and values as they are.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "ops/group_collectives.h"

namespace dsparallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kRing = "ring_attention";
constexpr const char* kUlysses = "ulysses_all_to_all";
constexpr double kNegInf = -std::numeric_limits<double>::infinity();
// Tags of the ring's messages, per step: keys/values, their gradients.
constexpr int kTagKV = 0x7100;
constexpr int kTagGrad = 0x7200;

// What attends at one step, in the load-balanced causal layout.
enum class Part { kAll, kCausal, kFirstHalfOfKeys, kSecondHalfOfQueries };

struct Ring {
  GroupRef g;
  bool causal;
  at::Tensor docs;  // [C, batch, s] every rank's document ids, or undefined

  int64_t next() const { return (g.rank + 1) % g.size; }
  int64_t prev() const { return (g.rank + g.size - 1) % g.size; }
  int64_t source(int64_t step) const { return (g.rank - step + g.size) % g.size; }

  Part part(int64_t src) const {
    if (!causal || docs.defined()) return Part::kAll;  // a mask says the rest
    if (src == g.rank) return Part::kCausal;
    return src < g.rank ? Part::kFirstHalfOfKeys : Part::kSecondHalfOfQueries;
  }

  // Global positions of rank r's s tokens in the load-balanced layout.
  at::Tensor positions(int64_t r, int64_t s) const {
    const int64_t c = s / 2;
    auto opts = at::TensorOptions().dtype(at::kLong);
    return at::cat({at::arange(r * c, (r + 1) * c, opts),
                    at::arange((2 * g.size - 1 - r) * c, (2 * g.size - r) * c, opts)});
  }

  // [batch, 1, s, s]: 0 where this rank's queries see the keys of `src`,
  // -inf elsewhere (the flash kernel takes an additive mask of q's dtype).
  c10::optional<at::Tensor> mask(int64_t src, at::ScalarType dtype) const {
    if (!docs.defined()) return c10::nullopt;
    at::Tensor m = docs[g.rank].unsqueeze(2) == docs[src].unsqueeze(1);
    if (causal) {
      const int64_t s = docs.size(2);
      m = m & (positions(g.rank, s).unsqueeze(1) >= positions(src, s).unsqueeze(0));
    }
    return at::zeros(m.sizes(), m.options().dtype(dtype))
        .masked_fill_(m.logical_not(), kNegInf)
        .unsqueeze(1);
  }

  // Posts the receive from the previous rank into `in` and the send of `out`
  // to the next; `out` must live until both are waited on.
  std::vector<c10::intrusive_ptr<c10d::Work>> exchange(at::Tensor out, at::Tensor in,
                                                       int tag) const {
    std::vector<at::Tensor> o = {std::move(out)}, i = {std::move(in)};
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    works.push_back(g.pg->recv(i, static_cast<int>(prev()), tag));
    works.push_back(g.pg->send(o, static_cast<int>(next()), tag));
    return works;
  }
};

// Profiled as "dsparallel::ring_wait": the time the ring's transfers are
// not hidden behind the attention (benchmarks/context_parallel.py).
void waitAll(std::vector<c10::intrusive_ptr<c10d::Work>>& works) {
  if (works.empty()) return;
  RECORD_FUNCTION("dsparallel::ring_wait", std::vector<c10::IValue>());
  for (auto& w : works) w->wait();
  works.clear();
}

at::ScalarType accumulation(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Merges a block's (out, lse) into the running (out, lse) views: a row the
// block masked entirely (lse -inf) leaves them as they were.
void merge(at::Tensor out, at::Tensor lse, const at::Tensor& block_out,
           const at::Tensor& block_lse) {
  at::Tensor lb = block_lse.to(lse.scalar_type());
  const at::Tensor seen = lb.isfinite();
  lb = at::where(seen, lb, kNegInf);
  const at::Tensor ob = at::where(seen.unsqueeze(-1), block_out.to(out.scalar_type()), 0);
  const at::Tensor total = at::logaddexp(lse, lb);
  const at::Tensor live = total.isfinite();
  const at::Tensor keep = at::where(live, at::exp(lse - total), 0).unsqueeze(-1);
  const at::Tensor add = at::where(live, at::exp(lb - total), 0).unsqueeze(-1);
  out.copy_(out * keep + ob * add);
  lse.copy_(total);
}

std::tuple<at::Tensor, at::Tensor> attend(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, bool causal,
                                          const c10::optional<at::Tensor>& mask,
                                          c10::optional<double> scale) {
  auto r =
      at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, mask, scale);
  return {std::get<0>(r), std::get<1>(r)};
}

// The forward: the output (q's dtype) and the log-sum-exp (accumulation dtype).
std::tuple<at::Tensor, at::Tensor> ringForward(const Ring& ring, const at::Tensor& q,
                                               const at::Tensor& k, const at::Tensor& v,
                                               c10::optional<double> scale) {
  const int64_t s = q.size(2), half = s / 2;
  auto acc = q.options().dtype(accumulation(q));
  at::Tensor out = at::zeros(q.sizes(), acc);
  at::Tensor lse = at::full({q.size(0), q.size(1), s}, kNegInf, acc);
  at::Tensor kv = at::stack({k, v});
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (int64_t step = 0; step < ring.g.size; ++step) {
    const int64_t src = ring.source(step);
    at::Tensor incoming;
    if (step + 1 < ring.g.size) {  // the next block travels while this one is used
      incoming = at::empty_like(kv);
      works = ring.exchange(kv, incoming, kTagKV + static_cast<int>(step));
    }
    const at::Tensor kb = kv[0], vb = kv[1];
    switch (ring.part(src)) {
      case Part::kAll: {
        const auto mask = ring.mask(src, q.scalar_type());
        auto [o, l] = attend(q, kb, vb, false, mask, scale);
        // The kernel gives a row that sees no key of the block lse 0 (and
        // output 0): it must weigh nothing in the merge.
        if (mask) l = at::where(mask->isfinite().any(-1), l, kNegInf);
        merge(out, lse, o, l);
        break;
      }
      case Part::kCausal: {
        auto [o, l] = attend(q, kb, vb, true, c10::nullopt, scale);
        merge(out, lse, o, l);
        break;
      }
      case Part::kFirstHalfOfKeys: {
        auto [o, l] = attend(q, kb.narrow(2, 0, half), vb.narrow(2, 0, half), false,
                             c10::nullopt, scale);
        merge(out, lse, o, l);
        break;
      }
      case Part::kSecondHalfOfQueries: {
        auto [o, l] = attend(q.narrow(2, half, half), kb, vb, false, c10::nullopt, scale);
        merge(out.narrow(2, half, half), lse.narrow(2, half, half), o, l);
        break;
      }
    }
    waitAll(works);
    if (incoming.defined()) kv = incoming;
  }
  return {out.to(q.scalar_type()), lse};
}

// The backward: dq, dk, dv, each block's gradients returned to its owner.
// As in the forward, the next key/value block travels while this one's
// gradients are computed; a block's gradients so far (dkv, from the ranks
// that held it before) arrive during that computation too, and are only
// needed after it, when this rank adds its part and passes them on.
variable_list ringBackward(const Ring& ring, const at::Tensor& dout, const at::Tensor& q,
                           const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& out, const at::Tensor& lse,
                           c10::optional<double> scale) {
  const int64_t s = q.size(2), half = s / 2;
  auto acc = q.options().dtype(accumulation(q));
  at::Tensor dq = at::zeros(q.sizes(), acc);
  at::Tensor kv = at::stack({k, v});
  auto backward = [&](const at::Tensor& g, const at::Tensor& qb, const at::Tensor& kb,
                      const at::Tensor& vb, const at::Tensor& ob, const at::Tensor& lb,
                      bool causal, const c10::optional<at::Tensor>& mask) {
    return at::_scaled_dot_product_flash_attention_for_cpu_backward(
        g, qb, kb, vb, ob, lb, 0.0, causal, mask, scale);
  };
  at::Tensor dkv = at::zeros(kv.sizes(), acc);  // the held block's gradients so far
  at::Tensor sending;  // the gradients in flight to the next rank
  std::vector<c10::intrusive_ptr<c10d::Work>> kv_works, grad_works;
  for (int64_t step = 0; step < ring.g.size; ++step) {
    const int64_t src = ring.source(step);
    at::Tensor kv_in;
    if (step + 1 < ring.g.size) {
      kv_in = at::empty_like(kv);
      kv_works = ring.exchange(kv, kv_in, kTagKV + static_cast<int>(step));
    }
    const at::Tensor kb = kv[0], vb = kv[1];
    at::Tensor mine = at::zeros(kv.sizes(), acc);  // this rank's part of the block's gradients
    switch (ring.part(src)) {
      case Part::kAll:
      case Part::kCausal: {
        const bool causal = ring.part(src) == Part::kCausal;
        auto [gq, gk, gv] =
            backward(dout, q, kb, vb, out, lse, causal, ring.mask(src, q.scalar_type()));
        dq.add_(gq);
        mine[0].copy_(gk);
        mine[1].copy_(gv);
        break;
      }
      case Part::kFirstHalfOfKeys: {
        auto [gq, gk, gv] =
            backward(dout, q, kb.narrow(2, 0, half), vb.narrow(2, 0, half), out, lse,
                     false, c10::nullopt);
        dq.add_(gq);
        mine[0].narrow(2, 0, half).copy_(gk);
        mine[1].narrow(2, 0, half).copy_(gv);
        break;
      }
      case Part::kSecondHalfOfQueries: {
        auto [gq, gk, gv] = backward(dout.narrow(2, half, half), q.narrow(2, half, half),
                                     kb, vb, out.narrow(2, half, half),
                                     lse.narrow(2, half, half), false, c10::nullopt);
        dq.narrow(2, half, half).add_(gq);
        mine[0].copy_(gk);
        mine[1].copy_(gv);
        break;
      }
    }
    if (ring.g.size == 1) {
      dkv = mine;
      break;
    }
    waitAll(grad_works);  // dkv now holds what the earlier holders added
    dkv.add_(mine);
    // The gradients move on with the block; after the last step they make
    // the final hop, to the block's owner, and this rank's own arrive.
    sending = dkv;
    dkv = at::empty_like(sending);
    grad_works = ring.exchange(sending, dkv, kTagGrad + static_cast<int>(step));
    waitAll(kv_works);
    if (kv_in.defined()) kv = kv_in;
  }
  waitAll(grad_works);
  return {dq.to(q.scalar_type()), dkv[0].to(k.scalar_type()), dkv[1].to(v.scalar_type())};
}

Ring makeRing(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              c10::string_view group_name, bool causal, const at::Tensor& doc_ids) {
  const GroupRef g = resolveGroup(group_name, kRing);
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, kRing,
                    ": q, k and v must be [batch, heads, seq, dim], got ", q.sizes(),
                    ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), kRing, ": k ", k.sizes(), " and v ",
                    v.sizes(), " differ");
  TORCH_CHECK_VALUE(
      q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3), kRing,
      ": q ", q.sizes(), " and k ", k.sizes(),
      " must agree on batch, local sequence and head dim");
  TORCH_CHECK_VALUE(q.size(1) % k.size(1) == 0, kRing, ": ", q.size(1),
                    " query heads are not a multiple of ", k.size(1), " key/value heads");
  TORCH_CHECK_VALUE(
      !causal || q.size(2) % 2 == 0, kRing,
      ": causal attention takes the load-balanced layout (two chunks per rank): "
      "the local sequence length ",
      q.size(2), " must be even");
  Ring ring{g, causal, at::Tensor()};
  if (doc_ids.defined()) {
    TORCH_CHECK_VALUE(doc_ids.dim() == 2 && doc_ids.size(0) == q.size(0) &&
                          doc_ids.size(1) == q.size(2),
                      kRing, ": doc_ids must be [batch, local seq] = [", q.size(0), ", ",
                      q.size(2), "], got ", doc_ids.sizes());
    ring.docs = allGatherAlong(g, doc_ids.to(at::kLong).unsqueeze(0), 0);
  }
  return ring;
}

class RingAttention : public torch::autograd::Function<RingAttention> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v,
                            std::string group_name, bool causal,
                            const c10::optional<at::Tensor>& doc_ids,
                            c10::optional<double> scale) {
    at::AutoDispatchBelowADInplaceOrView below;
    const Ring ring =
        makeRing(q, k, v, group_name, causal, doc_ids.value_or(at::Tensor()));
    auto [out, lse] = ringForward(ring, q, k, v, scale);
    ctx->save_for_backward({q, k, v, out, lse, ring.docs});
    ctx->saved_data["group"] = group_name;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale ? c10::IValue(*scale) : c10::IValue();
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const std::string group = ctx->saved_data["group"].toStringRef();
    const GroupRef g = resolveGroup(group, kRing);
    const Ring ring{g, ctx->saved_data["causal"].toBool(), saved[5]};
    const c10::IValue sv = ctx->saved_data["scale"];
    const c10::optional<double> scale =
        sv.isNone() ? c10::nullopt : c10::optional<double>(sv.toDouble());
    auto d = ringBackward(ring, grads[0].contiguous(), saved[0], saved[1], saved[2],
                          saved[3], saved[4], scale);
    return {d[0], d[1], d[2], at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor ringKernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      c10::string_view group_name, bool causal,
                      const c10::optional<at::Tensor>& doc_ids,
                      c10::optional<double> scale) {
  const Ring ring = makeRing(q, k, v, group_name, causal, doc_ids.value_or(at::Tensor()));
  return std::get<0>(ringForward(ring, q, k, v, scale));
}

at::Tensor ringAutograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        c10::string_view group_name, bool causal,
                        const c10::optional<at::Tensor>& doc_ids,
                        c10::optional<double> scale) {
  return RingAttention::apply(q, k, v, std::string(group_name), causal, doc_ids, scale);
}

// ------------------------------------------------------------------ Ulysses

at::Tensor allToAll(const at::Tensor& x, c10::string_view group_name, int64_t scatter_dim,
                    int64_t gather_dim) {
  const GroupRef g = resolveGroup(group_name, kUlysses);
  scatter_dim = c10::maybe_wrap_dim(scatter_dim, x.dim());
  gather_dim = c10::maybe_wrap_dim(gather_dim, x.dim());
  TORCH_CHECK_VALUE(x.size(scatter_dim) % g.size == 0, kUlysses, ": dim ", scatter_dim,
                    " of size ", x.size(scatter_dim), " does not split over ", g.size,
                    " ranks");
  // [C, chunk...]: chunk j (for rank j) at index j.
  std::vector<int64_t> split(x.sizes().begin(), x.sizes().end());
  split[scatter_dim] /= g.size;
  split.insert(split.begin() + scatter_dim, g.size);
  at::Tensor in = x.reshape(split).movedim(scatter_dim, 0).contiguous();
  if (g.size == 1) return x.clone(at::MemoryFormat::Contiguous);
  at::Tensor out = at::empty_like(in);
  std::vector<int64_t> counts;  // even split
  g.pg->alltoall_base(out, in, counts, counts)->wait();
  // Received chunk j (from rank j) goes to place j along gather_dim.
  at::Tensor placed = out.movedim(0, gather_dim);
  std::vector<int64_t> shape(placed.sizes().begin(), placed.sizes().end());
  shape[gather_dim] *= shape[gather_dim + 1];
  shape.erase(shape.begin() + gather_dim + 1);
  return placed.reshape(shape);
}

class AllToAll : public torch::autograd::Function<AllToAll> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            std::string group_name, int64_t scatter_dim,
                            int64_t gather_dim) {
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->saved_data["group"] = group_name;
    ctx->saved_data["scatter"] = c10::maybe_wrap_dim(scatter_dim, x.dim());
    ctx->saved_data["gather"] = c10::maybe_wrap_dim(gather_dim, x.dim());
    return allToAll(x, group_name, scatter_dim, gather_dim);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const std::string group = ctx->saved_data["group"].toStringRef();
    at::Tensor g = grads[0];
    if (g.defined()) {
      static const auto op =
          c10::Dispatcher::singleton()
              .findSchemaOrThrow("dsparallel::ulysses_all_to_all", "")
              .typed<at::Tensor(const at::Tensor&, c10::string_view, int64_t, int64_t)>();
      g = op.call(g, group, ctx->saved_data["gather"].toInt(),
                  ctx->saved_data["scatter"].toInt());
    }
    return {g, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor allToAllAutograd(const at::Tensor& x, c10::string_view group_name,
                            int64_t scatter_dim, int64_t gather_dim) {
  return AllToAll::apply(x, std::string(group_name), scatter_dim, gather_dim);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsparallel, m) {
  m.def(
      "ring_attention(Tensor q, Tensor k, Tensor v, str group_name, bool causal, "
      "Tensor? doc_ids=None, float? scale=None) -> Tensor");
  m.def(
      "ulysses_all_to_all(Tensor x, str group_name, int scatter_dim, int gather_dim) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(dsparallel, CompositeExplicitAutograd, m) {
  m.impl("ring_attention", &ringKernel);
  m.impl("ulysses_all_to_all", &allToAll);
}

TORCH_LIBRARY_IMPL(dsparallel, Autograd, m) {
  m.impl("ring_attention", &ringAutograd);
  m.impl("ulysses_all_to_all", &allToAllAutograd);
}

}  // namespace dsparallel
