"""A job for test_multihost, run by torchrun (as one agent or several): checks
every collective with exact results, trains a small model under our DDP, and
has rank 0 print the layout it saw and the trained parameters as JSON."""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_multihost import _check_collectives, _train_ddp  # noqa: E402

import dsparallel  # noqa: E402, F401  (registers "dsp")


def main():
    dist.init_process_group("dsp")
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    _check_collectives(rank, world)
    params = _train_ddp(rank, world)
    if rank == 0:
        print(f"layout: multi_host={backend.multi_host} hierarchical={backend.hierarchical}")
        print("params: " + json.dumps(params))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
