// A rank's routed experts as one op over the dispatched token blocks:
//
//   grouped_mlp(x, w1, w2, experts, rows, activation, transposed) -> y
//
// x [N, hidden] holds len(rows) blocks one after another; block i (rows[i]
// rows) goes through local expert experts[i]: y_i = act(x_i @ W1[e]) @ W2[e].
// An expert may own several blocks (expert-parallel dispatch delivers them
// by source rank, then expert) or none; every expert still gets a gradient
// (zero when it saw no row), so the data-parallel reduction and the
// optimizer see every expert every step.
//
//   activation "gelu":   W1 [L, hidden, ffn], act = gelu (erf)
//   activation "swiglu": W1 [L, hidden, 2 * ffn] (gate columns, then up),
//                        act(h) = silu(gate) * up
//   transposed: the weights are stored as nn.Linear and transformers' stacked
//   experts hold them, W1 [L, width, hidden] and W2 [L, hidden, ffn]; the
//   GEMMs read them through transposed views, never a copy.
//
// One op instead of a Python loop of three F.linear per expert: no autograd
// node per expert and block, the weight gradients summed into one stacked
// buffer (no per-expert unbind/stack), the pre-activation the only tensor
// saved for backward besides the inputs.
//
// On the CPU, reduced-precision GEMMs go through oneDNN, which compiles a
// kernel per (M, N, K) and caches it: a block's row count changes with every
// routing decision, so a plain loop compiles kernels all run long (each
// costs a few GEMMs' time). Each block is cut into a multiple of kRowQuantum
// rows and a remainder below it, so the shapes come from a small set that
// stays cached. float32 goes through MKL, which compiles nothing, and is not
// cut. torch._grouped_mm exists for the CPU but is a slow reference
// (several times this loop) without a backward, so the CPU does not use it.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace dsparallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kOp = "grouped_mlp";
constexpr int64_t kRowQuantum = 64;

enum class Act { kGelu, kSwiglu };

Act parseActivation(c10::string_view name) {
  if (name == "gelu") return Act::kGelu;
  if (name == "swiglu") return Act::kSwiglu;
  TORCH_CHECK(false, kOp, ": activation must be \"gelu\" or \"swiglu\", got \"",
              std::string(name), "\"");
}

// The block boundaries, checked against x and the weights.
std::vector<int64_t> checkedOffsets(const at::Tensor& x, const at::Tensor& w1,
                                    const at::Tensor& w2, at::IntArrayRef experts,
                                    at::IntArrayRef rows, Act act, bool transposed) {
  TORCH_CHECK(x.dim() == 2, kOp, ": x must be [rows, hidden], got ", x.sizes());
  TORCH_CHECK(w1.dim() == 3 && w2.dim() == 3, kOp,
              ": w1 and w2 must be stacked [experts, ...], got ", w1.sizes(), " and ",
              w2.sizes());
  TORCH_CHECK(x.scalar_type() == w1.scalar_type() && x.scalar_type() == w2.scalar_type(),
              kOp, ": x, w1 and w2 must share a dtype, got ", x.scalar_type(), ", ",
              w1.scalar_type(), " and ", w2.scalar_type());
  const int64_t local = w1.size(0), hidden = x.size(1);
  TORCH_CHECK(w2.size(0) == local, kOp, ": w1 holds ", local, " experts but w2 ",
              w2.size(0));
  const int64_t w1_in = transposed ? w1.size(2) : w1.size(1);
  const int64_t width = transposed ? w1.size(1) : w1.size(2);
  const int64_t ffn = act == Act::kSwiglu ? width / 2 : width;
  TORCH_CHECK(act != Act::kSwiglu || width % 2 == 0, kOp,
              ": swiglu needs an even w1 width (gate, then up), got ", width);
  const auto w2_shape = transposed ? std::vector<int64_t>{local, hidden, ffn}
                                   : std::vector<int64_t>{local, ffn, hidden};
  TORCH_CHECK(w1_in == hidden && w2.sizes() == at::IntArrayRef(w2_shape), kOp,
              ": weights ", w1.sizes(), " and ", w2.sizes(), " do not fit x ", x.sizes(),
              " (transposed=", transposed, ", w2 should be ", at::IntArrayRef(w2_shape),
              ")");
  TORCH_CHECK(experts.size() == rows.size(), kOp, ": ", experts.size(), " experts for ",
              rows.size(), " blocks of rows");
  std::vector<int64_t> offsets{0};
  for (size_t i = 0; i < rows.size(); ++i) {
    TORCH_CHECK(experts[i] >= 0 && experts[i] < local, kOp, ": block ", i,
                " names expert ", experts[i], ", outside the ", local, " local experts");
    TORCH_CHECK(rows[i] >= 0, kOp, ": block ", i, " has ", rows[i], " rows");
    offsets.push_back(offsets.back() + rows[i]);
  }
  TORCH_CHECK(offsets.back() == x.size(0), kOp, ": the blocks hold ", offsets.back(),
              " rows but x has ", x.size(0));
  return offsets;
}

