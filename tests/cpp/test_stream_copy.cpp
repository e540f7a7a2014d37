// streamCopy against memcpy: every alignment of both ends, sizes around the
// plain-copy cut-off and the 64-byte loop, and bytes outside left alone.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "core/stream_copy.h"

namespace dsp {
namespace {

TEST(StreamCopy, EqualsMemcpyForEveryAlignmentAndSize) {
  std::vector<uint8_t> src(5000), dst(5200);  // dst: room for the largest offset
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 31 + 7);
  for (size_t s_off = 0; s_off < 16; s_off += 3) {
    for (size_t d_off : {0, 1, 2, 7, 15, 16, 17, 31, 48, 63, 64, 65, 100}) {
      for (size_t n : {0, 1, 15, 255, 256, 271, 319, 320, 1000, 4096, 4999 - 15}) {
        std::fill(dst.begin(), dst.end(), 0xAB);
        streamCopy(dst.data() + d_off, src.data() + s_off, n);
        for (size_t i = 0; i < dst.size(); ++i) {
          const bool inside = i >= d_off && i < d_off + n;
          ASSERT_EQ(dst[i], inside ? src[s_off + i - d_off] : 0xAB)
              << "src+" << s_off << " dst+" << d_off << " n=" << n << " byte " << i;
        }
      }
    }
  }
}

TEST(StreamCopy, DefaultThresholdIsAPlausibleHalfCache) {
  const size_t bytes = defaultStreamMinBytes();
  EXPECT_GE(bytes, size_t{64} << 10);
  EXPECT_LE(bytes, size_t{4} << 30);
}

}  // namespace
}  // namespace dsp
