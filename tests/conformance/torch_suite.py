"""torch's own distributed test suite (the one it runs for gloo, NCCL and MPI),
spawned over the backend named by $BACKEND at world size $WORLD_SIZE.

torch ships the suite in its wheel but not the spawning harness
(test/distributed/test_distributed_spawn.py accepts only gloo, nccl and ucc):
these few lines are ours. A backend that is not built in is skipped almost
everywhere unless DistTestCases.backend_feature declares it before the suite
is imported, so "dsp" is declared a plugin with DDP and sub-groups (it has no
GPU forwarding on a machine without CUDA). Run it through check.py.
"""

import os
import sys

import torch  # noqa: F401
import torch.distributed as dist

if not dist.is_available():
    print("torch.distributed is not available")
    sys.exit(0)

from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

import dsparallel  # noqa: F401,E402  (registers "dsp")

BACKEND = os.environ["BACKEND"]
if BACKEND == "dsp":
    for feature in ("plugin", "ddp", "subgroup"):
        DistTestCases.backend_feature[feature].add("dsp")

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
