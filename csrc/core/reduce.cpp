// Reduction kernels (reduce_kernels.inc), built for the baseline x86-64
// instruction set, for AVX2 and for AVX-512: the wheel must run on any
// x86-64, and bf16 and fp16 conversions and in-cache sums run faster 8 or 16
// lanes wide. The widest build the CPU has is chosen once
// (DSP_REDUCE_KERNEL=generic or avx2 forces one, for A/B runs).
#include "reduce.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "half.h"

namespace dsp {
namespace {

namespace generic {
#include "reduce_kernels.inc"
}  // namespace generic

#if defined(__x86_64__) && defined(__GNUC__)
#define DSP_HAVE_AVX2_KERNELS 1
#pragma GCC push_options
// No FMA: a contracted multiply-add would round differently from the
// baseline build (fp16 conversion), and both builds must agree to the bit.
#pragma GCC target("avx2")
namespace avx2 {
#include "reduce_kernels.inc"
}  // namespace avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
namespace avx512 {
#include "reduce_kernels.inc"
}  // namespace avx512
#pragma GCC pop_options
#endif

using Kernel = void (*)(void*, const void* const*, int, size_t, DType, ReduceOp, int);

Kernel pickKernel() {
#ifdef DSP_HAVE_AVX2_KERNELS
  const char* force = std::getenv("DSP_REDUCE_KERNEL");
  const bool generic_only = force != nullptr && std::strcmp(force, "generic") == 0;
  if (force != nullptr && std::strcmp(force, "avx2") == 0) return &avx2::kernel;
  if (!generic_only && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return &avx512::kernel;
  if (!generic_only && __builtin_cpu_supports("avx2")) return &avx2::kernel;
#endif
  return &generic::kernel;
}

Kernel kernelOf() {
  static const Kernel k = pickKernel();
  return k;
}

bool isFloating(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat64 || d == DType::kFloat16 ||
         d == DType::kBFloat16;
}

}  // namespace

size_t elementSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kInt16:
      return 2;
    case DType::kInt8:
    case DType::kUInt8:
    case DType::kBool:
      return 1;
    default:
      return 0;
  }
}

const char* dtypeName(DType dtype) {
  static const char* const kNames[] = {"float32", "float64", "float16", "bfloat16",
                                       "int8",    "uint8",   "int16",   "int32",
                                       "int64",   "bool"};
  const auto i = static_cast<uint32_t>(dtype);
  return i < static_cast<uint32_t>(DType::kNumDTypes) ? kNames[i] : "unknown";
}

const char* reduceOpName(ReduceOp op) {
  static const char* const kNames[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX"};
  const auto i = static_cast<uint32_t>(op);
  return i < static_cast<uint32_t>(ReduceOp::kNumOps) ? kNames[i] : "unknown";
}

std::string unsupportedReason(DType dtype, ReduceOp op) {
  if (static_cast<uint32_t>(dtype) >= static_cast<uint32_t>(DType::kNumDTypes)) {
    return "unsupported dtype";
  }
  if (static_cast<uint32_t>(op) >= static_cast<uint32_t>(ReduceOp::kNumOps)) {
    return "unsupported reduce op";
  }
  if (op == ReduceOp::kAvg && !isFloating(dtype)) {
    return std::string("AVG is defined for floating-point tensors only, got ") +
           dtypeName(dtype) + " (use SUM and divide as you intend)";
  }
  return "";
}

const char* reduceKernelName() {
#ifdef DSP_HAVE_AVX2_KERNELS
  if (kernelOf() == &avx2::kernel) return "avx2";
  if (kernelOf() == &avx512::kernel) return "avx512";
#endif
  return "generic";
}

void reduceInto(void* dst, const void* const* srcs, int nsrc, size_t count, DType dtype,
                ReduceOp op, int divisor) {
  if (count == 0 || nsrc <= 0) return;
  kernelOf()(dst, srcs, nsrc, count, dtype, op, divisor);
}

bool reduceIntoWith(const char* kernel_name, void* dst, const void* const* srcs, int nsrc,
                    size_t count, DType dtype, ReduceOp op, int divisor) {
  Kernel k = nullptr;
  if (std::strcmp(kernel_name, "generic") == 0) k = &generic::kernel;
#ifdef DSP_HAVE_AVX2_KERNELS
  if (std::strcmp(kernel_name, "avx2") == 0 && __builtin_cpu_supports("avx2"))
    k = &avx2::kernel;
  if (std::strcmp(kernel_name, "avx512") == 0 && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    k = &avx512::kernel;
#endif
  if (k == nullptr) return false;
  if (count > 0 && nsrc > 0) k(dst, srcs, nsrc, count, dtype, op, divisor);
  return true;
}

}  // namespace dsp
