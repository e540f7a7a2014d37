"""``python -m dsparallel.train`` with every checkpoint write slowed by 3 s:
the window in which a test kills a rank during an asynchronous write."""

import sys
import time

import torch.distributed.checkpoint as dcp

from dsparallel.train.__main__ import main

_write = dcp.FileSystemWriter.write_data


def _slow(self, plan, planner):
    time.sleep(3)
    return _write(self, plan, planner)


dcp.FileSystemWriter.write_data = _slow

if __name__ == "__main__":
    sys.exit(main())
