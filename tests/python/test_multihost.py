""" "dsp" across hosts, simulated on one machine with DSP_NODE_ID, and the
backend under load: a soak of random collectives with exactly known results,
a second job beside the first, and leaks of shared memory, descriptors and
threads.

Integer data (int64) make every result exact, whatever the order of the sums.
"""

import json
import os
import random
import shutil
import subprocess
import sys
import threading
import uuid

import pytest
import torch
import torch.distributed as dist
from dist_utils import free_port, require, run_ranks


def _init_as_hosts(rank, hosts_of):
    os.environ["DSP_NODE_ID"] = f"host{hosts_of[rank]}"
    dist.init_process_group("dsp")
    return dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))


def _values(rank, n, salt=0):
    return torch.arange(n, dtype=torch.int64) * (rank + 1) + salt


def _check_collectives(rank, world):
    """Every collective kind with exactly known results."""
    for n in (0, 1, 7, 1000, 300_001, 1_000_003):  # the last: several 4 MiB pieces, ragged
        t = _values(rank, n)
        dist.all_reduce(t)
        assert torch.equal(t, torch.arange(n) * sum(r + 1 for r in range(world))), n
        t = _values(rank, n)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        assert torch.equal(t, torch.arange(n) * world), n
        f = _values(rank, n).double()
        dist.all_reduce(f, op=dist.ReduceOp.AVG)
        torch.testing.assert_close(f, torch.arange(n).double() * (world + 1) / 2)
    # Coalesced: mixed shapes (one empty, one non-contiguous) and AVG.
    ts = [_values(rank, 5), _values(rank, 12).view(3, 4).t(), _values(rank, 0), _values(rank, 1)]
    dist.all_reduce_coalesced(ts)
    total = sum(r + 1 for r in range(world))
    assert torch.equal(ts[1], (torch.arange(12) * total).view(3, 4).t())
    assert all(torch.equal(t.flatten(), torch.arange(t.numel()) * total) for t in ts[::2])
    fs = [_values(rank, 7).double(), _values(rank, 3).double()]
    dist.all_reduce_coalesced(fs, op=dist.ReduceOp.AVG)
    for f in fs:
        torch.testing.assert_close(f, torch.arange(f.numel()).double() * (world + 1) / 2)
    for root in range(world):  # every root, hence every local index and host
        for n in (0, 10, 300_001):
            b = _values(rank, n) if rank == root else torch.zeros(n, dtype=torch.int64)
            dist.broadcast(b, src=root)
            assert torch.equal(b, _values(root, n)), (root, n)
    b = torch.zeros(4, 3, dtype=torch.float64).t()  # non-contiguous
    if rank == world - 1:
        b.copy_(torch.arange(12.0, dtype=torch.float64).view(3, 4))
    dist.broadcast(b, src=world - 1)
    assert torch.equal(b, torch.arange(12.0, dtype=torch.float64).view(3, 4))
    for n in (0, 5, 600_001):  # the last: several 4 MiB pieces, ragged
        outs = [torch.empty(n, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(outs, _values(rank, n))
        assert all(torch.equal(o, _values(r, n)) for r, o in enumerate(outs)), n
    outs = [torch.empty(4, 3, dtype=torch.int64).t() for _ in range(world)]  # non-contiguous
    dist.all_gather(outs, _values(rank, 12).view(3, 4))
    assert all(torch.equal(o, _values(r, 12).view(3, 4)) for r, o in enumerate(outs))
    out = torch.empty(world, 2, 3)
    dist.all_gather_into_tensor(out, torch.full((2, 3), float(rank)))
    assert torch.equal(out, torch.arange(float(world)).view(-1, 1, 1).expand(-1, 2, 3))
    for n in (0, 3, 300_001):  # the last: several pieces, ragged
        out = torch.empty(n, dtype=torch.int64)
        dist.reduce_scatter_tensor(out, _values(rank, n * world))
        want = sum(_values(r, n * world) for r in range(world))[n * rank : n * rank + n]
        assert torch.equal(out, want), n
    out = torch.empty(3, 2).t()  # non-contiguous, AVG, list form
    dist.reduce_scatter(
        out, [torch.full((2, 3), float(rank + 10 * r)) for r in range(world)], op=dist.ReduceOp.AVG
    )
    torch.testing.assert_close(out, torch.full((2, 3), 10.0 * rank + (world - 1) / 2))
    got = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(got, torch.arange(world, dtype=torch.int64) + 10 * rank)
    assert torch.equal(got, torch.arange(world, dtype=torch.int64) * 10 + rank)
    dist.barrier()
    if rank == 0:
        dist.send(torch.tensor([42]), dst=world - 1)
    elif rank == world - 1:
        r = torch.zeros(1, dtype=torch.int64)
        dist.recv(r, src=0)
        assert r.item() == 42


def _two_hosts_body(rank, world, hosts_of, hierarchical):
    backend = _init_as_hosts(rank, hosts_of)
    assert backend.multi_host and backend.hierarchical == hierarchical
    _check_collectives(rank, world)
    # Every all-reduce (6 sizes x 3 ops + 2 coalesced), broadcast (3 sizes
    # from each root + 1), all-gather (3 + 1 + 1) and reduce-scatter (3 + 1)
    # above took the path expected.
    calls = 20 + 3 * world + 1 + 5 + 4
    assert backend.hierarchical_calls == (calls if hierarchical else 0)
    dist.destroy_process_group()
    return True


@pytest.mark.parametrize("hosts_of", [[0, 0, 1, 1], [0, 1, 1, 0]])
def test_two_hosts_of_two_ranks_hierarchical(hosts_of):
    # Interleaved hosts: the local indices and inter groups do not follow
    # rank order, which broadcast's root and all-gather's layout must respect.
    run_ranks(_two_hosts_body, 4, hosts_of, True, init=False)


def test_unequal_hosts_fall_back_to_flat():
    run_ranks(_two_hosts_body, 3, [0, 0, 1], False, init=False)


def _mismatch_body(rank, world):
    """Hosts that disagree (each agreeing within itself) about a call whose
    data crosses hosts: every rank raises naming the calls, nothing is sent
    (gloo would abort the process on the size mismatch), and the group stays
    usable."""
    _init_as_hosts(rank, [0, 0, 1, 1])
    n = 1000 if rank < 2 else 2000
    calls = {
        "all_reduce": lambda: dist.all_reduce(torch.ones(n)),
        "broadcast": lambda: dist.broadcast(torch.ones(n), src=3),
        "all_gather": lambda: dist.all_gather_into_tensor(torch.empty(world * n), torch.ones(n)),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(torch.empty(n), torch.ones(world * n)),
        "gather": lambda: dist.gather(  # flat gloo, checked all the same
            torch.ones(n), [torch.empty(n) for _ in range(world)] if rank == 0 else None, dst=0
        ),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError) as err:
            call()
        msg = str(err.value)
        assert "ranks on different hosts called mismatched collectives" in msg, msg
        assert f"{name} Float[1000]" in msg and f"{name} Float[2000]" in msg, msg
        t = torch.ones(8)
        dist.all_reduce(t)  # still usable
        assert torch.equal(t, torch.full((8,), 4.0))
    # All-to-all may differ in size across ranks (uneven splits): not refused.
    ins = torch.full((world * (rank + 1),), float(rank))
    out = torch.empty(sum(r + 1 for r in range(world)))
    dist.all_to_all_single(out, ins, [r + 1 for r in range(world)], [rank + 1] * world)
    want = torch.cat([torch.full((r + 1,), float(r)) for r in range(world)])
    assert torch.equal(out, want)
    return True


def test_hosts_that_disagree_raise_instead_of_crashing():
    run_ranks(_mismatch_body, 4, init=False)


def _train_ddp(rank, world):
    """A few SGD steps of a small model under our DDP; the parameters as lists."""
    import dsparallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = dsparallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8 * world, 16, generator=g), torch.randn(8 * world, 4, generator=g)
        opt.zero_grad()
        (ddp(x[8 * rank : 8 * rank + 8]) - y[8 * rank : 8 * rank + 8]).square().mean().backward()
        opt.step()
    # Buckets reduce in place only over one host's shared memory; across hosts
    # they stay flat (gloo's threads must not free the gradients).
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    assert (ddp.reducer.in_place_buckets == 0) == backend.multi_host
    return [p.detach().tolist() for p in model.parameters()]  # plain data through the queue


def _ddp_body(rank, world, hosts_of):
    if hosts_of is not None:
        _init_as_hosts(rank, hosts_of)
    else:
        dist.init_process_group("dsp")
    params = _train_ddp(rank, world)
    dist.destroy_process_group()
    return params


def _same_params(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), rtol=1e-6, atol=1e-6)


