"""``calibrate(devices)``: this machine as a cluster, measured with
``devices`` processes running at once (as a job's ranks do, so that they
share the cores as they will): each process's matmul FLOP/s (one thread,
as torchrun gives a rank), the cost of an eager op with its backward, the
"dsp" all-reduce's latency and bandwidth, and AdamW's time per
parameter."""

from __future__ import annotations

import os
import statistics
import time

from ..spawn import run_ranks
from .cluster import Cluster

SIZES = (64, 128, 256, 512, 1024)  # matmul sizes measured (n x n x n)


def _timed(fn, seconds: float = 0.5) -> float:
    """Seconds per call of ``fn``: the median of 5 timings of enough calls
    to fill ``seconds`` / 5."""
    fn()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds / 10:
        fn()
        n += 1
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


def _timed_together(fn, calls: int) -> float:
    """Seconds per call of a collective ``fn``: every rank makes the same
    number of calls (a time-based count would differ between ranks)."""
    import torch.distributed as dist

    fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def _rank(rank: int, world: int, dtype: str) -> list | None:
    """This rank's measurements; rank 0 returns every rank's."""
    import torch
    import torch.distributed as dist

    import dsparallel  # noqa: F401  (registers "dsp")

    torch.set_num_threads(1)
    dist.init_process_group("dsp")
    dt = getattr(torch, dtype)
    # The ranks' own work is measured on as many ranks at once as there
    # are cores (one core each: the speed a rank has while it has a core);
    # the planner shares the cores out between a host's ranks itself.
    computing = rank < min(world, os.cpu_count() or 1)
    table, flops, bandwidth, op, per_param = [], None, None, None, None
    for n in SIZES:
        a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
        dist.barrier()
        if computing:
            table.append((n, 2 * n**3 / _timed(lambda a=a, b=b: torch.mm(a, b), 0.3)))
    x = torch.randn(8 << 20, dtype=dt)
    y = torch.empty_like(x)
    dist.barrier()
    if computing:
        flops = max(f for _, f in table)
        bandwidth = 2 * x.numel() * x.element_size() / _timed(lambda: y.copy_(x), 0.3)
    chain = 20
    x0 = torch.randn(16, requires_grad=True)

    def ops():
        x = x0
        for _ in range(chain):
            x = x * 1.0001
        x.sum().backward()

    dist.barrier()
    if computing:
        op = _timed(ops) / (3 * chain)  # a forward op, its input and weight gradients
    small, big = torch.zeros(2), torch.zeros(4 * 1024 * 1024)
    steps = 2 * (world - 1)
    # The latency a step sees: every rank comes to the all-reduce from work
    # of its own (and, with more ranks than cores, after waiting for a
    # core), not from a tight loop of all-reduces, which keeps them in step.
    m = torch.randn(96, 96, dtype=dt)

    def work():
        for _ in range(8):
            torch.mm(m, m)

    def work_then_reduce():
        work()
        dist.all_reduce(small)

    waits = []
    for _ in range(3):
        dist.barrier()
        alone = _timed_together(work, 200)
        waits.append(_timed_together(work_then_reduce, 200) - alone)
    alpha = max(statistics.median(waits), 0.0) / max(1, steps)
    t_big = statistics.median(_timed_together(lambda: dist.all_reduce(big), 8) for _ in range(3))
    moved = steps / world * big.numel() * big.element_size()
    beta = moved / max(1e-9, t_big - steps * alpha)
    # AdamW at a size past the caches, as a model's parameters are: its
    # step then runs at the memory's speed.
    params = [torch.nn.Parameter(torch.randn(4 << 20, dtype=dt))]
    params[0].grad = torch.randn_like(params[0])
    opt = torch.optim.AdamW(params, lr=1e-4)
    dist.barrier()
    if computing:
        per_param = _timed(opt.step) / params[0].numel()
    rows = [None] * world
    dist.all_gather_object(rows, (rank, flops, op, alpha, beta, per_param, bandwidth, table))
    dist.destroy_process_group()
    return rows if rank == 0 else None


def calibrate(devices: int = 4, dtype: str = "float32", path: str | None = None) -> Cluster:
    """Measures this machine with ``devices`` ranks at once; writes the
    cluster to ``path`` (JSON) if given."""
    rows = run_ranks(_rank, devices, dtype)
    comm = list(zip(*rows))
    alpha, beta = statistics.median(comm[3]), statistics.median(comm[4])
    own = list(zip(*[r for r in rows if r[1] is not None]))
    flops, op, per_param, bandwidth = (statistics.median(own[i]) for i in (1, 2, 5, 6))
    tables = own[7]
    cores = os.cpu_count() or 1
    by_size = tuple((n, statistics.median(t[i][1] for t in tables)) for i, n in enumerate(SIZES))
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    cluster = Cluster(
        name=f"this machine ({os.cpu_count()} cores, {devices} ranks)",
        devices_per_host=devices,
        hosts=1,
        memory_bytes=total / devices,
        flops=flops,
        intra_bandwidth=beta,
        intra_latency=alpha,
        inter_bandwidth=beta,
        inter_latency=alpha,
        op_overhead=op,
        optimizer_per_param=per_param,
        async_launch=False,
        flops_by_size=by_size,
        memory_bandwidth=bandwidth,
        cores_per_host=cores if cores < devices else 0,
        source=f"dsparallel.plan.calibrate(devices={devices}, dtype={dtype!r}): measured, "
        f"{devices} processes at once, one thread each; their own work on "
        f"{min(devices, cores)} of them at once (one core each)",
    )
    if path:
        cluster.to_json(path)
    return cluster
