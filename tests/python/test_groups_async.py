"""Registration, sub-groups, concurrent groups and threads, async work and
futures, and torch's own DDP over "dsp"."""

import threading

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks


def test_import_registers_dsp_idempotently():
    import dsparallel
    from dsparallel import backend

    assert "DSP" in dist.Backend._plugins
    import dsparallel_autoload

    backend.register()  # second call: no error, still one entry
    # The creator is ours: the package's, or the entry point's lazy one that
    # registered "dsp" at `import torch` when the package is installed.
    creator = dist.Backend._plugins["DSP"].creator_fn
    assert creator in (backend._create_backend, dsparallel_autoload._create_backend)
    assert dsparallel.__version__


def _device_string_body(rank, n):
    assert dist.get_backend() in ("dsp", "cpu:dsp,cuda:gloo")
    t = torch.ones(3) * rank
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), n * (n - 1) / 2))
    return dist.get_backend()


def test_device_backend_string():
    run_ranks(_device_string_body, 2, backend="cpu:dsp,cuda:gloo")


def _subgroups_body(rank, n):
    evens = dist.new_group([r for r in range(n) if r % 2 == 0], backend="dsp")
    odds = dist.new_group([r for r in range(n) if r % 2 == 1], backend="dsp")
    mine = evens if rank % 2 == 0 else odds
    members = [r for r in range(n) if r % 2 == rank % 2]
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    assert t.item() == sum(members)
    # a sub-group's ranks are renumbered: broadcast from the group's first rank
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=members[0], group=mine)
    assert b.item() == members[0]
    # the default group still works in between
    w = torch.ones(1)
    dist.all_reduce(w)
    assert w.item() == n


def test_subgroups():
    run_ranks(_subgroups_body, 4)


def _threads_body(rank, n):
    groups = [dist.new_group(backend="dsp") for _ in range(3)]
    errors = []

    def worker(i, g):
        try:
            for it in range(200):
                t = torch.full((1000 + i,), float(rank + it))
                dist.all_reduce(t, group=g)
                expect = sum(r + it for r in range(n))
                assert torch.all(t == expect), (i, it)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i, g)) for i, g in enumerate(groups)]
    for th in threads:
        th.start()
    # ... while the main thread uses the default group
    for it in range(100):
        t = torch.tensor([float(it)])
        dist.all_reduce(t)
        assert t.item() == it * n
    for th in threads:
        th.join()
    assert not errors, errors


def test_concurrent_groups_from_threads():
    run_ranks(_threads_body, 2)


def _async_body(rank, n):
    ts = [torch.full((100_000,), float(rank + i)) for i in range(8)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    # futures complete with the output tensors
    futs = [w.get_future() for w in works]
    torch.futures.wait_all(futs)
    for i, (t, f) in enumerate(zip(ts, futs)):
        assert torch.all(t == sum(r + i for r in range(n)))
        assert f.value()[0] is not None
        assert torch.equal(f.value()[0], t)
    for w in works:
        assert w.wait()
        assert w.is_completed()
    # a chained callback sees the reduced tensor
    t = torch.ones(4)
    fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    assert torch.equal(fut.wait(), torch.full((4,), 2.0 * n))
    # async all_gather returns at once and completes in order
    outs = [torch.empty(3) for _ in range(n)]
    w = dist.all_gather(outs, torch.full((3,), float(rank)), async_op=True)
    w.wait()
    assert [o[0].item() for o in outs] == list(map(float, range(n)))


def test_async_work_and_futures():
    run_ranks(_async_body, 3)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 4)
        self.register_buffer("seen", torch.zeros(1))

    def forward(self, x):
        self.seen += 1
        return self.b(torch.relu(self.a(x)))


def _drop_with_callback_pending_body(rank, n):
    """A Python reference is the last one to a "dsp" backend while a
    collective whose future has a Python callback still runs: the destructor
    waits for the worker, which needs the GIL to run the callback. Destroying
    with the GIL held hangs."""
    import os
    import time

    dist.init_process_group("dsp")
    ran = []
    if rank == 0:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        t = torch.ones(4)
        work = dist.all_reduce(t, async_op=True)
        fut = work.get_future().then(lambda f: ran.append(f.value()[0].sum().item()))
        dist.destroy_process_group()
        threads = len(os.listdir("/proc/self/task"))
        del work, backend  # the last reference: the destructor runs here
        assert len(os.listdir("/proc/self/task")) < threads  # it did run (worker joined)
        fut.wait()
    else:
        time.sleep(1.0)  # rank 0 drops the group before this all-reduce starts
        dist.all_reduce(torch.ones(4))
        dist.destroy_process_group()
    return ran


def test_dropping_a_group_with_a_python_callback_pending():
    ran = run_ranks(_drop_with_callback_pending_body, 2, init=False, timeout=60)
    assert ran[0] == [8.0]


def _ddp_train(backend_group):
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(_Net(), process_group=backend_group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(5):
        x = torch.randn(8, 16, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp_body(rank, n):
    gloo = dist.new_group(backend="gloo")
    ours = _ddp_train(None)
    theirs = _ddp_train(gloo)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    # and every rank holds the same parameters
    for p in ours:
        ref = p.clone()
        dist.broadcast(ref, 0)
        assert torch.equal(ref, p)


@pytest.mark.parametrize("world", [2, 3])
def test_torch_ddp_over_dsp_matches_gloo(world):
    run_ranks(_ddp_body, world)
