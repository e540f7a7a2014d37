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

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace dsp {
namespace {

namespace generic {
#include "reduce_kernels.inc"
}  // namespace generic

#if defined(__x86_64__) && defined(__GNUC__)
#define DSP_HAVE_AVX2_KERNELS 1
// Both wide builds convert fp16 with F16C (reduce_kernels.inc says why).
#define DSP_KERNEL_F16C 1
#pragma GCC push_options
// No FMA: a contracted multiply-add would round differently from the
// baseline build (its fp16 conversion multiplies), and all builds must agree
// to the bit.
#pragma GCC target("avx2,f16c")
// bf16 in explicit 16-lane pairs: faster than the compiler's loop with AVX2,
// slower than its AVX-512 one (dsp_reduce_kernels times the builds).
#define DSP_BF16_LANES 1
namespace avx2 {
#include "reduce_kernels.inc"
}  // namespace avx2
#undef DSP_BF16_LANES
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,f16c")
namespace avx512 {
#include "reduce_kernels.inc"
}  // namespace avx512
#pragma GCC pop_options
#undef DSP_KERNEL_F16C
#endif

using Kernel = void (*)(void*, const void* const*, int, size_t, DType, ReduceOp, int);

struct Build {
  const char* name;
  Kernel kernel;
  bool (*supported)();
};

// Widest first: the first build this CPU supports is the one reduceInto runs.
const Build kBuilds[] = {
#ifdef DSP_HAVE_AVX2_KERNELS
    {"avx512", &avx512::kernel,
     [] {
       return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
              __builtin_cpu_supports("f16c");
     }},
    {"avx2", &avx2::kernel,
     [] { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"); }},
#endif
    {"generic", &generic::kernel, [] { return true; }},
};

// The named build when this CPU has it, else nullptr.
Kernel findBuild(const char* name) {
  for (const Build& b : kBuilds)
    if (std::strcmp(b.name, name) == 0) return b.supported() ? b.kernel : nullptr;
  return nullptr;
}

Kernel pickKernel() {
  // DSP_REDUCE_KERNEL names a narrower build for A/B runs; one this CPU lacks
  // (or a misspelling) falls back to the widest, never to an illegal instruction.
  const char* force = std::getenv("DSP_REDUCE_KERNEL");
  if (force != nullptr) {
    if (Kernel k = findBuild(force)) return k;
  }
  for (const Build& b : kBuilds)
    if (b.supported()) return b.kernel;
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

void reduceInto(void* dst, const void* const* srcs, int nsrc, size_t count, DType dtype,
                ReduceOp op, int divisor) {
  if (count == 0 || nsrc <= 0) return;
  kernelOf()(dst, srcs, nsrc, count, dtype, op, divisor);
}

bool reduceIntoWith(const char* kernel_name, void* dst, const void* const* srcs, int nsrc,
                    size_t count, DType dtype, ReduceOp op, int divisor) {
  const Kernel k = findBuild(kernel_name);
  if (k == nullptr) return false;
  if (count > 0 && nsrc > 0) k(dst, srcs, nsrc, count, dtype, op, divisor);
  return true;
}

}  // namespace dsp