// The weight of expert e as the [in, out] matrix the GEMMs multiply by.
at::Tensor asInOut(const at::Tensor& w, int64_t e, bool transposed) {
  return transposed ? w[e].t() : w[e];
}

bool cutRows(const at::Tensor& t) {
  return t.is_cpu() && t.scalar_type() != at::kFloat && t.scalar_type() != at::kDouble;
}

// out = a @ b, a's rows cut as described at the top.
void mmRows(at::Tensor out, const at::Tensor& a, const at::Tensor& b) {
  const int64_t m = a.size(0);
  const int64_t whole = cutRows(a) ? m / kRowQuantum * kRowQuantum : m;
  if (whole > 0) {
    at::Tensor head = out.narrow(0, 0, whole);
    at::mm_out(head, a.narrow(0, 0, whole), b);
  }
  if (whole < m) {
    at::Tensor tail = out.narrow(0, whole, m - whole);
    at::mm_out(tail, a.narrow(0, whole, m - whole), b);
  }
}

// acc += a^T @ b over their rows (the GEMM's inner dimension), cut alike.
void addTransposedMm(at::Tensor acc, const at::Tensor& a, const at::Tensor& b) {
  const int64_t m = a.size(0);
  const int64_t whole = cutRows(a) ? m / kRowQuantum * kRowQuantum : m;
  if (whole > 0) acc.addmm_(a.narrow(0, 0, whole).t(), b.narrow(0, 0, whole));
  if (whole < m)
    acc.addmm_(a.narrow(0, whole, m - whole).t(), b.narrow(0, whole, m - whole));
}

at::Tensor activate(const at::Tensor& h, Act act) {
  if (act == Act::kGelu) return at::gelu(h);
  auto halves = h.chunk(2, -1);
  return at::silu(halves[0]) * halves[1];
}

// d loss / d h from d loss / d act(h).
at::Tensor activationBackward(const at::Tensor& grad, const at::Tensor& h, Act act) {
  if (act == Act::kGelu) return at::gelu_backward(grad, h);
  auto halves = h.chunk(2, -1);
  const at::Tensor& gate = halves[0];
  const at::Tensor& up = halves[1];
  return at::cat({at::silu_backward(grad * up, gate), grad * at::silu(gate)}, -1);
}

// Returns (y, h): h is every row's pre-activation, kept for backward.
std::tuple<at::Tensor, at::Tensor> forwardKernel(
    const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
    at::IntArrayRef experts, at::IntArrayRef rows, c10::string_view activation,
    bool transposed) {
  const Act act = parseActivation(activation);
  const auto off = checkedOffsets(x, w1, w2, experts, rows, act, transposed);
  const int64_t width = transposed ? w1.size(1) : w1.size(2);
  at::Tensor h = at::empty({x.size(0), width}, x.options());
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] == 0) continue;
    const int64_t e = experts[i];
    at::Tensor hi = h.narrow(0, off[i], rows[i]);
    mmRows(hi, x.narrow(0, off[i], rows[i]), asInOut(w1, e, transposed));
    mmRows(y.narrow(0, off[i], rows[i]), activate(hi, act), asInOut(w2, e, transposed));
  }
  return {y, h};
}

at::Tensor kernel(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                  at::IntArrayRef experts, at::IntArrayRef rows,
                  c10::string_view activation, bool transposed) {
  return std::get<0>(forwardKernel(x, w1, w2, experts, rows, activation, transposed));
}

