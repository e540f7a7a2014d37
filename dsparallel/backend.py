"""Registration of the "dsp" torch.distributed backend.

``import dsparallel`` calls ``register`` once; calling it again is a no-op.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from . import _C

BACKEND_NAME = "dsp"
NODE_ID_ENV = "DSP_NODE_ID"
# Settings that decide the shared-memory layout or the protocol, which every
# rank of a group must share: a layout that differs would leave the ranks
# waiting on each other until the group's timeout (a segment too small to
# attach, an algorithm the peer does not run). DSP_P2P_SINGLE_COPY may differ:
# each pair of ranks agrees on its route when the group is made.
AGREED_ENV = (
    "DSP_CHUNK_BYTES",
    "DSP_P2P_RING_BYTES",
    "DSP_ONE_SHOT_BYTES",
    "DSP_HIER_PIECE_BYTES",
    "DSP_CHECK_ACROSS_HOSTS",
)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def machine_id() -> str:
    """This machine (one kernel, one set of cores): the host name and the boot
    id, which tells apart two machines or VMs that share a host name."""
    return f"{socket.gethostname()}/{_read('/proc/sys/kernel/random/boot_id')}"


def node_id() -> str:
    """This process's host identity: ``$DSP_NODE_ID`` if set (so that tests
    can make one machine act as several hosts), else what decides whether two
    processes can share memory and know each other's process ids: the
    machine, the IPC namespace, the tmpfs that holds POSIX shared memory, and
    the PID namespace (two containers on one machine differ in some of these,
    and must then talk over gloo: a peer's pid from another PID namespace
    would make the liveness checks and process_vm_readv ask about some other
    process)."""
    if os.environ.get(NODE_ID_ENV):
        return os.environ[NODE_ID_ENV]

    def namespace(kind: str) -> str:
        try:
            return os.readlink(f"/proc/self/ns/{kind}")
        except OSError:
            return "?"

    try:
        shm = os.stat("/dev/shm").st_dev
    except OSError:
        shm = "?"
    return f"{machine_id()}/{namespace('ipc')}/{namespace('pid')}/shm:{shm}"


def _check_agreed(settings: list[str]) -> None:
    """Raises, on every rank alike, when the ranks' AGREED_ENV differ."""
    values = [s.split("\t") for s in settings]
    for i, name in enumerate(AGREED_ENV):
        seen = [v[i] for v in values]
        other = next((r for r, v in enumerate(seen) if v != seen[0]), None)
        if other is not None:
            raise ValueError(
                f"dsp: the ranks of a group must set {name} alike, but it is "
                f"{seen[0] or 'unset'!r} on rank 0 and {seen[other] or 'unset'!r} on rank "
                f"{other}"
            )


def _topology(store, rank: int, size: int):
    """Every rank's host through the group's store: the host index of each
    rank (in order of first appearance), and how many ranks share this
    physical machine (more than a host's when one machine plays several).
    Checks on the way that the ranks agree on AGREED_ENV."""
    me = machine_id()
    settings = "\t".join(os.environ.get(name, "") for name in AGREED_ENV)
    store.set(f"dsp-node/{rank}", f"{node_id()}\n{me}\n{settings}")
    entries = [store.get(f"dsp-node/{r}").decode().split("\n") for r in range(size)]
    _check_agreed([e[2] for e in entries])
    names = [e[0] for e in entries]
    order = {n: i for i, n in enumerate(dict.fromkeys(names))}
    machine = sum(1 for e in entries if e[1] == me)
    return [order[n] for n in names], machine


def _nccl(store, rank: int, size: int, timeout: timedelta):
    """torch's NCCL group for the CUDA tensors of this group, when torch has
    CUDA and NCCL and a GPU is present (its communicators start lazily)."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(dist.PrefixStore("dsp-nccl/", store), rank, size, options)


def _create_backend(dist_backend_opts, backend_options=None):
    """Creator called by torch.distributed for every group that uses "dsp".

    Collectives among the ranks of one host go over shared memory (C++).
    Point-to-point send/recv ride an internal gloo group on its own store
    prefix: gloo already does tagged pairwise transfers well. When the group
    spans hosts, that gloo group also carries the collectives other than
    all-reduce, and all-reduce is hierarchical: shared memory within each
    host, gloo between the ranks with the same local index on each host.
    CUDA tensors go to torch's NCCL group.
    """
    store = dist_backend_opts.store
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is not None:
        # torchrun keeps one store across the restarts of a group (its
        # --max-restarts): the keys a killed attempt wrote (gloo's
        # addresses, our shared-memory names) must not be read as this one's.
        store = dist.PrefixStore(f"dsp-attempt-{attempt}/", store)
    rank = dist_backend_opts.group_rank
    size = dist_backend_opts.group_size
    timeout = dist_backend_opts.timeout
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    p2p = dist.ProcessGroupGloo(dist.PrefixStore("dsp-p2p/", store), rank, size, timeout)
    cuda = _nccl(store, rank, size, timeout)
    hosts, machine_ranks = _topology(store, rank, size)
    if len(set(hosts)) == 1:
        return _C.ProcessGroupDSP(store, rank, size, timeout, p2p, cuda=cuda)
    mine = hosts[rank]
    members = {}  # host -> its ranks, in rank order
    for r, h in enumerate(hosts):
        members.setdefault(h, []).append(r)
    local = members[mine]
    inter, peers = None, []
    if len({len(m) for m in members.values()}) == 1:
        # The ranks with this rank's local index on every host.
        index = local.index(rank)
        peers = sorted(m[index] for m in members.values())
        inter = dist.ProcessGroupGloo(
            dist.PrefixStore(f"dsp-inter/{index}/", store), peers.index(rank), len(peers), timeout
        )
    return _C.ProcessGroupDSP(
        dist.PrefixStore(f"dsp-host/{mine}/", store),
        rank,
        size,
        timeout,
        p2p,
        local_rank=local.index(rank),
        local_size=len(local),
        inter=inter,
        host_ranks=local,
        inter_ranks=peers,
        machine_ranks=machine_ranks,
        cuda=cuda,
        hosts=list(members.values()),
    )


def register() -> None:
    """Registers "dsp" for CPU and CUDA devices (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
    )


# Set in the environment of every rank (before torch is imported), makes
# "dsp" the default CPU backend without a line of code (dsparallel_autoload).
DEFAULT_ENV = "DSPARALLEL_DEFAULT_BACKEND"


def use_as_default() -> None:
    """Makes "dsp" torch's default backend for CPU tensors (CUDA ones keep
    NCCL): ``dist.init_process_group()`` with no backend, and
    ``init_device_mesh("cpu", ...)`` with no group yet, then create a "dsp"
    group, as do frameworks that call them without naming a backend.
    Call it before the group is created; the environment variable
    ``DSPARALLEL_DEFAULT_BACKEND=1`` does the same without code. Frameworks
    that name "gloo" for the CPU themselves (Lightning, accelerate, the
    ``transformers`` ``Trainer``) are not changed by it: see the frameworks
    guide."""
    from dsparallel_autoload import make_default

    register()
    make_default()
