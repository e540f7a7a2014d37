"""What each benchmark measures, as files, and a hash of them: a result
records the hash of its benchmark's sources when it is measured
(``common.save``), and ``report.py`` marks the result stale once the same
files hash differently, so that a change re-measures the rows it touched.

A benchmark's sources are its own script, the build files, and the
package and C++ files on its measured path. The shared helpers
(``common.py``'s statistics and result files, ``launch.py``'s process
start) are left out: they change for bookkeeping far more often than for
what a number means, and a change to how they time is then re-measured by
hand. The lists are
prefixes of repository paths; a prefix starting with "!" takes files out of
what the others put in. They err on the side of more files: a row marked
stale that did not need to be costs a re-measurement, one left fresh that
should not have been is a wrong number.
"""

from __future__ import annotations

import hashlib
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# How every benchmark's code is built.
BUILD = ["setup.py", "CMakeLists.txt"]
# The shared-memory collectives under every "dsp" call: the torch-free core
# but for its pipeline plans and DDP buckets, and the backend over it.
BACKEND = [
    "csrc/core",
    "!csrc/core/pipeline",
    "!csrc/core/bucket",
    "csrc/backend",
    "dsparallel/backend.py",
    "dsparallel/_loader.py",
]
DDP = BACKEND + [
    "csrc/core/bucket",
    "csrc/ddp",
    "dsparallel/ddp.py",
    "dsparallel/comm_hooks.py",
    "dsparallel/mixed_precision.py",
]
# A whole model's step: everything but the serving and planning code.
TRAINING = [
    "csrc",
    "dsparallel",
    "!dsparallel/serve",
    "!dsparallel/inference",
    "!dsparallel/plan",
    "!dsparallel/convert.py",
]
DECODING = [
    "csrc/core",
    "!csrc/core/pipeline",
    "!csrc/core/bucket",
    "csrc/backend",
    "csrc/ops",
    "dsparallel",
    "!dsparallel/train",
    "!dsparallel/plan",
    "!dsparallel/convert.py",
    "!dsparallel/zero.py",
    "!dsparallel/ddp.py",
]

SOURCES: dict[str, tuple[str, list[str]]] = {
    # benchmark: (its script, what it measures besides BUILD)
    "floor": ("floor.py", BACKEND),
    "collectives": (
        "collectives.py",
        BACKEND
        + [
            "csrc/ops/all_reduce.cpp",
            "dsparallel/ops.py",
            "benchmarks/fresh.py",
            "benchmarks/mpi_collectives.py",
        ],
    ),
    "p2p": ("p2p.py", BACKEND + ["benchmarks/mpi_collectives.py", "benchmarks/fresh.py"]),
    "call_cpu": (
        "call_cpu.py",
        BACKEND + ["csrc/ops/all_reduce.cpp", "dsparallel/ops.py", "benchmarks/mpi_collectives.py"],
    ),
    "core_latency": ("core_latency.py", BACKEND + ["benchmarks/latency"]),
    "shm_size": ("shm_size.py", BACKEND),
    "ddp": ("ddp.py", DDP),
    "zero": ("zero.py", DDP + ["dsparallel/zero.py"]),
    "pipeline": (
        "pipeline.py",
        BACKEND
        + ["csrc/core/pipeline", "csrc/pipeline", "dsparallel/pipeline", "benchmarks/memory.py"],
    ),
    "tensor_parallel": (
        "tensor_parallel.py",
        BACKEND
        + [
            "csrc/ops/tp_maps.cpp",
            "csrc/ops/group_collectives",
            "dsparallel/tensor_parallel",
            "dsparallel/parallel_state.py",
        ],
    ),
    "moe": (
        "moe.py",
        BACKEND
        + [
            "csrc/ops/moe_dispatch.cpp",
            "csrc/ops/grouped_mlp.cpp",
            "csrc/ops/group_collectives",
            "dsparallel/moe",
            "dsparallel/parallel_state.py",
        ],
    ),
    "grouped_mlp": ("grouped_mlp.py", ["csrc/ops/grouped_mlp.cpp", "dsparallel/moe"]),
    "context_parallel": ("context_parallel.py", TRAINING),
    "hybrid": ("hybrid.py", TRAINING + ["examples/train_gpt.py"]),
    "models": ("models.py", TRAINING),
    "models_dtype": ("models.py", TRAINING),
    "trainer": ("trainer.py", TRAINING),
    "plan": ("plan.py", TRAINING + ["dsparallel/plan", "examples/train_gpt.py"]),
    "plan_2": ("plan.py", TRAINING + ["dsparallel/plan", "examples/train_gpt.py"]),
    "inference": ("inference.py", DECODING + ["!dsparallel/serve"]),
    "serve": ("serve.py", DECODING + ["benchmarks/inference.py"]),
    "quantization": ("quantization.py", DECODING),
    "gpu": ("gpu.py", DDP + ["csrc/ops", "dsparallel/tensor_parallel"]),
}


def _git(*args: str, stdin: str | None = None) -> str:
    return subprocess.run(
        ["git", "-C", ROOT, *args], input=stdin, capture_output=True, text=True, check=True
    ).stdout


def _matches(path: str, prefixes: list[str]) -> bool:
    def under(p: str) -> bool:
        return path == p or path.startswith(p.rstrip("/") + "/")

    take = [p for p in prefixes if not p.startswith("!")]
    drop = [p[1:] for p in prefixes if p.startswith("!")]
    return any(under(p) for p in take) and not any(under(p) for p in drop)


def paths(benchmark: str) -> list[str]:
    script, measured = SOURCES[benchmark]
    return [f"benchmarks/{script}", *BUILD, *measured]


def sources(benchmark: str, commit: str | None = None) -> dict[str, str]:
    """The benchmark's source files and their git blob ids: as they are in
    the working tree (tracked and untracked, not ignored), or at ``commit``."""
    prefixes = paths(benchmark)
    if commit:
        listing = [line.split(None, 3) for line in _git("ls-tree", "-r", commit).splitlines()]
        return {path: blob for _, _, blob, path in listing if _matches(path, prefixes)}
    files = _git("ls-files", "--cached", "--others", "--exclude-standard").splitlines()
    files = sorted(
        f for f in set(files) if _matches(f, prefixes) and os.path.exists(os.path.join(ROOT, f))
    )
    ids = _git("hash-object", "--stdin-paths", stdin="\n".join(files) + "\n").split()
    return dict(zip(files, ids))


def sources_hash(benchmark: str, commit: str | None = None) -> str:
    """One hash of ``sources(benchmark, commit)``."""
    text = "".join(f"{path} {blob}\n" for path, blob in sorted(sources(benchmark, commit).items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
