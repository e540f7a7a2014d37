"""Context parallelism on the CPU: what it saves and what it costs.

    python benchmarks/context_parallel.py [--seq 2048] [--cap-mib 128]

The GPT of the training job, wider (hidden 256, 8 heads, 4 layers), batch 1:

- activation memory per rank: the bytes autograd saves for backward in one
  forward (saved-tensor hooks, each storage counted once, parameters
  excluded) at ``--seq`` tokens, at cp 1 (one process), 2 and 4;
- the longest sequence whose saved activations fit ``--cap-mib`` per rank
  at cp 1, 2 and 4 (a search over multiples of 64 tokens);
- the time of a training step (forward and backward) at ``--seq`` tokens:
  one process on the two cores against cp 2 (two processes of one thread)
  with ring attention, Ulysses, and the all-gather approach written here
  as the baseline (Megatron's ``all_gather`` variant: every rank gathers
  the whole keys and values, then attends each query chunk to the keys up
  to its end, skipping the blocks past it as causal attention allows), in
  interleaved rounds;
- what ring attention's transfers cost: the ring op's time outside its
  kernels, and within it the time it waits at the exchanges (profiled as
  ``dsparallel::ring_wait``: the transfers not hidden behind attention,
  with the other rank's lag), against the same messages sent around the
  ring alone;
- torch's own ``context_parallel`` on the same model, where it runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import ROUNDS, round_stats, save  # noqa: E402
from launch import Workers, run_ranks  # noqa: E402

MODEL = dict(vocab_size=128, hidden=256, heads=8, layers=4)
MAX_SEQ = 1 << 14


def _model(cp: int, mode: str, seq_len: int = MAX_SEQ):
    """This rank's GPT (cp > 1: over init_parallel's cp group) and the
    function that runs one forward on ``seq`` tokens and returns the loss."""
    import torch

    import dsparallel
    from dsparallel.context_parallel import shard_sequence
    from dsparallel.models import GPTConfig, build_stage, gpt_loss

    state = dsparallel.init_parallel(context_parallel_size=cp)
    cfg = GPTConfig(seq_len=seq_len, **MODEL)
    module = build_stage(
        cfg, group=state.tp_group, context_parallel_group=state.cp_group, cp_mode=mode
    )
    loss_fn = gpt_loss(state.tp_group)

    def forward(seq: int):
        g = torch.Generator().manual_seed(seq)
        ids = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=g)
        x, y = ids[:, :-1], ids[:, 1:]
        if cp > 1:
            x, y = shard_sequence(x, state.cp_group), shard_sequence(y, state.cp_group)
        return loss_fn(module(x), y)

    return state, module, forward


def saved_bytes(module, forward, seq: int) -> int:
    """Bytes of the tensors autograd saves in one forward, parameters
    excluded, each storage once."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward(seq)
    return sum(seen.values())


def _memory(rank, world, args):
    """Saved bytes at --seq, and the longest sequence under the cap."""
    import torch

    import dsparallel

    torch.set_num_threads(1)
    _, module, forward = _model(world, "ring")
    at_seq = saved_bytes(module, forward, args["seq"])
    cap = args["cap_mib"] << 20
    step = 64 * world  # a multiple of 2 cp (the load-balanced layout)
    lo, hi = 0, MAX_SEQ // step
    while lo < hi:  # the largest multiple of step whose bytes fit
        mid = (lo + hi + 1) // 2
        if saved_bytes(module, forward, mid * step) <= cap:
            lo = mid
        else:
            hi = mid - 1
    t = torch.tensor([float(at_seq), float(lo * step)])
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    dsparallel.destroy_parallel()
    return {"saved_bytes": int(t[0]), "longest_seq": int(t[1])}


