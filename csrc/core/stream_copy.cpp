#include "stream_copy.h"

#include <cstdint>
#include <cstring>

#include "cpu_cache.h"

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace dsp {

void streamCopy(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  // Up to the first line boundary of dst plainly (the streaming stores need
  // 16-byte alignment, and whole lines leave the write-combining buffers
  // fastest), then a line per iteration, the rest plainly.
  const size_t head = (64 - reinterpret_cast<uintptr_t>(d) % 64) % 64;
  if (n < head + 256) {
    std::memcpy(d, s, n);
    return;
  }
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  for (; n >= 64; d += 64, s += 64, n -= 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
  }
  std::memcpy(d, s, n);
  // Non-temporal stores are weakly ordered: without the fence a later
  // release store (the step word a peer waits on, a future's completion)
  // could become visible before them.
  _mm_sfence();
#else
  std::memcpy(dst, src, n);
#endif
}

size_t defaultStreamMinBytes() {
  // Read once: every process group of the job asks when it is made.
  static const size_t bytes = lastLevelCacheBytes() / 2;
  return bytes;
}

}  // namespace dsp
