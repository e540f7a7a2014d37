"""The devices a plan is for: how many, their memory and speed, and the
links between them. A cluster is a JSON file (``calibrate()`` writes one
for this machine) or a preset."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Cluster:
    name: str
    devices_per_host: int
    hosts: int
    memory_bytes: float  # per device
    flops: float  # per device, dense matmul in the training dtype, FLOP/s
    intra_bandwidth: float  # bytes/s per device within a host (all-reduce bus bandwidth)
    intra_latency: float  # seconds per collective step within a host
    inter_bandwidth: float  # bytes/s per device between hosts
    inter_latency: float
    op_overhead: float = 0.0  # seconds per kernel launch / eager op
    optimizer_per_param: float = 0.0  # seconds per parameter of an AdamW step
    # GPUs launch kernels asynchronously: an op costs the longer of its
    # launch and its kernel. On a CPU the eager dispatch and the kernel run
    # one after the other on the rank's thread.
    async_launch: bool = False
    # Measured matmul FLOP/s by size ([[n, FLOP/s], ...] for n x n x n; a
    # matmul's size is the cube root of m k n): small matmuls run below the
    # peak. Empty: ``flops`` at every size.
    flops_by_size: tuple = ()
    # Bytes/s a device reads and writes in elementwise ops (norms,
    # activations, softmax, copies): they move the activations. 0: not
    # modelled (a GPU's are small beside its matmuls at these FLOP/s).
    memory_bandwidth: float = 0.0
    # A host with fewer cores than ranks (a CPU cluster, oversubscribed):
    # the ranks share the cores, so a step takes at least the host's ranks'
    # work over its cores. 0: every device computes on its own.
    cores_per_host: int = 0
    source: str = ""  # where the figures come from

    @property
    def devices(self) -> int:
        return self.devices_per_host * self.hosts

    def flops_at(self, size: float) -> float:
        """Matmul FLOP/s at ``size`` (log-linear between the measured
        sizes, the nearest one beyond them)."""
        table = sorted(self.flops_by_size)
        if not table:
            return self.flops
        if size <= table[0][0]:
            return table[0][1]
        for (n0, f0), (n1, f1) in zip(table, table[1:]):
            if size <= n1:
                w = math.log(size / n0) / math.log(n1 / n0)
                return f0 + w * (f1 - f0)
        return table[-1][1]

    def to_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=2)


_REQUIRED = [f.name for f in dataclasses.fields(Cluster) if f.default is dataclasses.MISSING]


# Vendor figures (NVIDIA's data sheets), stated as such: dense BF16 tensor
# FLOP/s; NVLink bandwidth per direction; 8 x 400 Gb/s InfiniBand per host
# (50 GB/s per device). Latencies are typical NCCL figures, not measured.
def _preset(name, memory_gb, tflops, nvlink_gb, ib_gb, source):
    return Cluster(
        name=name,
        devices_per_host=8,
        hosts=1,
        memory_bytes=memory_gb * GB,
        flops=tflops * 1e12,
        intra_bandwidth=nvlink_gb * GB,
        intra_latency=5e-6,
        inter_bandwidth=ib_gb * GB,
        inter_latency=10e-6,
        op_overhead=5e-6,
        optimizer_per_param=2e-12,
        async_launch=True,
        source=source,
    )


PRESETS = {
    "h100-80gb-sxm": _preset(
        "h100-80gb-sxm",
        80,
        989,
        450,
        50,
        "NVIDIA H100 SXM data sheet: 989 TFLOP/s dense BF16, NVLink 900 GB/s (450 GB/s per "
        "direction), 80 GB HBM3; InfiniBand NDR 400 Gb/s per GPU",
    ),
    "a100-80gb-sxm": _preset(
        "a100-80gb-sxm",
        80,
        312,
        300,
        25,
        "NVIDIA A100 data sheet: 312 TFLOP/s dense BF16, NVLink 600 GB/s (300 GB/s per "
        "direction), 80 GB HBM2e; InfiniBand HDR 200 Gb/s per GPU",
    ),
    "a100-40gb-sxm": _preset(
        "a100-40gb-sxm",
        40,
        312,
        300,
        25,
        "NVIDIA A100 data sheet: 312 TFLOP/s dense BF16, NVLink 600 GB/s (300 GB/s per "
        "direction), 40 GB HBM2; InfiniBand HDR 200 Gb/s per GPU",
    ),
}


def read_cluster(spec, hosts: int | None = None) -> Cluster:
    """A preset's name (``hosts`` of them, 1 by default), a path to a
    cluster JSON file, a dict, or a Cluster."""
    if isinstance(spec, Cluster):
        cluster = spec
    elif isinstance(spec, str) and spec in PRESETS:
        cluster = PRESETS[spec]
    elif isinstance(spec, (str, os.PathLike)):
        if not os.path.isfile(spec):
            raise ValueError(
                f"plan: cluster {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a file"
            )
        with open(spec) as f:
            cluster = _from_dict(json.load(f), str(spec))
    elif isinstance(spec, dict):
        cluster = _from_dict(spec, "the cluster dict")
    else:
        raise TypeError(f"plan: a cluster is a preset name, a JSON path or a dict, got {spec!r}")
    if hosts is not None:
        cluster = dataclasses.replace(cluster, hosts=hosts)
    return cluster


def _from_dict(values: dict, where: str) -> Cluster:
    missing = [k for k in _REQUIRED if k not in values]
    if missing:
        raise ValueError(f"plan: {where} lacks the field(s) {', '.join(missing)}")
    known = {f.name for f in dataclasses.fields(Cluster)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"plan: {where} has unknown field(s) {', '.join(unknown)}")
    for k in _REQUIRED[1:]:
        if not isinstance(values[k], (int, float)) or values[k] <= 0:
            raise ValueError(f"plan: {where}: {k} must be a positive number, got {values[k]!r}")
    if "flops_by_size" in values:
        values = {**values, "flops_by_size": tuple(tuple(p) for p in values["flops_by_size"])}
    return Cluster(**values)
