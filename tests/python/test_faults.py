"""Bad input and faults: clear errors on every rank, never a hang, and
nothing left in /dev/shm (the conftest fixture checks that after each test)."""

import os
import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import require, run_ranks


def _expect_error(fn, *needles):
    try:
        fn()
    except RuntimeError as e:
        msg = str(e)
        for needle in needles:
            assert needle in msg, f"{needle!r} not in error: {msg}"
        return msg
    raise AssertionError("no error raised")


def _mismatch_body(rank, n):
    # different shapes: every rank raises the same message naming the
    # collective, its sequence number and each rank's call
    t = torch.ones(4 if rank == 0 else 5)
    msgs = [
        _expect_error(
            lambda: dist.all_reduce(t),
            "all_reduce #",
            "rank 0:",
            "rank 1:",
            "float32[4]",
            "float32[5]",
        )
    ]
    # same element count, different shape
    t = torch.ones(2, 3) if rank == 0 else torch.ones(3, 2)
    msgs.append(_expect_error(lambda: dist.all_reduce(t), "float32[2, 3]", "float32[3, 2]"))
    # different dtypes
    t = torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64)
    msgs.append(_expect_error(lambda: dist.all_reduce(t), "float32", "float64"))
    # different ops
    t = torch.ones(4)
    op = dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX
    msgs.append(_expect_error(lambda: dist.all_reduce(t, op=op), "op SUM", "op MAX"))
    # different roots
    msgs.append(_expect_error(lambda: dist.broadcast(t, src=rank % n), "root 0", "root 1"))
    # different collectives
    if rank == 0:
        msgs.append(_expect_error(lambda: dist.all_reduce(t), "all_reduce", "broadcast"))
    else:
        msgs.append(_expect_error(lambda: dist.broadcast(t, src=0), "all_reduce", "broadcast"))
    # the group is still usable, and in step
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), n * (n - 1) / 2))
    return msgs


def test_mismatched_calls_raise_same_error_on_every_rank():
    per_rank = run_ranks(_mismatch_body, 2)
    assert per_rank[0] == per_rank[1]


def _bad_dtype_body(rank, n):
    u = torch.ones(3, dtype=torch.uint32)
    _expect_error(lambda: dist.all_reduce(u), "unsupported dtype", "UInt32")
    f8 = torch.ones(3).to(torch.float8_e4m3fn)
    _expect_error(lambda: dist.broadcast(f8, 0), "unsupported dtype", "Float8")
    # complex SUM works: torch hands it over as its real view
    c = torch.full((3,), 1 + 2j, dtype=torch.complex64)
    dist.all_reduce(c)
    assert torch.equal(c, torch.full((3,), n * (1 + 2j), dtype=torch.complex64))
    i = torch.ones(3, dtype=torch.int32)
    _expect_error(lambda: dist.all_reduce(i, op=dist.ReduceOp.AVG), "AVG", "int32")
    _expect_error(lambda: dist.all_reduce(i, op=dist.ReduceOp.BAND), "unsupported reduce op")
    # nothing was sent: the group is in step
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), float(n)))


def test_unsupported_dtype_or_op_raises_before_sending():
    run_ranks(_bad_dtype_body, 2)


def _late_rank_body(rank, n):
    if rank == n - 1:
        time.sleep(6)  # never joins the all-reduce in time
        return None
    t0 = time.monotonic()
    msg = _expect_error(
        lambda: dist.all_reduce(torch.ones(8)),
        "all_reduce #1",
        f"[{n - 1}]",
        "did not arrive",
        "timeout",
    )
    elapsed = time.monotonic() - t0
    assert elapsed < 10, elapsed
    # the group refuses further work, saying why
    _expect_error(lambda: dist.all_reduce(torch.ones(1)), "unusable")
    return msg


def test_missing_rank_times_out_naming_it():
    run_ranks(_late_rank_body, 3, pg_timeout_s=2, init=True)


def _killed_rank_body(rank, n, size):
    # one healthy round first, so every segment is attached and unlinked
    t = torch.ones(size)
    dist.all_reduce(t)
    if rank == 1:
        os._exit(17)  # dies without a word, mid-job
    t0 = time.monotonic()
    _expect_error(lambda: dist.all_reduce(torch.ones(size)), "all_reduce #2", "[1]", "has exited")
    assert time.monotonic() - t0 < 20


@pytest.mark.parametrize("size", [8, 3_000_000])
def test_killed_rank_is_reported(size):
    run_ranks(_killed_rank_body, 2, size, pg_timeout_s=30, allow_exit=(1,))


def _impostor_at(pid: int):
    """A new process with process id `pid` (ns_last_pid: root, and nobody
    forking in between); None where this machine will not give one."""
    import subprocess

    for _ in range(20):
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
        except OSError:
            return None
        p = subprocess.Popen(["sleep", "60"])
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    return None