def test_ddp_across_two_hosts_equals_one_host():
    two = run_ranks(_ddp_body, 4, [0, 0, 1, 1], init=False)
    one = run_ranks(_ddp_body, 4, None, init=False)
    _same_params(two[0], one[0])


# ------------------------------------------------------- torchrun, netns

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_job.py")


def _agents(nnodes, nproc, master, per_agent_env, prefix=lambda i: []):
    """Starts one torchrun agent per simulated host; returns rank 0's output."""
    port = str(free_port())
    procs = []
    for i in range(nnodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes)]
        cmd += ["--node-rank", str(i), "--nproc-per-node", str(nproc)]
        cmd += ["--master-addr", master, "--master-port", port, JOB]
        env = {**os.environ, **per_agent_env(i)}
        procs.append(
            subprocess.Popen(
                prefix(i) + cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=180))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-2000:] + err[-3000:]
    return outs[0][0]


def _parse(out):
    layout = next(line for line in out.splitlines() if line.startswith("layout:"))
    params = json.loads(next(line for line in out.splitlines() if line.startswith("params:"))[8:])
    return layout, params


def test_torchrun_two_agents_as_two_hosts():
    layout, params = _parse(_agents(2, 2, "127.0.0.1", lambda i: {"DSP_NODE_ID": f"agent{i}"}))
    assert "multi_host=True hierarchical=True" in layout
    one_layout, one = _parse(_agents(1, 4, "127.0.0.1", lambda i: {}))
    assert "multi_host=False" in one_layout
    _same_params(params, one)


