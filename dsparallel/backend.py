"""Registration of the "dsp" torch.distributed backend.

``import dsparallel`` calls :func:`register` once; calling it again is a no-op.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from . import _C

BACKEND_NAME = "dsp"


def _create_backend(dist_backend_opts, backend_options=None):
    """Creator called by torch.distributed for every group that uses "dsp".

    Collectives go over shared memory (C++). Point-to-point send/recv ride an
    internal gloo group on its own store prefix: gloo already does tagged
    pairwise transfers well.
    """
    store = dist_backend_opts.store
    rank = dist_backend_opts.group_rank
    size = dist_backend_opts.group_size
    timeout = dist_backend_opts.timeout
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    p2p = dist.ProcessGroupGloo(dist.PrefixStore("dsp-p2p/", store), rank, size, timeout)
    return _C.ProcessGroupDSP(store, rank, size, timeout, p2p)


def register() -> None:
    """Registers "dsp" for CPU and CUDA devices (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
    )
