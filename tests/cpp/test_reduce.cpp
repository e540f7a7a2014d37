// Reduction kernels against closed forms, every dtype x op, sizes around the
// accumulator block.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/half.h"
#include "core/reduce.h"

namespace dsp {
namespace {

const std::vector<size_t> kSizes = {0, 1, 7, 4095, 4096, 4097, 10001};

template <typename T>
void checkIntegral(DType dt) {
  for (size_t n : kSizes) {
    for (int nsrc : {1, 2, 3, 5}) {
      std::vector<std::vector<T>> in(nsrc, std::vector<T>(n));
      for (int j = 0; j < nsrc; ++j)
        for (size_t i = 0; i < n; ++i) in[j][i] = static_cast<T>((j + 1) + (i % 3));
      std::vector<const void*> srcs;
      for (auto& v : in) srcs.push_back(v.data());
      std::vector<T> out(n);
      reduceInto(out.data(), srcs.data(), nsrc, n, dt, ReduceOp::kSum, nsrc);
      for (size_t i = 0; i < n; ++i) {
        const long expect = nsrc * (nsrc + 1) / 2 + nsrc * static_cast<long>(i % 3);
        ASSERT_EQ(out[i], static_cast<T>(expect)) << dtypeName(dt) << " i=" << i;
      }
      reduceInto(out.data(), srcs.data(), nsrc, n, dt, ReduceOp::kMax, nsrc);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], static_cast<T>(nsrc + i % 3));
      reduceInto(out.data(), srcs.data(), nsrc, n, dt, ReduceOp::kMin, nsrc);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], static_cast<T>(1 + i % 3));
      reduceInto(out.data(), srcs.data(), nsrc, n, dt, ReduceOp::kProduct, nsrc);
      for (size_t i = 0; i < n; ++i) {
        long p = 1;
        for (int j = 0; j < nsrc; ++j) p *= (j + 1) + static_cast<long>(i % 3);
        ASSERT_EQ(out[i], static_cast<T>(p));
      }
    }
  }
}

TEST(Reduce, Integers) {
  checkIntegral<int8_t>(DType::kInt8);
  checkIntegral<uint8_t>(DType::kUInt8);
  checkIntegral<int16_t>(DType::kInt16);
  checkIntegral<int32_t>(DType::kInt32);
  checkIntegral<int64_t>(DType::kInt64);
}

template <typename T>
void checkFloating(DType dt) {
  for (size_t n : kSizes) {
    for (int nsrc : {1, 2, 4}) {
      std::vector<std::vector<T>> in(nsrc, std::vector<T>(n));
      for (int j = 0; j < nsrc; ++j)
        for (size_t i = 0; i < n; ++i) in[j][i] = static_cast<T>(j + 1) * T(0.5);
      std::vector<const void*> srcs;
      for (auto& v : in) srcs.push_back(v.data());
      std::vector<T> out(n);
      reduceInto(out.data(), srcs.data(), nsrc, n, dt, ReduceOp::kAvg, nsrc);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], T(0.25) * (nsrc + 1));
      // in place: dst aliases the first source
      reduceInto(in[0].data(), srcs.data(), nsrc, n, dt, ReduceOp::kSum, nsrc);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(in[0][i], T(0.25) * nsrc * (nsrc + 1));
    }
  }
}

TEST(Reduce, Floating) {
  checkFloating<float>(DType::kFloat32);
  checkFloating<double>(DType::kFloat64);
}

TEST(Reduce, HalfAndBFloatAccumulateInFloat) {
  // 1 + 2^-11 * k is not representable in fp16 per term, but the fp32
  // accumulation of 4 terms of 1.0 plus small parts rounds once.
  for (DType dt : {DType::kFloat16, DType::kBFloat16}) {
    const bool isHalf = dt == DType::kFloat16;
    auto enc = [&](float f) { return isHalf ? floatToHalf(f) : floatToBfloat16(f); };
    auto dec = [&](uint16_t h) { return isHalf ? halfToFloat(h) : bfloat16ToFloat(h); };
    for (size_t n : kSizes) {
      std::vector<std::vector<uint16_t>> in(3, std::vector<uint16_t>(n));
      for (int j = 0; j < 3; ++j)
        for (size_t i = 0; i < n; ++i) in[j][i] = enc(static_cast<float>(j + 1) + 0.5f);
      std::vector<const void*> srcs = {in[0].data(), in[1].data(), in[2].data()};
      std::vector<uint16_t> out(n);
      reduceInto(out.data(), srcs.data(), 3, n, dt, ReduceOp::kSum, 3);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(dec(out[i]), 7.5f);
      reduceInto(out.data(), srcs.data(), 3, n, dt, ReduceOp::kMax, 3);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(dec(out[i]), 3.5f);
    }
  }
}

