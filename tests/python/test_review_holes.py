"""The holes a code review found in the backend, each held by a test that
failed before its fix: coalesced calls that hid a member's error, a shape
check that compared only element counts, a small /dev/shm killing the job,
host identity by host name alone, abort and Work.wait(timeout) that did not
stop a waiting rank, barrier across hosts overtaking queued work, and
recomputation that did not replay the CUDA generator."""

import os
import shutil
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from dist_utils import free_port, require, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _expect_error(fn, *needles):
    try:
        fn()
    except RuntimeError as e:
        for n in needles:
            assert n in str(e), (n, str(e))
        return str(e)
    raise AssertionError(f"no error raised; expected {needles}")


def _coalesced_mismatch_body(rank, world):
    # Ranks disagree about the first member only: one Work for the lot, and
    # its error is that member's, on every rank.
    first = torch.zeros(3 if rank == 0 else 4)
    ins = [first, torch.full((2,), float(rank))]
    outs = [[torch.empty_like(t) for t in ins] for _ in range(world)]
    _expect_error(
        lambda: dist.all_gather_coalesced(outs, ins), "all_gather_coalesced", "tensor 0 of 2"
    )
    o = [torch.empty(world * 3 if rank == 0 else world * 4), torch.empty(world * 2)]
    pg = dist.distributed_c10d._get_default_group()
    _expect_error(
        lambda: pg.allgather_into_tensor_coalesced(o, ins).wait(),
        "all_gather_into_tensor_coalesced",
        "tensor 0 of 2",
    )
    big = [torch.ones(world * (3 if rank == 0 else 4)), torch.ones(world * 2)]
    small = [torch.empty(3 if rank == 0 else 4), torch.empty(2)]
    _expect_error(
        lambda: pg.reduce_scatter_tensor_coalesced(small, big).wait(),
        "reduce_scatter_tensor_coalesced",
        "tensor 0 of 2",
    )
    # The group is still usable, and torch's layout (one list per rank) works.
    ins = [torch.full((3,), float(rank)), torch.full((2, 2), 10.0 * rank)]
    outs = [[torch.empty_like(t) for t in ins] for _ in range(world)]
    dist.all_gather_coalesced(outs, ins)
    for r in range(world):
        assert torch.equal(outs[r][0], torch.full((3,), float(r)))
        assert torch.equal(outs[r][1], torch.full((2, 2), 10.0 * r))
    out = [torch.empty(world * 3), torch.empty(world * 2)]
    pg.allgather_into_tensor_coalesced(out, [torch.full((3,), 1.0 + rank), torch.ones(2)]).wait()
    assert torch.equal(out[0], torch.arange(1.0, world + 1).repeat_interleave(3))
    red = [torch.empty(3), torch.empty(2)]
    pg.reduce_scatter_tensor_coalesced(red, [torch.ones(world * 3), torch.ones(world * 2)]).wait()
    assert torch.equal(red[0], torch.full((3,), float(world)))


def test_coalesced_calls_report_any_members_error_on_every_rank():
    run_ranks(_coalesced_mismatch_body, 2)


def _coalesced_shapes_body(rank, world):
    ts = [torch.ones(4, 6), torch.ones(6, 4)] if rank == 0 else [torch.ones(6, 4), torch.ones(4, 6)]
    _expect_error(lambda: dist.all_reduce_coalesced(ts), "mismatched", "over 2 tensors")
    ts = [torch.ones(4, 6), torch.ones(2)]
    dist.all_reduce_coalesced(ts)
    assert torch.equal(ts[0], torch.full((4, 6), float(world)))


def test_all_reduce_coalesced_checks_every_shape():
    run_ranks(_coalesced_shapes_body, 2)


def _job(script: str) -> str:
    path = os.path.join(ROOT, "build", f"job_{os.getpid()}_{time.monotonic_ns()}.py")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(textwrap.dedent(script))
    return path


def _can_unshare(*flags) -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", *flags, "true"], capture_output=True).returncode == 0