def _all_gather_attention(q, k, v, group, causal=True, doc_ids=None, scale=None):
    """The baseline: gather every rank's keys and values (autograd's
    all-gather: the backward reduce-scatters their gradients), put them in
    sequence order, attend each of this rank's two query chunks (chunk r
    and 2C - 1 - r of the load-balanced layout) to the keys up to its own
    end only, the diagonal block masked: the key blocks past a query chunk
    are skipped, as causal all-gather context parallelism does (Megatron's
    ``all_gather`` variant, torch's), so it computes what the ring does."""
    import torch
    import torch.distributed.nn.functional as dnn
    import torch.nn.functional as F

    from dsparallel.context_parallel.layout import natural_order

    size, local = group.size(), q.shape[2]
    order = natural_order(size, local)
    k = torch.cat(dnn.all_gather(k.contiguous(), group=group), dim=2).index_select(2, order)
    v = torch.cat(dnn.all_gather(v.contiguous(), group=group), dim=2).index_select(2, order)
    c, rank = local // 2, group.rank()
    out = []
    for chunk, queries in ((rank, q[:, :, :c]), (2 * size - 1 - rank, q[:, :, c:])):
        end = (chunk + 1) * c  # the keys before and within this chunk
        mask = torch.ones(c, end, dtype=torch.bool).tril(diagonal=end - c)
        out.append(
            F.scaled_dot_product_attention(
                queries, k[:, :, :end], v[:, :, :end], attn_mask=mask, scale=scale, enable_gqa=True
            )
        )
    return torch.cat(out, dim=2)


def _stepper(rank, world, args, mode):
    """One training step's time (forward and backward), slowest rank."""
    import torch

    import dsparallel

    torch.set_num_threads(2 if world == 1 else 1)
    if mode == "all_gather":
        # context_attention, which the attention layers call, reads the
        # module's ring_attention at each call.
        import dsparallel.context_parallel.attention as attention

        attention.ring_attention = _all_gather_attention
    _, module, forward = _model(world, "ring" if mode == "all_gather" else mode)

    def step():
        torch.distributed.barrier()
        t0 = time.perf_counter()
        forward(args["seq"]).backward()
        t = torch.tensor([time.perf_counter() - t0])
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        module.zero_grad(set_to_none=True)
        return t.item()

    step()  # warm-up

    def serve(command):
        return [step() for _ in range(args["per_round"])]

    serve.close = dsparallel.destroy_parallel
    return serve


