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

# Many tests are gated on the backend's *name* when the suite is imported
# ("Test requires backend dsp to be one of {'gloo'}", "Only gloo backend
# supports timeouts", ...), though "dsp" is meant to be a drop-in for gloo.
# With DSP_UNGATE=1 the suite is imported as if for gloo (the decorators let
# those tests through) and then runs over "dsp": every process group the
# tests create reads the module's BACKEND at run time. Where a test's body
# branches on the name it now takes the non-gloo branch, as any plugin would.
UNGATE = BACKEND == "dsp" and os.environ.get("DSP_UNGATE") == "1"
if UNGATE:
    os.environ["BACKEND"] = "gloo"

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

if UNGATE:
    os.environ["BACKEND"] = distributed_test.BACKEND = BACKEND


class TestDistBackendWithFork(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        # Forked ranks start in milliseconds where spawned ones re-import
        # torch and the suite (seconds per rank per test: an hour per run on
        # two cores). The parent has started no threads that a child needs.
        self._start_processes(torch.multiprocessing.get_context("fork").Process)


if __name__ == "__main__":
    run_tests()
