#!/usr/bin/env bash
# Builds the extension (the core with it) under AddressSanitizer and
# UndefinedBehaviorSanitizer and runs a chosen part of the pytest suite on
# it, in real processes: collectives, point-to-point (cancelled receives,
# killed peers, bounded unexpected messages), DDP, ZeRO, every pipeline
# schedule with its failure paths, MoE, context-parallel attention. Any
# report fails the run.
#
# The instrumented extension goes into a package of its own under
# build/asan (the installed one is untouched); the tests run from there, so
# that `import dsparallel` finds it, with the ASan runtime preloaded into
# the (uninstrumented) Python and every rank it forks.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=$ROOT/build/asan

DSP_SANITIZE=address,undefined "$PY" setup.py -q build_ext --build-lib "$OUT/lib" \
  >"$OUT.build.log" 2>&1 || { cat "$OUT.build.log"; exit 1; }
rm -rf "$OUT/pkg"
mkdir -p "$OUT/pkg"
cp -r dsparallel dsparallel_autoload.py "$OUT/pkg/"
rm -f "$OUT"/pkg/dsparallel/_C*.so
cp "$OUT"/lib/dsparallel/_C*.so "$OUT/pkg/dsparallel/"

# libstdc++ with it: ASan intercepts __cxa_throw and finds the real one only
# in a library loaded before the first throw (Python itself links none).
export LD_PRELOAD
LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so)"
# Python and torch allocate for good at exit (no leak checking); torch's own
# libraries are not instrumented, so new/delete pairs may cross them.
export ASAN_OPTIONS="detect_leaks=0:alloc_dealloc_mismatch=0:abort_on_error=1:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
cd "$OUT/pkg"
"$PY" -c 'import dsparallel._C as c, sys; assert "/build/asan/" in c.__file__, c.__file__'
T=$ROOT/tests/python
# Every schedule once, the failure paths of each kind; ZeRO without its
# checkpoint round trips (file I/O, no new code path in C++); the MoE layer
# and its ops but not the GPT trained over them (the same C++ paths); 60 of
# the random fault runs (the plain stage runs all 200).
export DSP_FAULT_RUNS=60
PIPELINE="failed_step or exception or two_pipelines or shape_change or activation_routes"
PIPELINE+=" or non_contiguous or tied or gradients_equal and (gpipe-2-2-2 or 1f1b-4-4-8"
PIPELINE+=" or interleaved_1f1b-2-4-4 or zb1p-2-4-8 or zbv-2-4-8 or dualpipev-3-6-8)"
"$PY" -m pytest -q -p no:cacheprovider --rootdir "$T" "$@" \
  "$T/test_collectives.py" "$T/test_faults.py" "$T/test_review_holes.py" \
  "$T/test_groups_async.py" "$T/test_ddp.py" "$T/test_moe.py" \
  "$T/test_zero.py::test_adamw_with_clipping_equals_one_process_and_torch_zero" \
  "$T/test_pipeline.py" "$T/test_context_parallel.py" -k "not torchrun and not plot and not cuda and not gpu and not moe_gpt and (not test_pipeline or $PIPELINE)"
