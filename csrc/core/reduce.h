// Element-wise reduction kernels for the shared-memory collectives.
//
// Plain C++17: no torch, no Python. The backend maps at::ScalarType and
// c10d::ReduceOp onto these enums.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dsp {

enum class DType : uint32_t {
  kFloat32 = 0,
  kFloat64,
  kFloat16,
  kBFloat16,
  kInt8,
  kUInt8,
  kInt16,
  kInt32,
  kInt64,
  kBool,
  kNumDTypes,
};

enum class ReduceOp : uint32_t {
  kSum = 0,
  kAvg,
  kProduct,
  kMin,
  kMax,
  kNumOps,
};

size_t elementSize(DType dtype);
const char* dtypeName(DType dtype);
const char* reduceOpName(ReduceOp op);

// Empty string when (dtype, op) can be reduced; otherwise the reason, for the
// error the caller raises before anything is sent.
std::string unsupportedReason(DType dtype, ReduceOp op);

// dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrc-1][i] for i < count.
// dst may be any source (the same address; no partial overlap). AVG divides the sum by
// `divisor` (the group size). fp16 and bf16 are accumulated in fp32 and rounded once.
void reduceInto(void* dst, const void* const* srcs, int nsrc, size_t count, DType dtype,
                ReduceOp op, int divisor);

// reduceInto with a named build ("generic", "avx2", "avx512"); false when this CPU or
// compiler has no such build. For tests that hold the builds to each other.
bool reduceIntoWith(const char* kernel_name, void* dst, const void* const* srcs, int nsrc,
                    size_t count, DType dtype, ReduceOp op, int divisor);

}  // namespace dsp
