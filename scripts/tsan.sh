#!/usr/bin/env bash
# Builds under ThreadSanitizer and runs: the core's GoogleTest suite (ranks
# as threads, a caller thread beside a worker thread), then the harness that
# drives the backend, the DDP reducer and the pipeline runtime from several
# threads without Python (tests/tsan, linked against libtorch). A data race
# between threads, or a failed check, fails this step.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" >/dev/null
cmake --build build-tsan
# halt_on_error: the first race fails the run, with its report.
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
./build-tsan/dsp_core_tests

cmake -S tests/tsan -B build/tsan-harness -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_PREFIX_PATH="$(${PYTHON:-python3} -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
  -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" >/dev/null
cmake --build build/tsan-harness
./build/tsan-harness/dsp_tsan_harness