def _netns(cmd):
    return subprocess.run(["ip", *cmd], capture_output=True, text=True)


def test_two_network_namespaces_joined_by_veth():
    """Two 'hosts' that share nothing on the network but a veth pair."""
    tag = uuid.uuid4().hex[:6]
    ns, dev = [f"dsp{tag}{s}" for s in "ab"], [f"dv{tag}{s}" for s in "ab"]
    addr = ["10.231.7.1", "10.231.7.2"]
    require(
        shutil.which("ip") is not None and _netns(["netns", "add", ns[0]]).returncode == 0,
        "cannot create network namespaces here (needs root and iproute2)",
    )
    try:
        steps = [
            ["netns", "add", ns[1]],
            ["link", "add", dev[0], "type", "veth", "peer", "name", dev[1]],
        ]
        for i in range(2):
            steps += [
                ["link", "set", dev[i], "netns", ns[i]],
                ["-n", ns[i], "addr", "add", f"{addr[i]}/24", "dev", dev[i]],
                ["-n", ns[i], "link", "set", dev[i], "up"],
                ["-n", ns[i], "link", "set", "lo", "up"],
            ]
        for step in steps:
            done = _netns(step)
            # A failure here is the environment's, not our code's.
            require(
                done.returncode == 0,
                f"cannot build the veth pair: ip {' '.join(step)}: {done.stderr}",
            )
        out = _agents(
            2,
            2,
            addr[0],
            lambda i: {"DSP_NODE_ID": ns[i], "GLOO_SOCKET_IFNAME": dev[i]},
            prefix=lambda i: ["ip", "netns", "exec", ns[i]],
        )
        layout, params = _parse(out)
        assert "multi_host=True hierarchical=True" in layout
    finally:
        for n in ns:
            _netns(["netns", "del", n])
    one_layout, one = _parse(_agents(1, 4, "127.0.0.1", lambda i: {}))
    _same_params(params, one)


