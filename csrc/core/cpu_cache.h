// The CPU's cache sizes, as sysfs reports them for cpu0: what the copy and
// chunk-size defaults are tuned to. Every rank of a host reads the same
// files, so every rank derives the same defaults.
//
// Plain C++17: no torch.
#pragma once

#include <cstddef>

namespace dsp {

// Bytes of cpu0's data (or unified) cache at `level` (1, 2, 3); 0 when sysfs
// does not say.
size_t cacheBytes(int level);

// Bytes of cpu0's deepest data cache (32 MiB when sysfs does not say).
// sysconf(_SC_LEVEL3_CACHE_SIZE) can report a whole socket's L3 inside a
// virtual machine (320 MiB on the reference machine, whose cores share
// 32 MiB); sysfs reports the cache this core shares.
size_t lastLevelCacheBytes();

}  // namespace dsp
