#include "stream_copy.h"

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

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

namespace {

// "32768K", "32M" or a plain number of bytes; 0 when unreadable.
size_t readCacheSize(const std::string& dir) {
  std::ifstream f(dir + "/size");
  std::string text;
  if (!(f >> text) || text.empty()) return 0;
  size_t value = 0;
  size_t i = 0;
  for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i) {
    value = value * 10 + static_cast<size_t>(text[i] - '0');
  }
  if (i < text.size() && (text[i] == 'K' || text[i] == 'k')) value <<= 10;
  if (i < text.size() && (text[i] == 'M' || text[i] == 'm')) value <<= 20;
  return value;
}

// sysconf(_SC_LEVEL3_CACHE_SIZE) can report a whole socket's L3 inside a
// virtual machine (320 MiB on the reference machine, whose cores share
// 32 MiB); sysfs reports the cache this core shares.
size_t readLastLevelCacheBytes() {
  size_t llc = 0;
  int best_level = 0;
  for (int i = 0; i < 8; ++i) {
    const std::string dir =
        "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i);
    std::ifstream level_file(dir + "/level");
    int level = 0;
    if (!(level_file >> level)) break;
    std::ifstream type_file(dir + "/type");
    std::string type;
    type_file >> type;
    if (type == "Instruction" || level < best_level) continue;
    const size_t bytes = readCacheSize(dir);
    if (bytes) llc = bytes, best_level = level;
  }
  return llc ? llc : size_t{32} << 20;
}

}  // namespace

size_t defaultStreamMinBytes() {
  // Read once: every process group of the job asks when it is made.
  static const size_t bytes = readLastLevelCacheBytes() / 2;
  return bytes;
}

}  // namespace dsp