def test_small_dev_shm_raises_on_every_rank_naming_the_bytes():
    """4 ranks in a mount namespace whose /dev/shm is 8 MB: every rank raises
    the same clear error (needed, free, the fix), none dies of SIGBUS."""
    require(_can_unshare("--mount"), "needs unshare --mount (root)")
    script = _job(
        """
        import os, sys, torch.distributed as dist, dsparallel
        # One write per line: print() with several arguments writes them
        # separately, and the ranks share one pipe, so their lines interleaved.
        try:
            dist.init_process_group("dsp")
            line = f"rank {os.environ['RANK']} CREATED"
        except Exception as e:
            line = f"rank {os.environ['RANK']} ERROR {str(e).splitlines()[0]}"
        sys.stdout.write(line + "\\n")
        sys.stdout.flush()
        """
    )
    cmd = (
        "mount -t tmpfs -o size=8m tmpfs /dev/shm && "
        f"{sys.executable} -m torch.distributed.run --standalone --nproc-per-node 4 {script}"
    )
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", cmd],
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = out.stdout + out.stderr
    errors = [line for line in text.splitlines() if " ERROR " in line]
    assert len(errors) == 4, text
    for e in errors:
        assert "too small" in e and "bytes are free" in e and "--shm-size" in e, text
    assert "SIGBUS" not in text and "CREATED" not in text, text


def test_ranks_in_separate_ipc_namespaces_go_over_gloo():
    """Two ranks with one host name but separate IPC namespaces are two hosts:
    they meet over gloo (hierarchical path), with correct results."""
    require(_can_unshare("--ipc"), "needs unshare --ipc (root)")
    script = _job(
        """
        import os, torch, torch.distributed as dist, dsparallel
        from datetime import timedelta
        dist.init_process_group("dsp", timeout=timedelta(seconds=60))
        rank, world = dist.get_rank(), dist.get_world_size()
        t = torch.arange(1000.0) * (rank + 1)
        dist.all_reduce(t)
        assert torch.equal(t, torch.arange(1000.0) * 3), t
        outs = [torch.empty(5) for _ in range(world)]
        dist.all_gather(outs, torch.full((5,), float(rank)))
        assert all(torch.equal(o, torch.full((5,), float(r))) for r, o in enumerate(outs))
        be = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        print("rank", rank, "OK hierarchical", be.hierarchical_calls, flush=True)
        dist.barrier()  # neither host tears its gloo pairs down while the other still talks
        dist.destroy_process_group()
        """
    )
    _expect_two_hosts(script, [["unshare", "--ipc"]] * 2)


def _expect_two_hosts(script: str, prefixes: list[list[str]]) -> None:
    """Runs ``script`` as ranks 0 and 1, rank r under ``prefixes[r]`` (an
    unshare), with no DSP_NODE_ID: each must succeed and report that the
    hierarchical path (two hosts) ran.

    A rank that aborts at exit after both reported correct results ("terminate
    called without an active exception", seen in full CI runs, never in ~400
    runs of this test alone under load) is run once more and
    reported as a warning with the Python threads' stacks (faulthandler):
    the results are held every time, the abort is not hidden. Two hosts
    run over gloo, and torch 2.13's gloo does this by itself: a plain gloo
    DDP script, without dsparallel autoloaded, aborts so at exit in about 1
    run in 8 here (see the frameworks guide)."""
    outs, codes = _launch_two_hosts(script, prefixes)
    ok = [f"rank {r} OK hierarchical" in o for r, o in enumerate(outs)]
    if all(ok) and any(c == -6 for c in codes) and all(c in (0, -6) for c in codes):
        import warnings

        warnings.warn(f"a rank aborted at exit after correct results: {outs}", stacklevel=2)
        outs, codes = _launch_two_hosts(script, prefixes)
    for r, (code, o) in enumerate(zip(codes, outs)):
        assert code == 0, o
        assert f"rank {r} OK hierarchical" in o, o
        assert "OK hierarchical 0" not in o, o  # the hierarchical path ran


