// Reduction kernels. Each (dtype, op) is one instantiation of a blocked loop:
// a block of every source is combined in an L1-resident accumulator, then
// written once to dst. One pass over memory, no aliasing hazard (dst may be
// any source), and the inner loops are simple enough for the compiler to
// vectorise at -O3.
#include "reduce.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "half.h"

namespace dsp {
namespace {

// Elements per accumulator block: 16 KiB of fp32/i32, well inside L1.
constexpr size_t kBlock = 4096;

template <typename T>
struct Native {
  using Storage = T;
  using Acc = T;
  static Acc load(Storage v) { return v; }
  static Storage store(Acc v) { return v; }
};
struct Half {
  using Storage = uint16_t;
  using Acc = float;
  static Acc load(Storage v) { return halfToFloat(v); }
  static Storage store(Acc v) { return floatToHalf(v); }
};
struct BFloat {
  using Storage = uint16_t;
  using Acc = float;
  static Acc load(Storage v) { return bfloat16ToFloat(v); }
  static Storage store(Acc v) { return floatToBfloat16(v); }
};

// Integer sums and products wrap (two's complement) like torch's CPU kernels;
// doing them in the unsigned type keeps that defined behaviour in C++.
template <typename A>
A wrapAdd(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}
template <typename A>
A wrapMul(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    // Promote to at least unsigned int so that uint16 * uint16 cannot
    // overflow a signed int.
    using W = std::common_type_t<U, unsigned int>;
    return static_cast<A>(static_cast<W>(static_cast<U>(a)) *
                          static_cast<W>(static_cast<U>(b)));
  } else {
    return a * b;
  }
}

struct SumOp {
  template <typename A>
  static A apply(A a, A b) {
    return wrapAdd(a, b);
  }
};
struct ProdOp {
  template <typename A>
  static A apply(A a, A b) {
    return wrapMul(a, b);
  }
};
struct MinOp {
  template <typename A>
  static A apply(A a, A b) {
    return b < a ? b : a;
  }
};
struct MaxOp {
  template <typename A>
  static A apply(A a, A b) {
    return a < b ? b : a;
  }
};

template <typename Traits, typename Op>
void reduceBlocked(void* dstv, const void* const* srcsv, int nsrc, size_t count,
                   bool average, int divisor) {
  using S = typename Traits::Storage;
  using A = typename Traits::Acc;
  auto* dst = static_cast<S*>(dstv);
  A acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t len = std::min(kBlock, count - base);
    const S* s0 = static_cast<const S*>(srcsv[0]) + base;
    for (size_t i = 0; i < len; ++i) acc[i] = Traits::load(s0[i]);
    for (int j = 1; j < nsrc; ++j) {
      const S* sj = static_cast<const S*>(srcsv[j]) + base;
      for (size_t i = 0; i < len; ++i) {
        acc[i] = Op::apply(acc[i], Traits::load(sj[i]));
      }
    }
    if (average) {
      const A d = static_cast<A>(divisor);
      for (size_t i = 0; i < len; ++i) acc[i] = acc[i] / d;
    }
    S* out = dst + base;
    for (size_t i = 0; i < len; ++i) out[i] = Traits::store(acc[i]);
  }
}

template <typename Traits>
void dispatchOp(void* dst, const void* const* srcs, int nsrc, size_t count, ReduceOp op,
                int divisor) {
  switch (op) {
    case ReduceOp::kSum:
      return reduceBlocked<Traits, SumOp>(dst, srcs, nsrc, count, false, 1);
    case ReduceOp::kAvg:
      return reduceBlocked<Traits, SumOp>(dst, srcs, nsrc, count, true, divisor);
    case ReduceOp::kProduct:
      return reduceBlocked<Traits, ProdOp>(dst, srcs, nsrc, count, false, 1);
    case ReduceOp::kMin:
      return reduceBlocked<Traits, MinOp>(dst, srcs, nsrc, count, false, 1);
    case ReduceOp::kMax:
      return reduceBlocked<Traits, MaxOp>(dst, srcs, nsrc, count, false, 1);
    default:
      break;
  }
}

// bool is stored as one byte holding 0 or 1: SUM and MAX are logical or,
// PRODUCT and MIN logical and (as torch's NCCL backend treats them).
void reduceBool(void* dst, const void* const* srcs, int nsrc, size_t count, ReduceOp op) {
  const bool isOr = op == ReduceOp::kSum || op == ReduceOp::kMax;
  if (isOr) {
    reduceBlocked<Native<uint8_t>, MaxOp>(dst, srcs, nsrc, count, false, 1);
  } else {
    reduceBlocked<Native<uint8_t>, MinOp>(dst, srcs, nsrc, count, false, 1);
  }
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
  switch (dtype) {
    case DType::kFloat32:
      return dispatchOp<Native<float>>(dst, srcs, nsrc, count, op, divisor);
    case DType::kFloat64:
      return dispatchOp<Native<double>>(dst, srcs, nsrc, count, op, divisor);
    case DType::kFloat16:
      return dispatchOp<Half>(dst, srcs, nsrc, count, op, divisor);
    case DType::kBFloat16:
      return dispatchOp<BFloat>(dst, srcs, nsrc, count, op, divisor);
    case DType::kInt8:
      return dispatchOp<Native<int8_t>>(dst, srcs, nsrc, count, op, divisor);
    case DType::kUInt8:
      return dispatchOp<Native<uint8_t>>(dst, srcs, nsrc, count, op, divisor);
    case DType::kInt16:
      return dispatchOp<Native<int16_t>>(dst, srcs, nsrc, count, op, divisor);
    case DType::kInt32:
      return dispatchOp<Native<int32_t>>(dst, srcs, nsrc, count, op, divisor);
    case DType::kInt64:
      return dispatchOp<Native<int64_t>>(dst, srcs, nsrc, count, op, divisor);
    case DType::kBool:
      return reduceBool(dst, srcs, nsrc, count, op);
    default:
      return;
  }
}

}  // namespace dsp
