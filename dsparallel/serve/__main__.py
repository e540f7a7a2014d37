"""``torchrun --nproc-per-node N -m dsparallel.serve --model DIR
--tensor-parallel N [--dtype bfloat16|float32] [--quantize int8] [--port 8000]``: an
OpenAI-compatible server of a Hugging Face checkpoint (see the "Serving"
guide). Rank 0 serves HTTP; every rank runs its part of the model."""

from __future__ import annotations

import argparse
import json
import os
import sys


def parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m dsparallel.serve",
        description="Serve a Hugging Face checkpoint over tensor-parallel ranks "
        "(run it under torchrun).",
    )
    p.add_argument(
        "--model",
        required=True,
        help="the checkpoint directory (config.json, *.safetensors, tokenizer)",
    )
    p.add_argument(
        "--served-model-name",
        help="the name clients give as 'model' (default: the directory's name)",
    )
    p.add_argument("--tensor-parallel", type=int, default=None, help="default: every rank")
    p.add_argument("--pipeline-parallel", type=int, default=1)
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    p.add_argument(
        "--quantize",
        choices=("none", "int8"),
        default="none",
        help="int8: weight-only, per output channel, quantized on each rank at load",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--max-model-len", type=int, help="default: the config's max_position_embeddings"
    )
    p.add_argument("--block-size", type=int, default=16, help="positions per KV-cache block")
    p.add_argument(
        "--num-blocks", type=int, help="KV-cache blocks (default: from --kv-cache-memory)"
    )
    p.add_argument(
        "--kv-cache-memory",
        type=float,
        default=0.25,
        help="the share of the memory available at start given to the KV cache (default 0.25)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=512, help="tokens per step (prefill chunks)"
    )
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests before 429")
    return p.parse_args(argv)


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 << 30


def build(args):
    """The engine on every rank (the model, its tokenizer on rank 0, the pool)."""
    import torch
    import torch.distributed as dist

    import dsparallel
    from dsparallel.inference.fast_linear import quantize_int8
    from dsparallel.inference.paged import BlockPool
    from dsparallel.models import from_pretrained

    from .engine import Engine

    world = int(os.environ.get("WORLD_SIZE", "1"))
    pp = args.pipeline_parallel
    tp = args.tensor_parallel or world // pp
    if tp * pp != world:
        raise SystemExit(
            f"dsparallel.serve: --tensor-parallel {tp} x --pipeline-parallel {pp} must equal "
            f"the number of processes ({world})"
        )
    state = dsparallel.init_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    model = from_pretrained(args.model, state, dtype=dtype).eval()
    if args.quantize == "int8":
        quantize_int8(model)
    cache_dtype = model._dtype()
    limit = model.config.get("max_position_embeddings")
    max_model_len = args.max_model_len or limit or 4096
    if limit and max_model_len > limit:
        raise SystemExit(
            f"dsparallel.serve: --max-model-len {max_model_len} is more than the model's {limit}"
        )
    per_block = BlockPool.bytes_per_block(model, args.block_size, cache_dtype)
    if args.num_blocks:
        blocks = args.num_blocks
    else:
        blocks = int(_available_bytes() / max(world, 1) * args.kv_cache_memory) // per_block
        # More than every sequence at full length is never used.
        blocks = min(blocks, args.max_num_seqs * -(-max_model_len // args.block_size))
        if world > 1:  # every rank the same pool: the smallest
            box = torch.tensor([blocks])
            dist.all_reduce(box, op=dist.ReduceOp.MIN)
            blocks = int(box)
    pool = BlockPool(model, blocks, args.block_size, cache_dtype)
    tokenizer, defaults, eos = None, {}, ()
    if dist.get_rank() == 0:
        tokenizer, defaults, eos = _tokenizer_and_defaults(args.model, model.config)
    engine = Engine(
        model,
        tokenizer,
        pool,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting=args.max_waiting,
        eos_token_ids=eos,
    )
    return engine, tokenizer, defaults, state


def _tokenizer_and_defaults(path: str, config):
    """The checkpoint's tokenizer (None without one: prompts as ids), its
    generation_config.json's sampling defaults and end-of-sequence ids."""
    tokenizer = None
    if any(
        os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    defaults = {}
    gen = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen):
        with open(gen) as f:
            defaults = json.load(f)
    eos = defaults.get("eos_token_id", config.get("eos_token_id"))
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    eos = () if eos is None else tuple(eos if isinstance(eos, list) else [eos])
    return tokenizer, defaults, eos


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch.distributed as dist

    import dsparallel

    engine, tokenizer, defaults, state = build(args)
    rank = dist.get_rank()
    try:
        if rank != 0:
            engine.follow()
            return 0
        import uvicorn

        from .api import Server, make_app

        name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
        engine.start()
        app = make_app(Server(engine, tokenizer, name, defaults))
        print(
            f"dsparallel.serve: {name} at tp {state.tp_size} x pp {state.pp_size}, "
            f"{engine.pool.num_blocks} KV "
            f"blocks of {engine.pool.block_size} ({engine.pool.nbytes / 2**20:.0f} MiB a rank), "
            f"http://{args.host}:{args.port}/v1",
            flush=True,
        )
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
        return 0
    finally:
        if rank == 0:
            engine.stop()
        dsparallel.destroy_parallel()


if __name__ == "__main__":
    sys.exit(main())