def _launch_two_hosts(script: str, prefixes: list[list[str]]):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    env.pop("DSP_NODE_ID", None)
    env["PYTHONFAULTHANDLER"] = "1"  # an abort prints every Python thread's stack
    procs = [
        subprocess.Popen(
            [*prefixes[r], sys.executable, script],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    return outs, [p.returncode for p in procs]


def test_ranks_in_separate_pid_namespaces_are_two_hosts():
    """Two ranks that share the IPC namespace and /dev/shm but not the PID
    namespace (containers of one pod): a peer's pid means nothing to the
    other, so they must not share a segment, whose liveness checks would
    then call a waiting peer dead. Rank 0 arrives late so that rank 1 waits
    (and checks) first; both get correct results over the hierarchical path."""
    require(_can_unshare("--pid", "--fork"), "needs unshare --pid (root)")
    script = _job(
        """
        import os, time, torch, torch.distributed as dist, dsparallel
        from datetime import timedelta
        dist.init_process_group("dsp", timeout=timedelta(seconds=60))
        rank = dist.get_rank()
        if rank == 0:
            time.sleep(2)
        t = torch.arange(1000.0) * (rank + 1)
        dist.all_reduce(t)
        assert torch.equal(t, torch.arange(1000.0) * 3), t
        be = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        print("rank", rank, "OK hierarchical", be.hierarchical_calls, flush=True)
        dist.barrier()
        dist.destroy_process_group()
        """
    )
    _expect_two_hosts(script, [[], ["unshare", "--pid", "--fork"]])


def _abort_body(rank, world):
    pg = dist.distributed_c10d._get_default_group()
    be = pg._get_backend(torch.device("cpu"))
    if rank == 0:
        work = dist.all_reduce(torch.ones(10), async_op=True)  # rank 1 never joins
        time.sleep(0.3)
        start = time.monotonic()
        be.abort()
        _expect_error(work.wait, "aborted")
        assert time.monotonic() - start < 5, "abort did not wake the waiting collective"
        _expect_error(lambda: dist.all_reduce(torch.ones(1)), "aborted", "refuses")
    dist.distributed_c10d._get_default_store().set(f"done{rank}", "1")
    if rank == 1:
        dist.distributed_c10d._get_default_store().wait(["done0"])
        be.abort()  # out of step too: it leaves the group


def test_abort_wakes_a_waiting_rank_and_refuses_further_work():
    # A 60 s group timeout: before the fix the wait lasted that long.
    run_ranks(_abort_body, 2, pg_timeout_s=60, timeout=50)


def _wait_timeout_body(rank, world):
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        work = dist.all_reduce(torch.ones(10), async_op=True)  # rank 1 never joins
        start = time.monotonic()
        _expect_error(lambda: work.wait(timedelta(milliseconds=300)), "timed out after 300 ms")
        assert time.monotonic() - start < 5
        _expect_error(lambda: dist.all_reduce(torch.ones(1)), "expired", "refuses")
        store.set("done", "1")
    else:
        store.wait(["done"])
        dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).abort()


def test_work_wait_timeout_expires_and_breaks_the_group():
    run_ranks(_wait_timeout_body, 2, pg_timeout_s=60, timeout=50)


def _barrier_across_hosts_body(rank, world):
    os.environ["DSP_NODE_ID"] = f"host{rank}"
    dist.init_process_group("dsp")
    n = 8 << 20  # 32 MB: long enough to be running when the barrier is called
    if rank == 1:
        time.sleep(0.5)
    work = dist.all_reduce(torch.ones(n), async_op=True)
    dist.barrier()
    done = work.is_completed()
    work.wait()
    assert done, "barrier returned while work queued before it was still running"


def test_barrier_across_hosts_waits_for_queued_work():
    run_ranks(_barrier_across_hosts_body, 2, init=False)


def test_recomputation_replays_the_cuda_generator(monkeypatch):
    """capture_rng/replay_rng restore the current CUDA device's generator when
    CUDA is in use (checked without a GPU: a stand-in generator)."""
    import importlib

    ck = importlib.import_module("dsparallel.checkpoint")  # the module, not the function

    state = {"v": torch.tensor([7], dtype=torch.uint8)}
    monkeypatch.setattr(ck, "cuda_rng_live", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=0: state["v"].clone())

    def set_state(s, device=0):
        state["v"] = s.clone()

    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    saved = ck.capture_rng()
    state["v"] = torch.tensor([99], dtype=torch.uint8)  # the forward drew numbers
    seen = []
    with ck.replay_rng(saved):
        seen.append(int(state["v"]))
    assert seen == [7], "recompute did not start from the forward's CUDA state"
    assert int(state["v"]) == 99, "the CUDA state after recompute was not put back"


def test_cuda_build_check_fails_under_ci_when_torch_cannot_be_installed(tmp_path):
    env = dict(
        os.environ,
        CI="true",
        DSP_CUDA_VENV=str(tmp_path / "venv"),
        DSP_CUDA_TORCH_VERSION="0.0.0.dev0+nonexistent",
        PIP_NO_INDEX="1",
    )
    out = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "cuda_build_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0, out.stdout + out.stderr
    assert "FAILED" in out.stderr, out.stderr


def _monitored_barrier_body(rank, world):
    pg = dist.distributed_c10d._get_default_group()
    dist.all_reduce(torch.ones(4), async_op=True)  # queued work first
    pg.monitored_barrier(timedelta(seconds=20))
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:  # rank 1 stays away: the barrier names it
        _expect_error(
            lambda: pg.monitored_barrier(timedelta(seconds=1)), "Rank 1", "monitoredBarrier"
        )
        store.set("done", "1")
    else:
        store.wait(["done"])


def test_monitored_barrier_names_the_missing_rank():
    """torch's Python front accepts monitored_barrier for gloo only; the
    process group's own call reaches our implementation (gloo's, after the
    queued work)."""
    run_ranks(_monitored_barrier_body, 2)


def _dropped_recv_body(rank, world, drop_buffer):
    tag = 7
    if rank == 1:
        stale = torch.zeros(4)
        work = dist.irecv(stale, src=0, tag=tag)
        del work  # dropped before its message came: it must take nothing
        if drop_buffer:
            del stale  # its memory goes too (scripts/asan.sh: no write into it)
        dist.barrier()  # rank 0 sends only now
        fresh = torch.zeros(4)
        dist.recv(fresh, src=0, tag=tag)
        assert torch.equal(fresh, torch.arange(4.0)), fresh
        if not drop_buffer:
            assert torch.equal(stale, torch.zeros(4)), stale
    else:
        dist.barrier()
        dist.send(torch.arange(4.0), dst=1, tag=tag)


@pytest.mark.parametrize("drop_buffer", [False, True])
def test_a_dropped_receive_takes_no_later_message(drop_buffer):
    """A receive whose Work is dropped before it completes (a failed pipeline
    step's) is withdrawn: the next receive with its tag gets the message,
    instead of the stale one taking it into memory that may be gone."""
    run_ranks(_dropped_recv_body, 2, drop_buffer, pg_timeout_s=10, timeout=60)


def _dropped_on_completion_body(rank, world):
    """Async collectives whose caller polls them and drops each the moment it
    completes: none is freed on the group's worker thread (which must not
    drop Python objects: at interpreter exit that aborts the process)."""
    from dsparallel import _C

    before = _C.works_freed_on_worker()
    for _ in range(3000):
        work = dist.all_reduce(torch.ones(4), async_op=True)
        while not work.is_completed():
            pass
        del work
    dist.barrier()
    return _C.works_freed_on_worker() - before


def test_works_dropped_on_completion_are_never_freed_on_the_worker():
    assert run_ranks(_dropped_on_completion_body, 2) == [0, 0]