def _killed_body(rank, world):
    _init_as_hosts(rank, [0, 0, 1, 1])
    t = torch.ones(1000)
    dist.all_reduce(t)
    if rank == 3:
        os._exit(0)  # dies before the next all-reduce
    with pytest.raises(RuntimeError) as err:
        dist.all_reduce(torch.ones(100_000))
    return str(err.value)


def test_killed_rank_during_cross_host_all_reduce_raises_everywhere():
    messages = run_ranks(_killed_body, 4, init=False, pg_timeout_s=8, timeout=90, allow_exit=(3,))
    # Rank 3's host peer finds it dead in shared memory (local rank 1 of the
    # host whose global ranks are [2, 3]); the other host loses its gloo peers.
    assert "within this host (global ranks [2, 3]" in messages[2], messages[2]
    assert "rank(s) [1] did not arrive (a peer process died)" in messages[2], messages[2]
    for rank in (0, 1):
        assert "between hosts" in messages[rank], messages[rank]


# --------------------------------------------------------------------- load

KINDS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "barrier"]


def _resources():
    return (
        len(os.listdir("/proc/self/fd")),
        threading.active_count(),
        len(os.listdir("/proc/self/task")),
    )


def _soak_body(rank, world, count, seed):
    # A first group up and down, so that what torch keeps for good (its own
    # threads and files) is there before the count.
    dist.init_process_group("dsp")
    dist.barrier()
    dist.destroy_process_group()
    fds, py_threads, tasks = _resources()
    dist.init_process_group("dsp")
    rng = random.Random(seed)  # the same sequence of calls on every rank
    wrong = 0
    max_elems = 8 * 2**20 // 8
    for i in range(count):
        kind = rng.choice(KINDS)
        n = int(2 ** rng.uniform(0, 20)) if rng.random() > 0.02 else 0
        n = min(n - n % world, max_elems)
        if kind == "all_reduce":
            t = _values(rank, n, i)
            dist.all_reduce(t)
            wrong += int((t != sum(_values(r, n, i) for r in range(world))).sum())
        elif kind == "broadcast":
            root = rng.randrange(world)
            t = _values(rank, n, i)
            dist.broadcast(t, src=root)
            wrong += int((t != _values(root, n, i)).sum())
        elif kind == "all_gather":
            out = torch.empty(world * n, dtype=torch.int64)
            dist.all_gather_into_tensor(out, _values(rank, n, i))
            wrong += int((out != torch.cat([_values(r, n, i) for r in range(world)])).sum())
        elif kind == "reduce_scatter":
            out = torch.empty(n // world, dtype=torch.int64)
            dist.reduce_scatter_tensor(out, _values(rank, n, i))
            full = sum(_values(r, n, i) for r in range(world))
            wrong += int((out != full.view(world, -1)[rank]).sum())
        elif kind == "all_to_all":
            out = torch.empty(n, dtype=torch.int64)
            dist.all_to_all_single(out, _values(rank, n, i))
            want = torch.cat([_values(r, n, i).view(world, -1)[rank] for r in range(world)])
            wrong += int((out != want).sum())
        else:
            dist.barrier()
    dist.destroy_process_group()
    after = _resources()
    return wrong, (fds, py_threads, tasks), after


@pytest.mark.parametrize("count", [5000])
def test_soak_random_collectives_exact_and_leak_free(count):
    results = run_ranks(_soak_body, 4, count, 1234, init=False, timeout=280)
    for rank, (wrong, before, after) in enumerate(results):
        assert wrong == 0, f"rank {rank}: {wrong} wrong values"
        assert after == before, f"rank {rank}: fds/threads/tasks {before} -> {after}"


def _job_body(rank, world, salt):
    for i in range(300):
        t = _values(rank, 1 + (i * 97) % 50_000, salt + i)
        dist.all_reduce(t)
        want = sum(_values(r, t.numel(), salt + i) for r in range(world))
        assert torch.equal(t, want), f"job {salt}: wrong result at call {i}"
    return True


def test_two_jobs_at_once_do_not_interfere():
    errors = []

    def job(salt):
        try:
            run_ranks(_job_body, 2, salt, timeout=120)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=job, args=(s,)) for s in (0, 10_000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
