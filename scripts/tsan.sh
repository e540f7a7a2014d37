#!/usr/bin/env bash
# Builds the core's GoogleTest suite under ThreadSanitizer and runs it: the
# tests drive the core as the backend does (ranks as threads, a caller thread
# beside a worker thread), so a data race between threads fails this step.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" >/dev/null
cmake --build build-tsan
# halt_on_error: the first race fails the run, with its report.
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ${TSAN_OPTIONS:-}" \
  ./build-tsan/dsp_core_tests
