"""Serving a Llama of about 300M parameters on the CPU to 1, 4 and 16
concurrent clients: ``python -m dsparallel.serve`` at tp 2 (continuous
batching) against ``transformers``' ``generate`` and DeepSpeed's
``init_inference`` at tp 2, each serving the clients one by one (their
default: one request, one ``generate``) and, their best here, all at once
as one static batch. The same weights, dtype and requests everywhere.

    python benchmarks/serve.py [--clients 1,4,16] [--prompt 128] [--new 32]
        [--rounds 5] [--dtype bfloat16] [--png docs/figures/serve-throughput.png]

Every client sends one request at the same moment: a distinct prompt of
``--prompt`` token ids, ``--new`` tokens generated greedily (no early
stop). Throughput is the tokens generated over the time from the requests'
start to the last one's end; time to first token is each request's wait
for its first generated token (the median over the clients). Ours is asked
over HTTP (streamed, server-sent events) by a thread per client; the
baselines run in processes of their own with the requests in hand (no HTTP
at all, which favours them) and their first token timed by a ``generate``
streamer. Two processes of one thread each for tp 2, one process of two
threads for ``transformers``: the same two cores. Every system is set up
once and the systems are timed in interleaved rounds, their order
rotating.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import ROUNDS, remove_deepspeed_segments, round_stats, save  # noqa: E402
from inference import LLAMA  # noqa: E402
from launch import Workers  # noqa: E402

from dsparallel.spawn import free_port  # noqa: E402


def _prompts(n: int, length: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(n)
    return torch.randint(3, LLAMA["vocab_size"], (n, length), generator=g).tolist()


class _Server:
    """Our server under torchrun, and the clients that ask it."""

    def __init__(self, path: str, args: dict):
        self.port = free_port()
        blocks = max(args["clients"]) * (-(-(args["prompt"] + args["new"]) // 16) + 1)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port()), "-m", "dsparallel.serve", "--model", path,
            "--tensor-parallel", "2", "--port", str(self.port), "--dtype", args["dtype"],
            "--num-blocks", str(blocks), "--max-num-batched-tokens", "512",
        ]  # fmt: skip
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(self.url("/health"), timeout=5).read()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.log.seek(0)
                    tail = self.log.read()[-2000:]
                    raise RuntimeError(f"the server did not start: {tail}") from None
                time.sleep(1)

    def url(self, route: str) -> str:
        return f"http://127.0.0.1:{self.port}{route}"

    def one(self, prompt, new, start, out, i):
        body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True}
        body |= {"ignore_eos": True, "return_token_ids": True}
        request = urllib.request.Request(
            self.url("/v1/completions"),
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        first, tokens = None, 0
        with urllib.request.urlopen(request, timeout=600) as response:
            for line in response:
                if not line.startswith(b"data: {"):
                    continue
                got = len(json.loads(line[6:])["choices"][0].get("token_ids", []))
                if got and first is None:
                    first = time.perf_counter() - start
                tokens += got
        out[i] = (first, time.perf_counter() - start, tokens)

    def __call__(self, n: int, args: dict) -> dict:
        prompts, out = _prompts(n, args["prompt"]), [None] * n
        start = time.perf_counter()
        threads = [
            threading.Thread(target=self.one, args=(p, args["new"], start, out, i))
            for i, p in enumerate(prompts)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any(o is None or o[2] != args["new"] for o in out):
            raise RuntimeError(f"a request did not get its {args['new']} tokens: {out}")
        return {
            "tokens_per_s": n * args["new"] / max(o[1] for o in out),
            "ttft_s": statistics.median(o[0] for o in out),
        }

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _baseline(rank, world, path, args, kind):
    """``transformers`` (one process) or DeepSpeed AutoTP (tp 2): the
    function each round calls with (mode, clients)."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    dtype = getattr(torch, args["dtype"])
    torch.set_num_threads(2 if world == 1 else 1)
    close = None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    if kind == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ["LOCAL_SIZE"] = str(world)
        os.environ["LOCAL_RANK"] = str(rank)
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")
            model = deepspeed.init_inference(
                model,
                tensor_parallel={"tp_size": world},
                dtype=dtype,
                replace_with_kernel_inject=False,
            ).module

        def close():
            torch.distributed.destroy_process_group()
            remove_deepspeed_segments(rank)

    class FirstToken(BaseStreamer):
        """The time of the first generated token (the prompt comes first)."""

        def __init__(self):
            self.calls, self.at = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2:
                self.at = time.perf_counter()

        def end(self):
            pass

    def generate(ids):
        streamer = FirstToken()
        with torch.no_grad():
            model.generate(
                torch.tensor(ids),
                max_new_tokens=args["new"],
                min_new_tokens=args["new"],
                do_sample=False,
                pad_token_id=0,
                streamer=streamer,
            )
        return streamer.at

    def run(command):
        mode, n = command
        prompts = _prompts(n, args["prompt"])
        if world > 1:
            torch.distributed.barrier()
        start = time.perf_counter()
        if mode == "static":
            firsts = [generate(prompts)] * n
        else:
            firsts = [generate([p]) for p in prompts]
        wall = time.perf_counter() - start
        return {
            "tokens_per_s": n * args["new"] / wall,
            "ttft_s": statistics.median(f - start for f in firsts),
        }

    generate([_prompts(1, args["prompt"])[0]])  # warm up
    run.close = close
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument(
        "--png", default=os.path.join(HERE, "..", "docs", "figures", "serve-throughput.png")
    )
    a = ap.parse_args()
    clients = [int(c) for c in a.clients.split(",")]
    args = {"prompt": a.prompt, "new": a.new, "dtype": a.dtype, "clients": clients}
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as root:
        torch.manual_seed(0)
        path = os.path.join(root, "llama")
        LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(path)
        systems = {"ours, dsparallel.serve tp 2 (continuous batching)": _Server(path, args)}
        baselines = {
            "transformers generate": (1, "transformers"),
            "DeepSpeed init_inference tp 2": (2, "deepspeed"),
        }
        workers, errors = {}, {}
        for name, (world, kind) in baselines.items():
            try:
                workers[name] = Workers(_baseline, world, path, args, kind)
            except RuntimeError as e:
                print(f"{name}: did not run ({e})")
                errors[name] = str(e)
        for name, w in workers.items():
            for mode, label in (("one", "one by one"), ("static", "one static batch")):
                systems[f"{name}, {label}"] = lambda n, args, w=w, mode=mode: w.call((mode, n))
        samples = {s: {n: [] for n in clients} for s in systems}
        names = list(systems)
        try:
            for rnd in range(a.rounds):
                for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                    for n in clients:
                        samples[name][n].append([systems[name](n, args)])
                print(f"round {rnd + 1}/{a.rounds} done", flush=True)
        finally:
            systems[names[0]].close()
            for w in workers.values():
                w.close()
    rows = []
    for name in names:
        for n in clients:
            per_round = samples[name][n]
            row = {"system": name, "clients": n}
            for key in ("tokens_per_s", "ttft_s"):
                row[key] = round_stats([[s[key] for s in r] for r in per_round])
            rows.append(row)
            print(
                f"{name:<60} {n:>2} clients: {row['tokens_per_s']['median']:7.1f} tokens/s, "
                f"first token {row['ttft_s']['median'] * 1e3:7.0f} ms"
            )
    rows += [{"system": name, "error": e} for name, e in errors.items()]
    save("serve", rows, {**{k: v for k, v in vars(a).items() if k != "png"}, "llama": LLAMA})
    if a.png:
        plot(rows, a.png)


def plot(rows: list[dict], path: str) -> None:
    """Throughput against clients, one line per system (median, min-max bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in dict.fromkeys(r["system"] for r in rows if "error" not in r):
        sel = [r for r in rows if r["system"] == name and "error" not in r]
        xs = [r["clients"] for r in sel]
        mid = [r["tokens_per_s"]["median"] for r in sel]
        low = [m - r["tokens_per_s"]["min"] for m, r in zip(mid, sel)]
        high = [r["tokens_per_s"]["max"] - m for m, r in zip(mid, sel)]
        ax.errorbar(xs, mid, yerr=[low, high], marker="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["clients"] for r in rows if "clients" in r}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("generated tokens/s")
    ax.set_title("Serving a 300M Llama on 2 CPU cores")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
