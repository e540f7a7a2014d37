"""Smoke test of an installed dsparallel (run from outside the source tree):
the package imports from where it was installed, "dsp" works without
``import dsparallel`` (torch's backend entry point), a 2-rank all-reduce is
exact and a DDP step over "dsp" equals the single-process step.

    python smoke.py [--expect-under PREFIX]
"""

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # Never imports dsparallel itself: the entry point registered "dsp" at
    # `import torch`, and the group's creation loads the extension.
    assert "dsparallel" not in sys.modules
    dist.init_process_group("dsp", rank=rank, world_size=world)
    t = torch.arange(10.0) * (rank + 1)
    dist.all_reduce(t)
    assert torch.equal(t, torch.arange(10.0) * 3), t
    assert "dsparallel" in sys.modules  # loaded lazily by the creator

    import dsparallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    reference = torch.nn.Sequential(*[m for m in __import__("copy").deepcopy(model)])
    ddp = dsparallel.DistributedDataParallel(model)
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.randn(4, 1)
    dist.broadcast(y, 0)
    mine = x.chunk(world)[rank]
    torch.nn.functional.mse_loss(ddp(mine), y.chunk(world)[rank]).backward()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--expect-under", help="dsparallel must be imported from under this path")
    args = p.parse_args()
    if args.expect_under:
        import importlib.util

        where = importlib.util.find_spec("dsparallel").origin
        assert where.startswith(os.path.realpath(args.expect_under)), where
        print("smoke: dsparallel from", where)
    mp.start_processes(_rank, args=(2, _free_port()), nprocs=2, start_method="spawn")
    print("smoke: OK (2-rank all_reduce without import dsparallel, DDP step)")


if __name__ == "__main__":
    main()