def _reused_pid_body(rank, n):
    """Rank 1 dies and a new process takes its pid: rank 0 still sees it
    gone (it watches the process, not the number) and raises naming it."""
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        os._exit(17)
    while os.path.exists(f"/proc/{pids[1]}"):  # exited and reaped
        time.sleep(0.01)
    impostor = _impostor_at(pids[1])
    if impostor is None:
        return "no impostor"
    try:
        t0 = time.monotonic()
        _expect_error(lambda: dist.all_reduce(torch.ones(8)), "[1]", "has exited")
        assert time.monotonic() - t0 < 10, time.monotonic() - t0
    finally:
        impostor.kill()
        impostor.wait()
    return "raised"


def test_a_killed_peer_whose_pid_is_reused_is_still_reported():
    got = run_ranks(_reused_pid_body, 2, pg_timeout_s=60, allow_exit=(1,))
    require(got[0] == "raised", "this machine cannot place a process at a given pid (root?)")


def _killed_peer_of_large_send_body(rank, n, who):
    """A message too large for a ring is read in place: if its receiver dies
    first the waiting sender says so; if its sender dies after announcing it
    the receiver says so (it cannot read a gone process), not a hang or
    garbage."""
    big = torch.ones(1 << 20)  # 4 MiB: read in place
    dist.barrier()
    if who == "receiver" and rank == 1 or who == "sender" and rank == 0:
        if who == "sender":
            dist.isend(big, 1)
        os._exit(17)
    t0 = time.monotonic()
    if who == "receiver":
        _expect_error(lambda: dist.send(big, 1), "send to rank 1", "has exited")
    else:
        time.sleep(0.5)
        _expect_error(lambda: dist.recv(torch.empty(1 << 20), 0), "from rank 0", "exited")
    assert time.monotonic() - t0 < 20


@pytest.mark.parametrize("who", ["receiver", "sender"])
def test_killed_peer_of_large_send_is_reported(who):
    dead = 1 if who == "receiver" else 0
    run_ranks(_killed_peer_of_large_send_body, 2, who, pg_timeout_s=30, allow_exit=(dead,))


def _segments_body(rank, n):
    # Segments are unlinked once every rank attached: ours are gone already,
    # including those of sub-groups.
    g = dist.new_group(backend="dsp")
    dist.barrier(group=g)
    dist.barrier()  # a completed collective: rank 0 has unlinked the default group's name
    pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    name = pg.segment_name
    assert name.startswith("/dsp-") and len(name) == len("/dsp-") + 32
    assert not os.path.exists("/dev/shm" + name)
    return name


def test_segment_names_unique_and_unlinked():
    first = run_ranks(_segments_body, 2)
    second = run_ranks(_segments_body, 2)
    assert first[0] == first[1]
    assert first[0] != second[0]


def _layout_mismatch_body(rank, world):
    from datetime import timedelta

    os.environ["DSP_CHUNK_BYTES"] = str(524288 * (rank + 1))
    with pytest.raises(ValueError) as caught:
        # A timeout far past the harness's: waiting on it would fail the test.
        dist.init_process_group("dsp", timeout=timedelta(seconds=600))
    return str(caught.value)


def test_ranks_with_different_layouts_raise_at_once_naming_both_values():
    """DSP_CHUNK_BYTES set differently per rank: every rank raises at group
    creation naming both values, instead of waiting out the group's timeout
    for a segment of the size it expects."""
    errors = run_ranks(_layout_mismatch_body, 2, init=False, timeout=60)
    for e in errors:
        assert "must set DSP_CHUNK_BYTES alike" in e, e
        assert "'524288' on rank 0 and '1048576' on rank 1" in e, e


def test_random_faults_never_hang_crash_leak_or_give_a_wrong_result():
    """200 short runs (tests/python/random_faults.py; DSP_FAULT_RUNS others,
    as the AddressSanitizer stage runs fewer), most with one rank made to
    raise, stall past the timeout or be killed at a random point."""
    import json
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "random_faults.py")
    runs = int(os.environ.get("DSP_FAULT_RUNS", "200"))
    done = subprocess.run(
        [sys.executable, script, "--runs", str(runs), "--seed", "0"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    print({k: v for k, v in counts.items() if k != "details"})
    assert done.returncode == 0, counts
    assert counts["runs"] == runs and sum(counts["faults"].values()) > 0.75 * runs, counts
    assert counts["errors_raised"] > 0.75 * runs and counts["ops_completed"] > 5 * runs, counts
    for bad in ("wrong_results", "hangs", "crashes", "leaks", "unexpected_errors"):
        assert counts[bad] == 0, (bad, counts)
