#include "split_backward.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <algorithm>
#include <utility>

namespace dsparallel::pipeline {

namespace {

// The capture open on this thread (innermost), and every open one.
thread_local WeightGradStore* t_capture = nullptr;
std::mutex g_open_mutex;
std::vector<WeightGradStore*> g_open;  // under g_open_mutex

}  // namespace

WeightGradStore& WeightGradStore::standalone() {
  static WeightGradStore store;
  return store;
}

WeightGradStore* WeightGradStore::capturing(const at::Tensor& grad) {
  if (t_capture != nullptr || grad.is_cpu()) return t_capture;
  std::lock_guard<std::mutex> lock(g_open_mutex);
  if (g_open.empty()) return nullptr;
  TORCH_CHECK(g_open.size() == 1,
              "weight-gradient store: a split backward runs on an autograd engine "
              "thread while ",
              g_open.size(),
              " pipelines capture weight gradients at once; it cannot tell whose it "
              "is (run those pipelines' steps one at a time)");
  return g_open.front();
}

WeightGradStore::~WeightGradStore() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (capturing_) unregisterLocked();
}

void WeightGradStore::begin() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!capturing_, "weight-gradient store: a capture is already open");
  capturing_ = true;
  open_.clear();
  outer_ = std::exchange(t_capture, this);
  std::lock_guard<std::mutex> open_lock(g_open_mutex);
  g_open.push_back(this);
}

void WeightGradStore::unregisterLocked() {
  capturing_ = false;
  if (t_capture == this) t_capture = outer_;
  outer_ = nullptr;
  std::lock_guard<std::mutex> open_lock(g_open_mutex);
  g_open.erase(std::remove(g_open.begin(), g_open.end(), this), g_open.end());
}

int64_t WeightGradStore::end() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(capturing_, "weight-gradient store: no capture is open");
  unregisterLocked();
  const int64_t key = next_key_++;
  closed_[key] = std::move(open_);
  open_.clear();
  return key;
}

void WeightGradStore::put(Closure fn) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(capturing_, "weight-gradient store: no capture is open");
  open_.push_back(std::move(fn));
}

int64_t WeightGradStore::run(int64_t key, const std::vector<at::Tensor>& complete) {
  std::vector<Closure> fns;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = closed_.find(key);
    TORCH_CHECK(it != closed_.end(), "weight-gradient store: no capture ", key);
    fns = std::move(it->second);
    closed_.erase(it);
  }
  // Unlocked from here: the engine run may take a while, and hooks run in it.
  std::vector<at::Tensor> tensors, grads;
  for (auto& fn : fns) fn(tensors, grads);
  // One root per tensor: a weight used twice gets the sum of its gradients.
  std::vector<at::Tensor> roots, rootGrads;
  std::map<const c10::TensorImpl*, size_t> index;
  auto add = [&](const at::Tensor& t, const at::Tensor& g) {
    const auto [it, fresh] = index.emplace(t.unsafeGetTensorImpl(), roots.size());
    if (fresh) {
      roots.push_back(t);
      rootGrads.push_back(g);
    } else if (g.defined()) {
      rootGrads[it->second] = rootGrads[it->second].add(g);
    }
  };
  for (size_t i = 0; i < tensors.size(); ++i) add(tensors[i], grads[i]);
  for (const auto& t : complete) {
    if (t.requires_grad() && !index.count(t.unsafeGetTensorImpl()))
      add(t, at::zeros_like(t));
  }
  if (!roots.empty()) torch::autograd::backward(roots, rootGrads);
  return static_cast<int64_t>(fns.size());
}

void WeightGradStore::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (capturing_) unregisterLocked();
  open_.clear();
  closed_.clear();
}

int64_t WeightGradStore::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t n = open_.size();
  for (const auto& [key, fns] : closed_) n += fns.size();
  return static_cast<int64_t>(n);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether a gradient for `t` may be added straight into its .grad: a leaf
// whose .grad exists in its own dtype and that nothing observes (no tensor
// hook, no hook on its AccumulateGrad: a DDP reducer's, a user's). Then the
// W needs no fresh output per GEMM: measured on a 512-wide layer, a fresh
// 1 MB result per W was mostly page faults (glibc returns freed blocks to
// the system), 2.6x the GEMM itself.
bool accumulatesInPlace(const at::Tensor& t) {
  namespace impl = torch::autograd::impl;
  if (!t.is_leaf() || !t.grad().defined()) return false;
  const at::Tensor& g = t.grad();
  if (g.scalar_type() != t.scalar_type() || !g.is_contiguous() || g.requires_grad() ||
      g.sizes() != t.sizes())
    return false;
  if (!impl::hooks(t).empty() || impl::post_acc_grad_hooks(t)) return false;
  const auto acc = impl::try_get_grad_accumulator(t);
  return !acc || (acc->pre_hooks().empty() && acc->tensor_pre_hooks().empty() &&
                  acc->post_hooks().empty() && !acc->tensor_post_acc_grad_hooks());
}

