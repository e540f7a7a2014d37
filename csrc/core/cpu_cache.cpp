#include "cpu_cache.h"

#include <fstream>
#include <string>

namespace dsp {
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

// Calls fn(level, bytes) for each of cpu0's data and unified caches.
template <typename Fn>
void forEachDataCache(Fn&& fn) {
  for (int i = 0; i < 8; ++i) {
    const std::string dir =
        "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i);
    std::ifstream level_file(dir + "/level");
    int level = 0;
    if (!(level_file >> level)) break;
    std::ifstream type_file(dir + "/type");
    std::string type;
    type_file >> type;
    if (type == "Instruction") continue;
    fn(level, readCacheSize(dir));
  }
}

}  // namespace

size_t cacheBytes(int level) {
  size_t found = 0;
  forEachDataCache([&](int l, size_t bytes) {
    if (l == level && bytes) found = bytes;
  });
  return found;
}

size_t lastLevelCacheBytes() {
  size_t llc = 0;
  int best_level = 0;
  forEachDataCache([&](int level, size_t bytes) {
    if (bytes && level >= best_level) llc = bytes, best_level = level;
  });
  return llc ? llc : size_t{32} << 20;
}

}  // namespace dsp
