"""Runs a test body in real processes, one per rank, and reports every rank.

Each test calls ``run_ranks(fn, world_size, ...)``: the ranks are started from
a forkserver that has already imported torch (cheap starts), join a fresh
TCPStore on a free port, run ``fn(rank, world_size, *args)`` and send back its
return value or traceback. A rank that hangs past ``timeout`` fails the test
(all ranks are killed) instead of hanging the suite.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import pytest

# CI runs as root with every tool installed by scripts/setup.sh: there a test
# that needs root or a tool must run, so a missing one fails instead of skipping.
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(ok: bool, reason: str) -> None:
    """Skip the calling test when ``ok`` is false, or fail it under CI."""
    if ok:
        return
    if IN_CI:
        pytest.fail(f"CI must run this test, but: {reason}", pytrace=False)
    pytest.skip(reason)


_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "dsparallel"])
    return _CTX


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, backend, pg_timeout_s, init, args, results, dump_after):
    # A rank that crashes prints its Python stack; one that hangs prints every
    # thread's stack shortly before the parent gives up on it, so a hang in CI
    # says where it was.
    faulthandler.enable()
    faulthandler.dump_traceback_later(dump_after, exit=False)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    try:
        import torch
        import torch.distributed as dist

        import dsparallel  # noqa: F401  (registers "dsp")

        torch.set_num_threads(1)
        if init:
            dist.init_process_group(
                backend, rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout_s)
            )
        value = fn(rank, world, *args)
        if init and dist.is_initialized():
            dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001  (report everything to the parent)
        results.put((rank, "error", traceback.format_exc()))


class RankFailure(AssertionError):
    pass


def run_ranks(
    fn, world_size, *args, backend="dsp", timeout=120, pg_timeout_s=60, init=True, allow_exit=()
):
    """Runs fn on world_size ranks; returns the list of per-rank return values.

    Raises RankFailure with every failing rank's traceback. Ranks listed in
    ``allow_exit`` may die without reporting (the killed-peer tests).
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, r, world_size, port, backend, pg_timeout_s, init, args, results, timeout - 5),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got = {}
    expected = world_size - len(allow_exit)
    deadline = time.monotonic() + timeout
    try:
        while len(got) < expected:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(got) - set(allow_exit))
                # A rank that died without reporting (a crash) fails at once,
                # with its exit code, rather than looking like a hang.
                dead = [
                    (r, procs[r].exitcode)
                    for r in missing
                    if not procs[r].is_alive() and results.empty()
                ]
                if dead:
                    raise RankFailure(
                        "ranks died without reporting (rank, exit code): " + str(dead)
                    ) from None
                if time.monotonic() > deadline:
                    raise RankFailure(
                        f"ranks {missing} did not finish within {timeout}s (hang?)"
                    ) from None
                continue
            got[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(got.items()) if s != "ok"]
    if errors:
        raise RankFailure("\n".join(errors))
    return [got[r][1] if r in got else None for r in range(world_size)]


def _script_body(rank, world, path, argv, cwd):
    """Runs a script's ``__main__`` in this rank as torchrun would (the env://
    variables are set, the script's folder first on sys.path), in ``cwd``
    if given; returns what it printed. A non-zero exit raises, with the
    output."""
    import contextlib
    import io
    import runpy
    import sys

    if cwd:
        os.chdir(cwd)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                msg = f"{path} exited with {e.code!r}; it printed:\n{out.getvalue()}"
                raise RuntimeError(msg) from None
    return out.getvalue()


def run_script(path, *argv, nproc=2, timeout=240, cwd=None) -> str:
    """A torchrun script's job in ranks forked from a server that already
    imported torch (seconds cheaper per rank than torchrun's fresh
    interpreters); returns what the ranks printed, in rank order (torchrun
    merges them). The scripts initialise their own group, as under torchrun."""
    return "".join(
        run_ranks(_script_body, nproc, path, list(argv), cwd, init=False, timeout=timeout)
    )


def expect_raises(kind, fn, *needles):
    """fn() raises ``kind`` whose message contains every one of ``needles``
    (for bad-input checks run on every rank)."""
    try:
        fn()
    except kind as e:
        for n in needles:
            assert n in str(e), (n, str(e))
        return
    raise AssertionError(f"expected {kind.__name__}, nothing was raised")
