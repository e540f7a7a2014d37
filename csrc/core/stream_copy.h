// Copies for destinations too large to stay in the cache.
//
// A plain copy first reads every destination line into the cache (to own
// it), then writes it back out: three passes over memory for a two-pass job,
// and the cache ends up full of lines nobody reads soon. Non-temporal
// stores write the lines straight to memory. Measured on the 2-core
// reference machine (32 MiB L3), copying 512 KiB pieces into a 32-64 MiB
// destination: 12 GB/s with memcpy, 25-27 GB/s streamed; into 8 MiB, which
// stays in the cache, memcpy is faster (41 against 27 GB/s).
//
// Plain C++17: no torch.
#pragma once

#include <cstddef>

namespace dsp {

// memcpy through non-temporal stores where the CPU has them (x86-64; plain
// memcpy elsewhere), fenced before it returns, so that the bytes are visible
// to whoever this thread signals next. dst and src must not overlap.
void streamCopy(void* dst, const void* src, size_t n);

// memcpy or streamCopy.
inline void copyOut(void* dst, const void* src, size_t n, bool stream) {
  if (stream) {
    streamCopy(dst, src, n);
  } else {
    __builtin_memcpy(dst, src, n);
  }
}

// Half the last-level cache, as sysfs reports it for cpu0 (32 MiB assumed
// when it cannot be read): a collective that writes this much into its
// output streams the writes.
size_t defaultStreamMinBytes();

}  // namespace dsp
