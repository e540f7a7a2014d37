"""Every example runs to completion as torchrun runs it (small sizes)."""

import os
import subprocess
import sys

import pytest
from dist_utils import free_port, run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torchrun(script, *args, nproc=2, check=True):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        os.path.join(ROOT, "examples", script),
        *args,
    ]
    return _run(cmd, check)


def _launch(script, *args, nproc=2):
    """The example as torchrun runs it, in forked ranks (dist_utils.run_script);
    rank 0's output. test_train_gpt_default_layout_runs keeps a real
    torchrun."""
    return run_script(os.path.join(ROOT, "examples", script), *args, nproc=nproc)


def _run(cmd, check=True):
    """Runs cmd; its stdout (check: it must succeed), else the whole result."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if not check:
        return out
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("ddp", ["dsparallel", "torch"])
def test_ddp_simple(ddp):
    out = _launch("ddp_simple.py", "--steps", "150", "--ddp", ddp)
    assert "replicas identical" in out


def test_gradient_accumulation():
    out = _launch("gradient_accumulation.py", "--steps", "120", "--micro-batches", "3")
    assert "loss" in out and "done" in out


def test_pipeline_example_writes_its_timeline(tmp_path):
    png = tmp_path / "timeline.png"
    out = _launch("pipeline.py", "--steps", "100", "--timeline", str(png))
    assert "done: 2 stages" in out and "bubble: measured" in out
    assert png.stat().st_size > 1000


def test_tensor_parallel_example_learns():
    out = _launch("tensor_parallel.py", "--steps", "60")
    done = next(line for line in out.splitlines() if line.startswith("done:"))
    first, last = (float(v) for v in done.split("loss ")[1].split(",")[0].split(" -> "))
    assert last < first - 1.0, done
    assert "replicated parameters agree" in done


def _python(script, *args):
    return _run([sys.executable, os.path.join(ROOT, "examples", script), *args])


def test_model_parallel_example_split_model_matches_unsplit_on_cpu():
    """Without two GPUs both halves sit on the CPU: this checks the split
    model's bookkeeping (two modules, the hop in forward, its own optimizer)
    against the unsplit model, not a transfer between devices."""
    out = _python("model_parallel.py", "--steps", "60")
    assert "first half on cpu, second half on cpu" in out
    assert "max difference from the one-device model" in out


def test_activation_checkpointing_example_saves_memory():
    out = _python("activation_checkpointing.py", "--depth", "4", "--batch", "128")
    assert "gradients equal: True" in out and "less)" in out


def test_train_gpt_default_layout_runs(tmp_path):
    """The lecture's hand-built GPT at tp 2 x pp 2 (its default)."""
    png = tmp_path / "loss.png"
    out = _torchrun(
        "train_gpt.py", *("--steps", "30", "--hidden", "64", "--plot", str(png)), nproc=4
    )
    summary = next(line for line in out.splitlines() if line.startswith("summary:"))
    assert "tokens/s" in summary and "peak RSS per rank" in summary
    assert png.stat().st_size > 1000


GPT_JOB = """
[model]
name = "gpt"
config = {{ n_embd = 64, n_layer = 4, n_head = 4 }}
[parallel]
tensor = 2
pipeline = 2
schedule = "zbv"
micro_batches = 2
[data]
train = ["{root}/docs/**/*.md"]
tokenizer = "{tok}"
seq_len = 64
global_batch = 4
[train]
steps = 6
[checkpoint]
export_hf = "{out}"
[metrics]
progress = false
peak_flops = 1e9
"""


def test_a_trained_gpt_generates_alike_at_other_layouts(tmp_path):
    """The trainer's GPT (GPT-2) at tp 2 x pp 2 under ZBV, exported with its
    tokenizer; generate.py at tp 2 and at pp 2 prints the same greedy text."""
    tok, out = tmp_path / "tok", tmp_path / "hf"
    _run(
        [
            sys.executable,
            "-m",
            "dsparallel.train.tokenizer",
            "--files",
            os.path.join(ROOT, "docs", "**", "*.md"),
            "--vocab-size",
            "512",
            "--out",
            str(tok),
        ]
    )
    job = tmp_path / "job.toml"
    job.write_text(GPT_JOB.format(root=ROOT, tok=tok, out=out))
    port = str(free_port())
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "4",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
            "-m",
            "dsparallel.train",
            "--config",
            str(job),
        ]
    )
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    texts = []
    for tp, pp in ((2, 1), (1, 2)):
        printed = _launch(
            "generate.py",
            *("--model", str(out), "--max-new-tokens", "12"),
            *("--tensor-parallel", str(tp), "--pipeline-parallel", str(pp)),
        )
        assert f"gpt2 4 layers x 64 hidden at tp {tp} x pp {pp}: 3 prompts, 12 new" in printed
        texts.append(printed.split("\n", 1)[1])
    assert texts[0] == texts[1]
    assert "The backend" in texts[0]


def test_moe_example_learns_and_keeps_replicas_equal():
    out = _launch("moe.py", "--steps", "40", "--shared-experts", "1")
    done = next(line for line in out.splitlines() if line.startswith("done:"))
    first, last = (float(v) for v in done.split("loss ")[1].split(";")[0].split(" -> "))
    assert last < first - 1.0, done
    assert "dense parameters agree across ranks" in done
