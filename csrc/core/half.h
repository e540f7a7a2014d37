// IEEE half and bfloat16 <-> float conversions (round to nearest even), so
// that the core needs no torch header. Inline: they sit in reduction loops.
#pragma once

#include <cstdint>
#include <cstring>

namespace dsp {

inline uint32_t floatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float bitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float bfloat16ToFloat(uint16_t v) {
  return bitsFloat(static_cast<uint32_t>(v) << 16);
}

inline uint16_t floatToBfloat16(float f) {
  uint32_t u = floatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays NaN
  const uint32_t roundingBias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + roundingBias) >> 16);
}

// Same algorithm as the fp16 library torch vendors (Maratea's method): float
// arithmetic does the rounding, so it is exact and branch-light.
inline float halfToFloat(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  constexpr uint32_t kExpOffset = 0xE0u << 23;
  const float kExpScale = bitsFloat(0x7800000u);  // 2^-112
  const float normalized = bitsFloat((two_w >> 4) + kExpOffset) * kExpScale;
  constexpr uint32_t kMagicMask = 126u << 23;
  constexpr float kMagicBias = 0.5f;
  const float denormalized = bitsFloat((two_w >> 17) | kMagicMask) - kMagicBias;
  constexpr uint32_t kDenormCutoff = 1u << 27;
  const uint32_t result =
      sign | (two_w < kDenormCutoff ? floatBits(denormalized) : floatBits(normalized));
  return bitsFloat(result);
}

inline uint16_t floatToHalf(float f) {
  const float kScaleToInf = bitsFloat(0x77800000u);   // 2^112
  const float kScaleToZero = bitsFloat(0x08800000u);  // 2^-110
  float base = (f < 0 ? -f : f) * kScaleToInf * kScaleToZero;
  const uint32_t w = floatBits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bitsFloat((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = floatBits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

}  // namespace dsp