TEST(Reduce, HalfConversionRoundTrips) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = halfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(floatToHalf(f), h) << h;
  }
  EXPECT_EQ(halfToFloat(floatToHalf(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(halfToFloat(floatToHalf(1e6f))));
  EXPECT_EQ(bfloat16ToFloat(floatToBfloat16(1.0f + 1.0f / 256)), 1.0f);  // ties to even
}

TEST(Reduce, BoolIsLogical) {
  std::vector<uint8_t> a = {0, 1, 0, 1}, b = {0, 0, 1, 1}, out(4);
  std::vector<const void*> srcs = {a.data(), b.data()};
  reduceInto(out.data(), srcs.data(), 2, 4, DType::kBool, ReduceOp::kSum, 2);
  EXPECT_EQ(out, (std::vector<uint8_t>{0, 1, 1, 1}));
  reduceInto(out.data(), srcs.data(), 2, 4, DType::kBool, ReduceOp::kProduct, 2);
  EXPECT_EQ(out, (std::vector<uint8_t>{0, 0, 0, 1}));
}

TEST(Reduce, UnsupportedCombinationsAreNamed) {
  EXPECT_EQ(unsupportedReason(DType::kFloat32, ReduceOp::kAvg), "");
  const std::string why = unsupportedReason(DType::kInt32, ReduceOp::kAvg);
  EXPECT_NE(why.find("AVG"), std::string::npos);
  EXPECT_NE(why.find("int32"), std::string::npos);
}

// Bits equal, except that where both results are NaN either may be the
// other's payload or sign: which operand's NaN an add or multiply of two NaNs
// propagates is the hardware's rule (IEEE 754 allows either), and the
// compiler may commute the operands.
bool isNan(const uint8_t* p, DType dt) {
  switch (dt) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return std::isnan(f);
    }
    case DType::kFloat64: {
      double f;
      std::memcpy(&f, p, 8);
      return std::isnan(f);
    }
    case DType::kFloat16:
    case DType::kBFloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return std::isnan(dt == DType::kFloat16 ? halfToFloat(h) : bfloat16ToFloat(h));
    }
    default:
      return false;
  }
}

bool sameResult(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, DType dt) {
  const size_t es = elementSize(dt);
  for (size_t i = 0; i < a.size(); i += es) {
    if (std::memcmp(&a[i], &b[i], es) != 0 && !(isNan(&a[i], dt) && isNan(&b[i], dt)))
      return false;
  }
  return a.size() == b.size();
}

// The AVX2 and AVX-512 builds of the kernels give the baseline build's bits: random
// values (NaN, infinities, subnormals in the mix), every dtype and op, 1-5
// sources, sizes around the block and the vector widths, out of place and in
// place.
TEST(Reduce, VectorBuildsEqualGenericToTheBit) {
  std::vector<uint8_t> probe(8);
  const void* one[] = {probe.data()};
  std::vector<const char*> wide;
  for (const char* k : {"avx2", "avx512"}) {
    if (reduceIntoWith(k, probe.data(), one, 1, 1, DType::kUInt8, ReduceOp::kSum, 1))
      wide.push_back(k);
  }
  if (wide.empty()) GTEST_SKIP() << "no vector build for this CPU";
  uint64_t state = 0x9E3779B97F4A7C15ull;
  auto next = [&state] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  for (uint32_t d = 0; d < static_cast<uint32_t>(DType::kNumDTypes); ++d) {
    const DType dt = static_cast<DType>(d);
    const size_t es = elementSize(dt);
    for (uint32_t o = 0; o < static_cast<uint32_t>(ReduceOp::kNumOps); ++o) {
      const ReduceOp op = static_cast<ReduceOp>(o);
      if (!unsupportedReason(dt, op).empty()) continue;
      for (size_t n : {size_t{1}, size_t{15}, size_t{4097}, size_t{9000}}) {
        for (int nsrc = 1; nsrc <= 5; ++nsrc) {
          std::vector<std::vector<uint8_t>> in(nsrc, std::vector<uint8_t>(n * es));
          for (auto& v : in) {
            for (auto& b : v) b = static_cast<uint8_t>(next());
            if (dt == DType::kBool)
              for (auto& b : v) b &= 1;
          }
          std::vector<const void*> srcs;
          for (auto& v : in) srcs.push_back(v.data());
          std::vector<uint8_t> a(n * es);
          ASSERT_TRUE(
              reduceIntoWith("generic", a.data(), srcs.data(), nsrc, n, dt, op, nsrc));
          for (const char* k : wide) {
            std::vector<uint8_t> b(n * es);
            ASSERT_TRUE(reduceIntoWith(k, b.data(), srcs.data(), nsrc, n, dt, op, nsrc));
            ASSERT_TRUE(sameResult(a, b, dt))
                << k << " " << dtypeName(dt) << " " << reduceOpName(op) << " n=" << n
                << " nsrc=" << nsrc;
            // in place, into the last source
            std::vector<uint8_t> last = in.back();
            srcs.back() = last.data();
            ASSERT_TRUE(
                reduceIntoWith(k, last.data(), srcs.data(), nsrc, n, dt, op, nsrc));
            srcs.back() = in.back().data();
            ASSERT_TRUE(sameResult(a, last, dt))
                << k << " in place " << dtypeName(dt) << " " << reduceOpName(op)
                << " n=" << n << " nsrc=" << nsrc;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace dsp
