#include "tensor_adapt.h"

#include <c10/util/Exception.h>

namespace dsparallel {

dsp::DType checkedDType(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "dsp ", what, ": tensor is on ", t.device(),
              "; this build of the dsp backend moves CPU tensors only (for CUDA "
              "tensors use init_process_group(\"cpu:dsp,cuda:nccl\"))");
  TORCH_CHECK(t.layout() == c10::kStrided, "dsp ", what,
              ": only dense (strided) tensors are supported, got ", t.layout());
  switch (t.scalar_type()) {
    case at::kFloat:
      return dsp::DType::kFloat32;
    case at::kDouble:
      return dsp::DType::kFloat64;
    case at::kHalf:
      return dsp::DType::kFloat16;
    case at::kBFloat16:
      return dsp::DType::kBFloat16;
    case at::kChar:
      return dsp::DType::kInt8;
    case at::kByte:
      return dsp::DType::kUInt8;
    case at::kShort:
      return dsp::DType::kInt16;
    case at::kInt:
      return dsp::DType::kInt32;
    case at::kLong:
      return dsp::DType::kInt64;
    case at::kBool:
      return dsp::DType::kBool;
    default:
      TORCH_CHECK(false, "dsp ", what, ": unsupported dtype ", t.scalar_type(),
                  " (supported: float32, float64, float16, bfloat16, int8, "
                  "uint8, int16, int32, int64, bool)");
  }
}

dsp::ReduceOp checkedReduceOp(const c10d::ReduceOp& op, dsp::DType dtype,
                              const char* what) {
  dsp::ReduceOp core;
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      core = dsp::ReduceOp::kSum;
      break;
    case c10d::ReduceOp::AVG:
      core = dsp::ReduceOp::kAvg;
      break;
    case c10d::ReduceOp::PRODUCT:
      core = dsp::ReduceOp::kProduct;
      break;
    case c10d::ReduceOp::MIN:
      core = dsp::ReduceOp::kMin;
      break;
    case c10d::ReduceOp::MAX:
      core = dsp::ReduceOp::kMax;
      break;
    default:
      TORCH_CHECK(false, "dsp ", what, ": unsupported reduce op ",
                  static_cast<int>(op.op_), " (supported: SUM, AVG, PRODUCT, MIN, MAX)");
  }
  const std::string why = dsp::unsupportedReason(dtype, core);
  TORCH_CHECK(why.empty(), "dsp ", what, ": ", why);
  return core;
}

void checkSameAs(const at::TensorList tensors, const at::Tensor& ref, const char* what) {
  for (const auto& t : tensors) {
    checkedDType(t, what);
    TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "dsp ", what,
                ": tensors in the list must have dtype ", ref.scalar_type(), ", got ",
                t.scalar_type());
    TORCH_CHECK(t.numel() == ref.numel(), "dsp ", what,
                ": tensors in the list must have ", ref.numel(),
                " elements like the input, got shape ", t.sizes());
  }
}

dsp::CallInfo callInfo(dsp::Collective kind, const at::Tensor& t, dsp::ReduceOp op,
                       int root) {
  dsp::CallInfo info;
  info.kind = kind;
  info.dtype = checkedDType(t, dsp::collectiveName(kind));
  info.op = op;
  info.root = root;
  info.shape.assign(t.sizes().begin(), t.sizes().end());
  return info;
}

const at::Tensor& single(const std::vector<at::Tensor>& ts, const char* what) {
  TORCH_CHECK(ts.size() == 1, "dsp ", what, ": expects exactly one tensor per rank, got ",
              ts.size());
  return ts[0];
}

std::vector<Staged> stageAll(const std::vector<at::Tensor>& ts) {
  std::vector<Staged> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.emplace_back(t);
  return out;
}

}  // namespace dsparallel