// Returns the gradients of (x, w1, w2).
std::tuple<at::Tensor, at::Tensor, at::Tensor> backwardKernel(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& w1,
    const at::Tensor& w2, const at::Tensor& h, at::IntArrayRef experts,
    at::IntArrayRef rows, c10::string_view activation, bool transposed) {
  const Act act = parseActivation(activation);
  const auto off = checkedOffsets(x, w1, w2, experts, rows, act, transposed);
  const at::Tensor gy = grad.contiguous();
  at::Tensor gx = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor gw1 = at::zeros_like(w1, at::MemoryFormat::Contiguous);
  at::Tensor gw2 = at::zeros_like(w2, at::MemoryFormat::Contiguous);
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] == 0) continue;
    const int64_t e = experts[i];
    const at::Tensor xi = x.narrow(0, off[i], rows[i]);
    const at::Tensor hi = h.narrow(0, off[i], rows[i]);
    const at::Tensor gyi = gy.narrow(0, off[i], rows[i]);
    const at::Tensor w2e = asInOut(w2, e, transposed);
    // Stored [out, in], a weight's gradient is g_out^T @ in; stored
    // [in, out], in^T @ g_out: either way written into its own layout.
    const at::Tensor a = activate(hi, act);
    at::Tensor ga = at::empty({rows[i], w2e.size(0)}, x.options());
    mmRows(ga, gyi, w2e.t());
    if (transposed) {
      addTransposedMm(gw2[e], gyi, a);
    } else {
      addTransposedMm(gw2[e], a, gyi);
    }
    const at::Tensor gh = activationBackward(ga, hi, act);
    if (transposed) {
      addTransposedMm(gw1[e], gh, xi);
    } else {
      addTransposedMm(gw1[e], xi, gh);
    }
    mmRows(gx.narrow(0, off[i], rows[i]), gh, asInOut(w1, e, transposed).t());
  }
  return {gx, gw1, gw2};
}

template <typename Sig>
c10::TypedOperatorHandle<Sig> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

class GroupedMlpFunction : public torch::autograd::Function<GroupedMlpFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w1, const at::Tensor& w2,
                            std::vector<int64_t> experts, std::vector<int64_t> rows,
                            std::string activation, bool transposed) {
    at::AutoDispatchBelowADInplaceOrView below;
    static auto op = handle<decltype(forwardKernel)>("dsparallel::_grouped_mlp_forward");
    auto [y, h] = op.call(x, w1, w2, experts, rows, activation, transposed);
    ctx->save_for_backward({x, w1, w2, h});
    ctx->saved_data["experts"] = experts;
    ctx->saved_data["rows"] = rows;
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["transposed"] = transposed;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    variable_list out(7);
    if (!grads[0].defined()) return out;
    static auto op =
        handle<decltype(backwardKernel)>("dsparallel::_grouped_mlp_backward");
    auto [gx, gw1, gw2] = op.call(grads[0], s[0], s[1], s[2], s[3],
                                  ctx->saved_data["experts"].toIntVector(),
                                  ctx->saved_data["rows"].toIntVector(),
                                  ctx->saved_data["activation"].toStringRef(),
                                  ctx->saved_data["transposed"].toBool());
    out[0] = gx;
    out[1] = gw1;
    out[2] = gw2;
    return out;
  }
};

at::Tensor autogradKernel(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                          at::IntArrayRef experts, at::IntArrayRef rows,
                          c10::string_view activation, bool transposed) {
  return GroupedMlpFunction::apply(x, w1, w2, experts.vec(), rows.vec(),
                                   std::string(activation), transposed);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsparallel, m) {
  m.def(
      "grouped_mlp(Tensor x, Tensor w1, Tensor w2, int[] experts, int[] rows, "
      "str activation, bool transposed=False) -> Tensor");
  m.def(
      "_grouped_mlp_forward(Tensor x, Tensor w1, Tensor w2, int[] experts, int[] rows, "
      "str activation, bool transposed) -> (Tensor, Tensor)");
  m.def(
      "_grouped_mlp_backward(Tensor grad, Tensor x, Tensor w1, Tensor w2, Tensor h, "
      "int[] experts, int[] rows, str activation, bool transposed) -> "
      "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dsparallel, CompositeExplicitAutograd, m) {
  m.impl("grouped_mlp", &kernel);
  m.impl("_grouped_mlp_forward", &forwardKernel);
  m.impl("_grouped_mlp_backward", &backwardKernel);
}

TORCH_LIBRARY_IMPL(dsparallel, Autograd, m) { m.impl("grouped_mlp", &autogradKernel); }

}  // namespace dsparallel
