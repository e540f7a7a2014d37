"""CUDA tensors through "dsp" (torch's NCCL group underneath), held against
the same computation on the CPU. Skipped without a GPU (CI has none); run by
scripts/gpu_check.sh on a machine with one. One rank per GPU, at most two."""

import copy

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch import nn

import dsparallel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _world():
    return max(1, min(2, torch.cuda.device_count()))


def _collectives_body(rank, world):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    for n in (1, 1000, 1 << 20):
        t = torch.arange(n, device=dev, dtype=torch.float32) * (rank + 1)
        dist.all_reduce(t)
        want = torch.arange(n, dtype=torch.float32) * sum(r + 1 for r in range(world))
        torch.testing.assert_close(t.cpu(), want)
    b = torch.full((10,), float(rank), device=dev)
    dist.broadcast(b, src=0)
    assert torch.equal(b.cpu(), torch.zeros(10))
    outs = [torch.empty(4, device=dev) for _ in range(world)]
    dist.all_gather(outs, torch.full((4,), float(rank), device=dev))
    assert all(torch.equal(o.cpu(), torch.full((4,), float(r))) for r, o in enumerate(outs))
    # Mixed use of one group: CPU tensors still go over shared memory.
    c = torch.ones(5)
    dist.all_reduce(c)
    assert torch.equal(c, torch.full((5,), float(world)))
    # Async work and its future complete with CUDA tensors.
    w = dist.all_reduce(torch.ones(3, device=dev), async_op=True)
    w.wait()
    w.get_future().wait()
    return True


def test_cuda_collectives_through_nccl():
    run_ranks(_collectives_body, _world())


def _train(model, x, y, ddp_cls, steps=3):
    ddp = ddp_cls(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        (ddp(x) - y).square().mean().backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def _ddp_body(rank, world):
    torch.cuda.set_device(rank)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    x, y = torch.randn(8, 16) + rank, torch.randn(8, 4)
    on_gpu = _train(
        copy.deepcopy(model).cuda(),
        x.cuda(),
        y.cuda(),
        dsparallel.DistributedDataParallel,
    )
    on_cpu_group = dist.new_group(backend="gloo")
    on_cpu = _train(
        model,
        x,
        y,
        lambda m: dsparallel.DistributedDataParallel(m, process_group=on_cpu_group),
    )
    for a, b in zip(on_gpu, on_cpu):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # fused_all_reduce on CUDA tensors equals the CPU result.
    ts = [torch.full((k + 1,), float(rank + k)) for k in range(5)]
    gpu = [t.cuda() for t in ts]
    dsparallel.fused_all_reduce(gpu, op="avg")
    dsparallel.fused_all_reduce(ts, op="avg", group=on_cpu_group)
    for a, b in zip(gpu, ts):
        torch.testing.assert_close(a.cpu(), b)
    # Enough tensors for several _foreach_copy_ launches per bucket, ragged
    # sizes, an empty and a non-contiguous one, over two buckets.
    g = torch.Generator().manual_seed(rank)
    ts = [torch.randn(int(n), generator=g) for n in torch.randint(0, 3000, (300,))]
    ts.append(torch.randn(40, 30, generator=g).t())
    gpu = [t.cuda() for t in ts]
    dsparallel.fused_all_reduce(gpu, op="sum", bucket_cap_mb=1.0)
    dsparallel.fused_all_reduce(ts, op="sum", group=on_cpu_group)
    assert not gpu[-1].is_contiguous()
    for a, b in zip(gpu, ts):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5)
    return True


def test_ddp_and_fused_all_reduce_on_cuda_match_cpu():
    run_ranks(_ddp_body, _world())


def _tp_body(rank, world):
    from dsparallel import tensor_parallel as tp

    torch.cuda.set_device(rank)
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16)
    cpu = tp.ParallelAttention.from_multihead_attention(mha, causal=True)
    gpu = tp.ParallelAttention.from_multihead_attention(mha, causal=True).cuda()
    torch.testing.assert_close(gpu(x.cuda()).cpu(), cpu(x), rtol=1e-4, atol=1e-5)
    return True


def test_tensor_parallel_attention_on_cuda_matches_cpu():
    run_ranks(_tp_body, _world())


_SHUTDOWN_SCRIPT = """
import torch, torch.distributed as dist, dsparallel
torch.cuda.set_device(0)
dist.init_process_group("dsp", rank=0, world_size=1)
t = torch.ones(4, device="cuda")
dist.all_reduce(t)
assert t.sum().item() == 4
dist.destroy_process_group()
print("done")
"""


def test_destroy_process_group_shuts_down_the_nccl_group_inside():
    # destroy_process_group() reaches only "dsp"; the NCCL group it owns must
    # be shut down through it, or NCCL warns at exit that it never was.
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    r = subprocess.run(
        [sys.executable, "-c", _SHUTDOWN_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    assert "destroy_process_group() was not called" not in r.stderr, r.stderr