// The weight and bias gradients from dy and x (flattened to 2-D). With
// `in_place`, each goes straight into the .grad of a parameter that
// accumulatesInPlace (addmm_ into it: no fresh result) and comes back
// undefined; the others come back to be accumulated by the engine.
std::pair<at::Tensor, at::Tensor> weightGrads(const at::Tensor& x, const at::Tensor& dy,
                                              const at::Tensor& w, const at::Tensor& b,
                                              bool needW, bool needB, bool in_place) {
  const at::Tensor dy2 = dy.reshape({-1, dy.size(-1)});
  const at::Tensor x2 = x.reshape({-1, x.size(-1)});
  const bool wInPlace = in_place && needW && accumulatesInPlace(w);
  const bool bInPlace = in_place && needB && accumulatesInPlace(b);
  if (wInPlace || bInPlace) {
    at::NoGradGuard noGrad;
    if (wInPlace) w.mutable_grad().addmm_(dy2.t(), x2);
    if (bInPlace) b.mutable_grad().add_(dy2.sum(0));
  }
  at::Tensor dw, db;
  if (needW && !wInPlace) dw = dy2.t().mm(x2);
  if (needB && !bInPlace) db = dy2.sum(0);
  return {dw, db};
}

// y = x W^T + b. Backward: dx = dy W at once; dW = dy^T x and db = sum dy
// now, or (inside a capture) at the W action; both add straight into .grad
// where they can.
class SplitLinear : public torch::autograd::Function<SplitLinear> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w, const std::optional<at::Tensor>& b) {
    // Saved as F.linear saves them, so that saved-tensor hooks (offloading,
    // activation-memory accounting) see the same: x only for the weight's
    // gradient, w's value only for the input's (a first stage's input needs
    // none: its weight is not saved, and an offloading hook does not copy
    // it for every micro-batch). Which tensors take the weight and bias
    // gradients is held by reference, not saved.
    ctx->saved_data["weight"] = w;
    if (b.has_value() && b->defined()) ctx->saved_data["bias"] = *b;
    ctx->save_for_backward(
        {w.requires_grad() ? x : at::Tensor(), x.requires_grad() ? w : at::Tensor()});
    at::AutoDispatchBelowADInplaceOrView below;
    return at::linear(x, w, b);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];  // defined when the weight needs a gradient
    const at::Tensor w = ctx->saved_data["weight"].toTensor();
    const auto held = ctx->saved_data.find("bias");
    const at::Tensor b =
        held != ctx->saved_data.end() ? held->second.toTensor() : at::Tensor();
    const at::Tensor& dy = grads[0];
    at::Tensor dx;
    if (ctx->needs_input_grad(0)) dx = at::matmul(dy, saved[1]);
    const bool needW = ctx->needs_input_grad(1);
    const bool needB = b.defined() && ctx->needs_input_grad(2);
    if (!needW && !needB) return {dx, at::Tensor(), at::Tensor()};
    WeightGradStore* store = WeightGradStore::capturing(dy);
    if (store == nullptr) {
      // A whole backward (B): the same in-place accumulation as a W, unless
      // the backward is itself being differentiated.
      auto [dw, db] = weightGrads(x, dy, w, b, needW, needB,
                                  /*in_place=*/!at::GradMode::is_enabled());
      return {dx, dw, db};
    }
    store->put([x, dy, w, b, needW, needB](variable_list& roots, variable_list& out) {
      auto [dw, db] = weightGrads(x, dy, w, b, needW, needB, /*in_place=*/true);
      if (dw.defined()) {
        roots.push_back(w);
        out.push_back(dw);
      }
      if (db.defined()) {
        roots.push_back(b);
        out.push_back(db);
      }
    });
    return {dx, at::Tensor(), at::Tensor()};
  }
};

at::Tensor splitLinearKernel(const at::Tensor& x, const at::Tensor& w,
                             const std::optional<at::Tensor>& b) {
  return at::linear(x, w, b);
}

at::Tensor splitLinearAutograd(const at::Tensor& x, const at::Tensor& w,
                               const std::optional<at::Tensor>& b) {
  return SplitLinear::apply(x, w, b);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsparallel, m) {
  m.def("split_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsparallel, CompositeExplicitAutograd, m) {
  m.impl("split_linear", &splitLinearKernel);
}

TORCH_LIBRARY_IMPL(dsparallel, Autograd, m) {
  m.impl("split_linear", &splitLinearAutograd);
}

}  // namespace dsparallel::pipeline