def _ring_overlap(rank, world, args):
    """What the ring's communication costs in one layer's attention at
    --seq tokens, forward and backward: the time the ring op spends outside
    its kernels (its self time in the profiler: waiting at the exchanges,
    copying) against the time of the same messages sent around the ring
    with nothing else to do."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import dsparallel
    from dsparallel.context_parallel import ring_attention

    torch.set_num_threads(1)
    cp = dsparallel.init_parallel(context_parallel_size=world).cp_group
    heads, dim = MODEL["heads"], MODEL["hidden"] // MODEL["heads"]
    shape = (1, heads, args["seq"] // world, dim)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    reps = 5

    def attention():
        out = ring_attention(q, k, v, cp, causal=True)
        out.backward(torch.ones_like(out))

    attention()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            attention()
    ring = [e for e in prof.key_averages() if "ring_attention" in e.key or "RingAttention" in e.key]
    outside = sum(e.self_cpu_time_total for e in ring) / reps / 1e6
    inside = sum(e.cpu_time_total for e in ring) / reps / 1e6
    waits = sum(e.cpu_time_total for e in prof.key_averages() if e.key == "dsparallel::ring_wait")
    waits = waits / reps / 1e6
    # The messages alone: keys and values C - 1 hops forward and backward,
    # their gradients C hops.
    block = torch.empty(2, *shape)
    received = torch.empty_like(block)
    nxt, prev = (cp.rank() + 1) % world, (cp.rank() - 1) % world

    def messages():
        for _ in range(3 * world - 2):
            r = dist.irecv(received, group=cp, group_src=prev)
            s = dist.isend(block, group=cp, group_dst=nxt)
            r.wait()
            s.wait()

    messages()
    dist.barrier(group=cp)
    t0 = time.perf_counter()
    for _ in range(reps):
        messages()
    alone = (time.perf_counter() - t0) / reps
    t = torch.tensor([outside, inside, alone])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    # Per rank: the rank whose kernels take longer waits least; what it
    # still waits is the transfers' exposed time (at most).
    per_rank = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(per_rank, torch.tensor(waits))
    dsparallel.destroy_parallel()
    outside, inside, alone = t.tolist()
    return {
        "ring_op_s": inside,
        "outside_kernels_s": outside,
        "waits_s": [w.item() for w in per_rank],
        "messages_alone_s": alone,
    }


def _torch_context_parallel(rank, world, args):
    """torch's context_parallel around the one-process GPT's forward and
    backward (its SDPA dispatcher patched), cp over the whole world."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    from dsparallel.models import GPTConfig, build_stage, gpt_loss

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    cfg = GPTConfig(seq_len=args["seq"], **MODEL)
    solo = [dist.new_group([r]) for r in range(world)][rank]
    module = build_stage(cfg, group=solo)
    ids = torch.randint(0, cfg.vocab_size, (1, args["seq"] + 1))
    x, y = ids[:, :-1].clone(), ids[:, 1:].clone()
    try:
        with context_parallel(mesh, buffers=[x, y], buffer_seq_dims=[1, 1]):
            gpt_loss(solo)(module(x), y).backward()
        return {"ran": True}
    except Exception as e:  # what torch says, reported as such
        return {"ran": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--cap-mib", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--per-round", type=int, default=2)
    a = ap.parse_args()
    args = {"seq": a.seq, "cap_mib": a.cap_mib, "per_round": a.per_round}

    memory = {cp: run_ranks(_memory, cp, args) for cp in (1, 2, 4)}
    for cp, m in memory.items():
        print(
            f"cp {cp}: {m['saved_bytes'] / 2**20:.1f} MiB saved per rank at {a.seq} tokens "
            f"({m['saved_bytes'] / memory[1]['saved_bytes']:.2f}x one process); longest "
            f"sequence under {a.cap_mib} MiB: {m['longest_seq']} "
            f"({m['longest_seq'] / memory[1]['longest_seq']:.2f}x)"
        )
    configs = {
        "one process (2 threads)": (1, "ring"),
        "ours, ring, cp 2": (2, "ring"),
        "ours, Ulysses, cp 2": (2, "ulysses"),
        "all-gather keys and values, cp 2 (baseline)": (2, "all_gather"),
    }
    workers = {
        name: Workers(_stepper, world, args, mode) for name, (world, mode) in configs.items()
    }
    names, samples = list(workers), {name: [] for name in workers}
    for rnd in range(a.rounds):
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            samples[name].append(workers[name].call("round"))
    for w in workers.values():
        w.close()
    rows = [
        {"kind": "memory", "cp": cp, **m, "seq": a.seq, "cap_mib": a.cap_mib}
        for cp, m in memory.items()
    ]
    for name, per_round in samples.items():
        rows.append({"kind": "step", "system": name, "step_s": round_stats(per_round)})
        print(f"{name}: {statistics.median(sum(per_round, [])) * 1e3:.0f} ms per step")
    overlap = run_ranks(_ring_overlap, 2, args)
    rows.append({"kind": "ring_overlap", "cp": 2, **overlap})
    print(
        "ring cp 2, one layer's attention forward and backward: {ring_op_s:.4f} s, of which "
        "{outside_kernels_s:.4f} s outside the kernels, {waits} s waiting at the "
        "exchanges per rank; the same messages alone {messages_alone_s:.4f} s".format(
            waits=" / ".join(f"{w:.4f}" for w in overlap["waits_s"]), **overlap
        )
    )
    torch_cp = run_ranks(_torch_context_parallel, 2, args)
    rows.append({"kind": "torch_context_parallel", **torch_cp})
    print("torch context_parallel:", torch_cp)
    save("context_parallel", rows, {**vars(a), "model": MODEL})


if __name__ == "__main__":
    main()
