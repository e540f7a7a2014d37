"""Decoding a Llama of about 300M parameters on the CPU: ours at tp 2 and
tp 1 against ``transformers``' ``generate``, DeepSpeed's ``init_inference``
tensor parallel and torch's ``parallelize_module`` over gloo and "dsp", in
one run, the same weights everywhere.

    python benchmarks/inference.py [--new 16] [--prompt 128] [--rounds 5] [--per-round 2]
        [--dtypes float32,bfloat16,int8]

Greedy decoding of random prompts of ``--prompt`` tokens at batch 1 and 8.
A sample is one ``generate`` of ``--new`` tokens minus one of a single token
(the prefill), divided by ``--new`` - 1: the decode latency per token
(slowest rank), and batch / latency the decode tokens/s. Every
configuration is set up once (its processes kept, idle while another
runs) and the configurations are timed in ``--rounds`` interleaved rounds,
their order rotating, ``--per-round`` samples each: a configuration's
repeats are its rounds' medians. Two processes of one thread each for
every tensor-parallel run, one process of two threads for the one-process
runs: the same two cores. The share of our tp 2 decode
spent in the tensor-parallel collectives (the all-reduces after the
attention and MLP, the logits' all-gather) is measured with torch's
profiler over one batch-1 generation, and what its decode steps make
glibc's allocator do (``decode_memory``) in processes of their own.

Each dtype is its own group of configurations, timed together: float32,
bfloat16 (every system's weights and compute) and int8 (ours only:
weight-only int8 with bfloat16 activations, ``quantize_int8``). Each
group also measures its floor: the weight bytes one of our tp 2 ranks
reads per decode step over the memory bandwidth of one such process
(two processes of one thread each summing 512 MB at once, the median
rate), the least a batch-1 step can take.

Each baseline at its defaults and, where it has them, its best settings:
``transformers`` with its default dynamic cache and with its static cache
(``torch.compile`` left out: compiling a 20-layer model on two cores takes
longer than the whole run); DeepSpeed's CPU inference has one setting
(AutoTP with its shared-memory all-reduce: kernel injection is CUDA only);
``parallelize_module`` over gloo (torch's CPU default) and over "dsp",
with torchtitan's Llama plan: every projection, and the embedding and the
LM head (as ours) split over the ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import (  # noqa: E402
    ROUNDS,
    malloc_bytes,
    remove_deepspeed_segments,
    round_stats,
    save,
    stats,
)
from launch import Workers, run_ranks  # noqa: E402

LLAMA = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=20,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=1024,
)
BATCHES = (1, 8)
TP_PLAN = {
    "self_attn.q_proj": "col",
    "self_attn.k_proj": "col",
    "self_attn.v_proj": "col",
    "self_attn.o_proj": "row",
    "mlp.gate_proj": "col",
    "mlp.up_proj": "col",
    "mlp.down_proj": "row",
}


def _prompts(batch, args):
    import torch

    g = torch.Generator().manual_seed(batch)
    return torch.randint(3, LLAMA["vocab_size"], (batch, args["prompt"]), generator=g)


def _rounds(run, args, distributed: bool, extra=None):
    """The function each interleaved round calls on this configuration's
    ranks: per batch size, ``--per-round`` samples of the decode latency per
    token (s; the slowest rank's). The first round warms up first.
    ``extra``: other commands it answers (name -> function)."""
    import torch

    def wall(fn):
        if distributed:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0])
        if distributed:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return t.item()

    warm = []

    def one_round(command):
        if command != "round":
            return extra[command]()
        out = {}
        for batch in BATCHES:
            ids = _prompts(batch, args)
            if not warm:
                run(ids, 2)
            samples = []
            for _ in range(args["per_round"]):
                prefill = wall(lambda ids=ids: run(ids, 1))
                full = wall(lambda ids=ids: run(ids, args["new"]))
                samples.append(max(full - prefill, 1e-9) / (args["new"] - 1))
            out[f"batch{batch}"] = samples
        warm.append(True)
        return out

    return one_round


def _ours(rank, world, path, args, threads, dtype="float32"):
    import torch

    import dsparallel
    from dsparallel.inference import generate
    from dsparallel.inference.fast_linear import quantize_int8
    from dsparallel.models import from_pretrained

    torch.set_num_threads(threads)
    state = dsparallel.init_parallel(world) if world > 1 else None
    int8 = dtype == "int8"
    model = from_pretrained(path, state, dtype=torch.bfloat16 if int8 else getattr(torch, dtype))
    if int8:
        quantize_int8(model)

    def run(ids, new):
        return generate(model, ids, max_new_tokens=new)

    def weight_bytes():  # this rank's, as a decode step reads them
        quantized = getattr(model, "_int8_weights", {})
        total = sum(q.numel() + s.numel() * s.element_size() for q, s in quantized.values())
        for p in model.parameters():
            if p.data_ptr() not in quantized:
                total += p.numel() * p.element_size()
        return total

    extra = {"weight_bytes": weight_bytes}
    if world > 1:
        extra["collective_share"] = lambda: _collective_share(run, args)
    serve = _rounds(run, args, distributed=world > 1, extra=extra)
    if world > 1:
        serve.close = dsparallel.destroy_parallel
    return serve


def _bandwidth(rank, world, path, args):
    """The memory bandwidth one process of one thread gets while the other
    reads too (B/s, the median of 7 passes over 512 MB)."""
    import statistics

    import torch

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    x = torch.ones(128 << 20)
    x.sum()

    def measure():
        rates = []
        for _ in range(7):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            x.sum()
            rates.append(x.numel() * 4 / (time.perf_counter() - t0))
        t = torch.tensor([statistics.median(rates)])
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return t.item()

    def serve(command):
        return measure()

    serve.close = torch.distributed.destroy_process_group
    return serve


# glibc without its per-thread cache and fast bins: freed chunks are free
# at once, so the bytes in use are the bytes live (with them, transient
# buffers of every new key length would linger as "in use").
EXACT_MALLOC = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0"}


def decode_memory(model, ids, new: int) -> dict:
    """What generating ``new`` tokens after ``ids`` makes the allocator do
    past the third decode step (the cache and the first steps' buffers
    are in place by then): the growth of the bytes glibc holds from the
    system and of the bytes in use, read after every step (cyclic garbage
    collected first; exact in a process started with ``EXACT_MALLOC``),
    and whether the cache tensors ever moved (they are written in place)."""
    import gc

    import torch

    from dsparallel.inference import KVCache, generate

    # Read into a tensor allocated beforehand: a list of readings would
    # itself grow the bytes in use.
    seen, step = torch.zeros(new, 3, dtype=torch.long), model.cached_step
    calls, first_cache = [0], []

    def recorded(*a, **kw):
        out = step(*a, **kw)
        gc.collect()
        ptrs = [t.data_ptr() for slot in a[3].values() for t in slot.values()]
        first_cache[:] = first_cache or ptrs
        seen[calls[0]] = torch.tensor([*malloc_bytes(), ptrs != first_cache])
        calls[0] += 1
        return out

    model.cached_step = recorded
    try:
        generate(model, ids, max_new_tokens=new)
    finally:
        del model.cached_step
    held, used, moved = seen[3 : calls[0]].unbind(1)
    return {
        "steps": len(held),
        "held_growth_bytes": int(held.max() - held[0]),
        "in_use_growth_bytes": int(used.max() - used[0]),
        "cache_moved": bool(moved.any()),
        "cache_bytes_per_token": KVCache(model, 1, 1, torch.float32).nbytes,
    }


def _ours_decode_memory(rank, world, path, args):
    import torch

    import dsparallel
    from dsparallel.models import from_pretrained

    torch.set_num_threads(1)
    state = dsparallel.init_parallel(world)
    model = from_pretrained(path, state, dtype=torch.float32)
    result = decode_memory(model, _prompts(1, args), 4 * args["new"])
    every = [None] * world
    torch.distributed.all_gather_object(every, result)
    dsparallel.destroy_parallel()
    return every


def _collective_share(run, args) -> dict:
    """The share of a batch-1 decode's time spent in our tensor-parallel
    collectives (profiler CPU time of their ops over the wall time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    ids = _prompts(1, args)
    run(ids, 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        run(ids, 1)
        prefill = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU]) as prof_full:
        t0 = time.perf_counter()
        run(ids, args["new"])
        full = time.perf_counter() - t0

    def comm(p):
        names = ("reduce_from_tensor_parallel_region", "gather_from_tensor_parallel_region")
        return (
            sum(e.self_cpu_time_total for e in p.key_averages() if any(n in e.key for n in names))
            / 1e6
        )

    share = (comm(prof_full) - comm(prof)) / max(full - prefill, 1e-9)
    t = torch.tensor([share])
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return {"decode_share": t.item()}


def _hf_model(path, threads, dtype="float32"):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    return model


def _hf_run(model, cache=None):
    import torch

    extra = {} if cache is None else {"cache_implementation": cache}

    def run(ids, new):
        with torch.no_grad():
            return model.generate(
                ids,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                **extra,
            )

    return run


def _transformers(rank, world, path, args, dtype, cache=None):
    return _rounds(_hf_run(_hf_model(path, 2, dtype), cache), args, distributed=False)


def _torch_tp(rank, world, path, args, backend, dtype):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import dsparallel  # noqa: F401  (registers "dsp")

    dist.init_process_group(backend)
    model = _hf_model(path, 1, dtype)
    mesh = init_device_mesh("cpu", (world,))
    styles = {"col": ColwiseParallel, "row": RowwiseParallel}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {k: styles[v]() for k, v in TP_PLAN.items()})
    # The embedding and the LM head split too, as torchtitan's Llama plan
    # does (without sequence parallelism: the embedding's rows with its
    # output all-reduced, the head's vocabulary columns with the logits
    # gathered), and as ours are.
    parallelize_module(
        model,
        mesh,
        {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    serve = _rounds(_hf_run(model), args, distributed=True)
    serve.close = dist.destroy_process_group
    return serve


def _deepspeed(rank, world, path, args, dtype):
    import contextlib

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_SIZE"] = str(world)  # without it its shm all-reduce crashes
    os.environ["LOCAL_RANK"] = str(rank)  # without it DeepSpeed looks for MPI
    import torch

    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        model = _hf_model(path, 1, dtype)
        engine = deepspeed.init_inference(
            model,
            tensor_parallel={"tp_size": world},
            dtype=getattr(torch, dtype),
            replace_with_kernel_inject=False,
        )
    serve = _rounds(_hf_run(engine.module), args, distributed=True)

    def close():
        torch.distributed.destroy_process_group()
        remove_deepspeed_segments(rank)

    serve.close = close
    return serve


def _configs(dtype, path, args):
    """(name, function, world, arguments) of one dtype's group."""
    ours = [
        ("ours, tp 2 (2 processes)", _ours, 2, (path, args, 1, dtype)),
        ("ours, tp 1 (1 process, 2 threads)", _ours, 1, (path, args, 2, dtype)),
    ]
    if dtype == "int8":  # no baseline decodes int8 weights on the CPU here
        return ours
    return ours + [
        ("transformers generate (1 process, 2 threads)", _transformers, 1, (path, args, dtype)),
        (
            "transformers generate, static cache (1 process, 2 threads)",
            _transformers,
            1,
            (path, args, dtype, "static"),
        ),
        (
            "DeepSpeed init_inference, tp 2 (its shm all-reduce)",
            _deepspeed,
            2,
            (path, args, dtype),
        ),
        ('torch parallelize_module, tp 2 over "dsp"', _torch_tp, 2, (path, args, "dsp", dtype)),
        ("torch parallelize_module, tp 2 over gloo", _torch_tp, 2, (path, args, "gloo", dtype)),
    ]


def _group(dtype, path, args, rounds) -> list[dict]:
    """One dtype's configurations, set up once and kept (idle while another
    runs), then timed in interleaved rounds, their order rotating: a drift
    of the machine favours none. The first row (ours, tp 2) carries the
    group's floor and collective share."""
    workers, rows = {}, []
    for name, fn, world, fargs in _configs(dtype, path, args):
        try:
            workers[name] = Workers(fn, world, *fargs)
            rows.append({"system": name, "dtype": dtype})
        except RuntimeError as e:  # a baseline that cannot run here is reported as such
            print(f"{name} ({dtype}): did not run ({e})")
            rows.append({"system": name, "dtype": dtype, "error": str(e)})
    bandwidth = Workers(_bandwidth, 2, path, args)
    samples = {name: {b: [] for b in BATCHES} for name in workers}
    rates = []
    names = list(workers)
    try:
        for rnd in range(rounds):
            rates.append(bandwidth.call("measure"))
            for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                for b, values in workers[name].call("round").items():
                    samples[name][int(b.removeprefix("batch"))].append(values)
        ours = workers[names[0]]
        rows[0]["collective_share"] = ours.call("collective_share")
        weight_bytes = ours.call("weight_bytes")
    finally:
        bandwidth.close()
        for w in workers.values():
            w.close()
    for row in rows:
        if "error" in row:
            continue
        for b in BATCHES:
            per_round = samples[row["system"]][b]
            row[f"batch{b}"] = {
                "latency_s": round_stats(per_round),
                "tokens_per_s": round_stats([[b / t for t in r] for r in per_round]),
            }
        print(
            f"{row['system']} ({dtype})",
            " ".join(
                f"batch {b}: {row[f'batch{b}']['latency_s']['median'] * 1e3:.1f} ms/token"
                for b in BATCHES
            ),
        )
    rate = stats(rates)
    rows[0]["floor"] = {
        "weight_bytes_per_rank": weight_bytes,
        "bandwidth_bytes_per_s": rate,
        "floor_s": weight_bytes / rate["median"],
    }
    print(
        f"{dtype} floor: {weight_bytes / 2**20:.0f} MiB a rank at "
        f"{rate['median'] / 1e9:.1f} GB/s = {rows[0]['floor']['floor_s'] * 1e3:.1f} ms/token"
    )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds")
    ap.add_argument("--per-round", type=int, default=2, help="samples per round")
    ap.add_argument("--dtypes", default="float32,bfloat16,int8", help="comma-separated groups")
    a = ap.parse_args()
    args = {"new": a.new, "prompt": a.prompt, "per_round": a.per_round}
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    rows = []
    with tempfile.TemporaryDirectory() as root:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**LLAMA))
        print(f"llama: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
        path = os.path.join(root, "llama")
        model.save_pretrained(path)
        del model
        rows = []
        for dtype in a.dtypes.split(","):
            rows += _group(dtype, path, args, a.rounds)
        # Our tp 2 decode under the allocator's exact counters, in processes
        # of their own (the setting slows malloc: no timing runs there).
        os.environ.update(EXACT_MALLOC)
        try:
            memory = run_ranks(_ours_decode_memory, 2, path, args)
        finally:
            os.environ.pop("GLIBC_TUNABLES")
        rows[0]["decode_memory"] = {
            "per_rank": memory,
            "steps": memory[0]["steps"],
            "in_use_growth_bytes": max(m["in_use_growth_bytes"] for m in memory),
            "held_growth_bytes": max(m["held_growth_bytes"] for m in memory),
        }
        print(
            "ours tp 2, decode memory over {steps} steps: in-use growth {in_use_growth_bytes} B, "
            "held growth {held_growth_bytes} B".format(**rows[0]["decode_memory"])
        )
    save("inference", rows, {**vars(a), "llama": LLAMA})
    for dtype in a.dtypes.split(","):
        group = [r for r in rows if r["dtype"] == dtype and "error" not in r]
        base = {b: group[0][f"batch{b}"]["latency_s"]["median"] for b in BATCHES}
        print(f"\n{dtype}: latency per token (ms), ours tp 2 / theirs")
        for r in group:
            cells = [
                f"{r[f'batch{b}']['latency_s']['median'] * 1e3:7.1f} "
                f"({base[b] / r[f'batch{b}']['latency_s']['median']:.2f}x)"
                for b in BATCHES
            ]
            print(f"  {r['system']:<55} " + "  ".join(cells))
        share = group[0]["collective_share"]["decode_share"]
        print(f"ours tp 2: {share:.0%} of a batch-1 decode step in the tensor-parallel collectives")


if __name__ == "__main__":
    main()
