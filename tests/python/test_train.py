"""The trainer (``dsparallel.train``) held against what we did not write:
a plain single-process ``transformers`` loop in fp64 over the same tokens,
learning rates and clipping at dp 2, tp 2, pp 2 (1F1B and ZB-H1) and
ep 2; torch's learning-rate schedulers; and a run whose rank is killed
under ``torchrun --max-restarts 1`` against the same run uninterrupted.

Tolerances: fp64 losses agree to 1e-7 relative and weights to 1e-6 of the
largest element (rounding order only); a resumed run's losses are equal.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from test_models import DEEPSEEK, GPT2

from dsparallel.train import config as train_config
from dsparallel.train.data import PackedStream, Tokenizer, load_documents
from dsparallel.train.optim import lr_factor
from dsparallel.train.tokenizer import train_tokenizer

SEQ, BATCH, STEPS, LR, CLIP = 16, 4, 20, 2e-3, 0.5
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi pi rho".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """40 documents of different lengths (a .jsonl), a held-out .txt, and a
    byte-level BPE tokenizer trained on them."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    with open(root / "train.jsonl", "w") as f:
        for i in range(40):
            words = [rng.choice(WORDS) for _ in range(rng.randint(5, 60))]
            f.write(json.dumps({"text": f"document {i}: " + " ".join(words), "id": i}) + "\n")
    (root / "held_out.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(400)))
    train_tokenizer([str(root / "train.jsonl")], 300, str(root / "tok"))
    os.environ["HF_DATASETS_CACHE"] = str(root / "hf-cache")  # the ranks inherit it
    return root


def _job(corpus, **sections) -> dict:
    job = {
        "data": dict(
            train=[str(corpus / "train.jsonl")],
            tokenizer=str(corpus / "tok"),
            seq_len=SEQ,
            global_batch=BATCH,
        ),
        "optim": dict(lr=LR, warmup_steps=3, decay="cosine", min_lr_ratio=0.1, grad_clip=CLIP),
        "train": dict(steps=STEPS, log_every=1),
        "metrics": dict(progress=False, peak_flops=1e9),
    }
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values}
    return job


# ------------------------------------------------------------------ config


def test_config_file_overrides_and_errors(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[model]\nname = "llama"\n[train]\nsteps = 7\n[checkpoint]\nasync = true\n')
    cfg = train_config.load(
        str(path),
        [
            "--train.steps=9",
            "--parallel.tensor=2",
            "--model.config.hidden_size=64",
            "--data.train=a.txt",
        ],
    )
    assert cfg.train.steps == 9 and cfg.parallel.tensor == 2 and cfg.checkpoint.async_save
    assert cfg.model.config == {"hidden_size": 64} and cfg.data.train == ["a.txt"]
    # What a run prints reproduces it.
    again = tmp_path / "again.toml"
    again.write_text(cfg.to_toml().replace("async_save", "async"))
    assert train_config.load(str(again)) == cfg
    for bad, needle in [
        (["--train.stpes=3"], "has no field 'stpes'"),
        (["--trian.steps=3"], "unknown section [trian]"),
        (["--train.steps=three"], "[train] steps: expected int"),
        (["--train.steps"], "expected --section.field=value"),
    ]:
        with pytest.raises(ValueError, match=".*".join(map(_escape, needle.split("*")))):
            train_config.load(str(path), bad)


def _escape(text: str) -> str:
    import re

    return re.escape(text)


# ---------------------------------------------------------- learning rate


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_lr_schedule_equals_torch_schedulers(decay):
    """Warmup then decay: torch's LinearLR then CosineAnnealingLR / LinearLR /
    ConstantLR chained by SequentialLR, step by step."""
    from torch.optim.lr_scheduler import (
        ConstantLR,
        CosineAnnealingLR,
        LinearLR,
        SequentialLR,
    )

    steps, warmup, m = 30, 5, 0.1
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    warm = LinearLR(opt, 1 / (warmup + 1), warmup / (warmup + 1), total_iters=warmup - 1)
    rest = steps - warmup - 1
    after = {
        "cosine": lambda: CosineAnnealingLR(opt, T_max=rest, eta_min=m),
        "linear": lambda: LinearLR(opt, 1.0, m, total_iters=rest),
        "constant": lambda: ConstantLR(opt, factor=1.0, total_iters=0),
    }[decay]()
    sched = SequentialLR(opt, [warm, after], milestones=[warmup])
    for step in range(steps):
        want = opt.param_groups[0]["lr"]
        assert lr_factor(step, steps, warmup, decay, m) == pytest.approx(want, rel=1e-12), step
        opt.step()
        sched.step()


def test_lr_schedule_wsd_as_the_docs_give_it():
    steps, warmup, m = 30, 4, 0.2
    decay_steps = round(0.2 * (steps - warmup))  # 5
    for step in range(steps):
        if step < warmup:
            want = (step + 1) / (warmup + 1)
        elif step < steps - decay_steps:
            want = 1.0
        else:
            want = 1 - (1 - m) * (step - (steps - decay_steps) + 1) / decay_steps
        assert lr_factor(step, steps, warmup, "wsd", m) == pytest.approx(want, rel=1e-12)
    assert lr_factor(steps - 1, steps, warmup, "wsd", m) == pytest.approx(m)
    with pytest.raises(ValueError, match="decay: 'cosnie' is not one of"):
        lr_factor(0, 10, 0, "cosnie", 0.1)


# -------------------------------------------------------------------- data


def _documents(corpus):
    return load_documents([str(corpus / "train.jsonl")], "text", "document", False)


def _epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def test_each_document_once_per_epoch_over_the_ranks_and_the_same_batches_after_a_resume(corpus):
    tok = Tokenizer(str(corpus / "tok"))
    docs = _documents(corpus)
    every = tok.encode([d["text"] for d in docs], False)
    world, shares = 3, []
    for rank in range(world):
        stream = PackedStream(docs, tok, SEQ, rank, world, seed=5)
        got = []
        while stream.epoch == 0:
            got.extend(stream.next_rows(1).flatten().tolist())
        # The share's documents, whole and in order, then the next epoch's.
        share = _epoch_order(5, 0, 40)[rank::world]
        first_epoch = [t for i in share for t in every[i]]
        assert got[: len(first_epoch)] == first_epoch
        assert stream._share == _epoch_order(5, 1, 40)[rank::world] != share
        shares.append(set(share))
        # A stream put at this state reads what this one reads next.
        resumed = PackedStream(docs, tok, SEQ, rank, world, seed=5)
        resumed.load_state(stream.state())
        for _ in range(5):
            assert torch.equal(resumed.next_rows(2), stream.next_rows(2))
    assert set.union(*shares) == set(range(40)) and sum(map(len, shares)) == 40


def _malformed(rank, world, path, tok):
    from dsparallel.train import Trainer

    job = {
        "data": dict(train=[path], tokenizer=tok, seq_len=SEQ, global_batch=2),
        "metrics": dict(progress=False, peak_flops=1e9),
    }
    try:
        Trainer(job).fit()
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "line, needle",
    [
        ('{"text": "fine"', "bad.jsonl:3: not valid JSON"),
        ('{"body": "x"}', "bad.jsonl:3: no field 'text'"),
    ],
)
def test_a_malformed_jsonl_line_is_named_on_every_rank(corpus, tmp_path, line, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n' + line + "\n")
    errors = run_ranks(_malformed, 2, str(path), str(corpus / "tok"))
    assert all(e is not None and needle in e for e in errors), errors


def _fit_or_error(rank, world, job):
    from dsparallel.train import Trainer

    try:
        Trainer(job).fit()
    except ValueError as e:
        return str(e)
    return None


def test_resuming_with_another_tokenizer_is_refused_on_every_rank(corpus, tmp_path):
    """The same ids would be other text: a checkpoint records its tokenizer."""
    tok = tmp_path / "tok"
    shutil.copytree(corpus / "tok", tok)
    job = _job(corpus, model=TINY, checkpoint=dict(dir=str(tmp_path / "ck"), every=2))
    job["data"]["tokenizer"] = str(tok)
    job["train"]["steps"] = 2
    assert run_ranks(_fit_or_error, 2, job) == [None, None]
    spec = json.loads((tok / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]  # the same size, two tokens' ids swapped
    a, b = list(vocab)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tok / "tokenizer.json").write_text(json.dumps(spec))
    job["train"]["steps"] = 4
    errors = run_ranks(_fit_or_error, 2, job)
    assert all(e is not None and "another tokenizer" in e for e in errors), errors


# ------------------------------------------------ the trainer against a plain loop


def _save_hf(kind: str, path: str, vocab: int, layers: int = 2, tied: bool = False) -> None:
    torch.manual_seed(3)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=tied,
        )
        LlamaForCausalLM(cfg).save_pretrained(path)
    elif kind == "gpt2":  # tied, always
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(**{**GPT2, "vocab_size": vocab, "n_layer": layers})
        GPT2LMHeadModel(cfg).save_pretrained(path)
    else:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        values = {**DEEPSEEK, "vocab_size": vocab, "n_routed_experts": 4}
        DeepseekV3ForCausalLM(DeepseekV3Config(**values)).save_pretrained(path)


def _fit(rank, world, job):
    from dsparallel.train import Trainer

    history = Trainer(job).fit()
    return history


def _plain_loop(corpus, model_dir: str, dp: int):
    """The same run in one process, written out: transformers' model in
    fp64, the global batch the dp ranks' rows in rank order, AdamW with
    weight decay on the matrices but the embedding, warmup then cosine,
    torch's clip_grad_norm_; for DeepSeek-V3 the paper's bias rule after
    each step (bias + 0.001 * sign(mean load - load), the load read from
    each router's choices) and its sequence-wise balance loss (alpha
    0.0001) added to the loss, from each router's input and choices."""
    from transformers import AutoModelForCausalLM

    # The eager experts: torch's grouped GEMM has no float64.
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float64, experts_implementation="eager"
    )
    tok = Tokenizer(str(corpus / "tok"))
    docs = _documents(corpus)
    streams = [PackedStream(docs, tok, SEQ, r, dp, seed=0) for r in range(dp)]

    def decays(name, p):  # GPT-2's embeddings are wte and wpe
        return p.dim() >= 2 and not any(e in name for e in ("embed", "wte", "wpe"))

    decay = [p for n, p in model.named_parameters() if decays(n, p)]
    other = [p for n, p in model.named_parameters() if not decays(n, p)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gates, chosen, balance = {}, {}, []

    def routed(mod, args, out, name):
        chosen[name] = out[2]
        h = args[0]  # [batch, seq, hidden]
        e, k, seq = mod.num_experts, mod.top_k, h.shape[1]
        scores = torch.sigmoid(F.linear(h.float(), mod.weight.float()))
        p = (scores / scores.sum(-1, keepdim=True)).mean(1)
        counts = torch.zeros(out[2].shape[0], e).scatter_(1, out[2], 1.0)
        f = counts.view(h.shape[0], seq, e).sum(1) * e / (k * seq)
        balance.append(1e-4 * (f * p).sum(-1).mean())

    for name, module in model.named_modules():
        if hasattr(module, "e_score_correction_bias"):
            gates[name] = module
            module.register_forward_hook(
                lambda mod, args, out, name=name: routed(mod, args, out, name)
            )
    losses = []
    for step in range(STEPS):
        if step < 3:
            factor = (step + 1) / 4
        else:
            p = (step - 3) / (STEPS - 3 - 1)
            factor = 0.1 + 0.9 * (1 + math.cos(math.pi * p)) / 2
        for g in opt.param_groups:
            g["lr"] = LR * factor
        rows = torch.cat([s.next_rows(BATCH // dp) for s in streams])
        # transformers' own loss casts the logits to float32: fp64 here.
        logits = model(input_ids=rows).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        (loss + sum(balance)).backward()
        balance.clear()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for name, gate in gates.items():
                load = torch.bincount(chosen[name].flatten(), minlength=gate.num_experts)
                load = load.double()
                gate.e_score_correction_bias += 1e-3 * torch.sign(load.mean() - load)
        losses.append(loss.item())
    return losses, model


# Several stages per rank: four layers, so that each of the four stages has one.
FOUR = dict(layers=4)
LAYOUTS = {
    "dp2": ("llama", dict(), 2, {}),
    "tp2": ("llama", dict(tensor=2, sequence_parallel=True), 1, {}),
    "pp2-1f1b": ("llama", dict(pipeline=2, micro_batches=2, schedule="1f1b"), 1, {}),
    "pp2-zb1p": ("llama", dict(pipeline=2, micro_batches=2, schedule="zb1p"), 1, {}),
    # GPT-2 (tied embeddings) in a V: both copies on rank 0, summed there.
    "gpt2-pp2-zbv": ("gpt2", dict(pipeline=2, micro_batches=2, schedule="zbv"), 1, FOUR),
    "gpt2-tp2-sp": ("gpt2", dict(tensor=2, sequence_parallel=True), 1, {}),
    "pp2-interleaved-tied": (
        "llama",
        dict(pipeline=2, micro_batches=2, schedule="interleaved_1f1b"),
        1,
        dict(FOUR, tied=True),
    ),
    "pp2-dualpipev": ("llama", dict(pipeline=2, micro_batches=4, schedule="dualpipev"), 1, FOUR),
    "dp2-zero2": ("llama", dict(zero_stage=2), 2, {}),
    "ep2": ("deepseek_v3", dict(expert=2), 2, {}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trainer_equals_a_plain_single_process_loop(corpus, tmp_path, layout):
    kind, parallel, dp, shape = LAYOUTS[layout]
    vocab = Tokenizer(str(corpus / "tok")).vocab_size
    model_dir = str(tmp_path / "hf")
    _save_hf(kind, model_dir, vocab, **shape)
    out = str(tmp_path / "out")
    job = _job(
        corpus,
        model=dict(name=model_dir, dtype="float64"),
        parallel=parallel,
        checkpoint=dict(export_hf=out),
    )
    history = run_ranks(_fit, 2, job, timeout=240)[0]
    want, reference = _plain_loop(corpus, model_dir, dp)
    got = [history["loss"][s] for s in range(1, STEPS + 1)]
    for step, (a, b) in enumerate(zip(got, want), 1):
        assert a == pytest.approx(b, rel=1e-7), f"step {step}: {a} against {b}"
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).state_dict()
    for name, want_t in reference.state_dict().items():
        err = (trained[name] - want_t).abs().max().item()
        # DeepSeek's routers compute in float32 on both sides (scores and
        # the balance loss's gradient): float32's rounding, not fp64's.
        rel = 3e-6 if name.endswith("mlp.gate.weight") else 1e-6
        assert err <= rel * want_t.abs().max().item(), f"{name}: off by {err:.3g}"


# ---------------------------------------------------------- a killed rank

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


KILL_STEPS = 16  # of the runs a rank is killed in: a checkpoint every 4
PIPELINE = dict(pipeline=2, micro_batches=2)


def _job_file(corpus, tmp_path, name: str, **sections) -> str:
    job = _job(corpus, **sections)
    job["train"]["steps"] = KILL_STEPS
    job["optim"]["lr"] = 1e-2  # learning: the losses differ step to step
    cfg = train_config.from_dict(job)
    path = tmp_path / f"{name}.toml"
    path.write_text(cfg.to_toml().replace("async_save", "async"))
    return str(path)


def _losses(path: str) -> dict[int, float]:
    """step -> loss, the last logged value of each step (a resumed run
    logs again the steps after its checkpoint)."""
    out = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if "loss" in row:
                out[row["step"]] = row["loss"]
    return out


def _rank_pid(tag: str, rank: int) -> int | None:
    """The pid of the worker of ``rank`` that torchrun started (not of a
    process that worker started in turn)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                parent = f.read().rsplit(")", 1)[1].split()[1]
            with open(f"/proc/{parent}/cmdline", "rb") as f:
                launcher = b"torch.distributed.run" in f.read()
        except OSError:
            continue
        if launcher and f"DSP_TEST_TAG={tag}".encode() in env and f"RANK={rank}".encode() in env:
            return int(pid)
    return None


def _run(job: str, tag: str, kill_when=None, script=None) -> str:
    """torchrun --max-restarts 1 over the job; with ``kill_when(metrics)``,
    rank 1 is sent SIGKILL the first time it is true. Returns the output."""
    env = {**os.environ, "DSP_TEST_TAG": tag}
    entry = [script] if script else ["-m", "dsparallel.train"]
    cmd = [*TORCHRUN, "--max-restarts", "1", "--monitor-interval", "0.5", *entry, "--config", job]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    killed_at, pid = None, None
    deadline = time.monotonic() + 240
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the run did not end"
        if kill_when is not None and killed_at is None:
            # Found before the kill is due: scanning /proc takes long on a
            # busy machine, and the steps go on meanwhile (a kill that came
            # after the last checkpoint left nothing to resume).
            pid = pid or _rank_pid(tag, 1)
            if pid is not None and kill_when():
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
        time.sleep(0.05)
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-8000:]
    if kill_when is not None:
        assert killed_at is not None, "rank 1 was never killed"
        assert "restart" in out.lower() or "resumed from" in out, out[-3000:]
    return out


TINY = dict(
    name="llama",
    config=dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
)


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory) -> dict[int, float]:
    """The losses of the run the kill tests kill, left alone (pp 2)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    metrics = dict(jsonl=str(root / "base.jsonl"), progress=False, peak_flops=1e9)
    _run(_job_file(corpus, root, "base", model=TINY, parallel=PIPELINE, metrics=metrics), "base")
    return _losses(str(root / "base.jsonl"))


def _killed_job(corpus, tmp_path, **checkpoint) -> str:
    return _job_file(
        corpus,
        tmp_path,
        "killed",
        model=TINY,
        parallel=PIPELINE,
        checkpoint=dict(dir=str(tmp_path / "ck"), every=4, **checkpoint),
        metrics=dict(jsonl=str(tmp_path / "killed.jsonl"), progress=True, peak_flops=1e9),
    )


def _assert_same_after(resumed: int, got: dict, want: dict) -> None:
    assert sorted(got) == list(range(1, KILL_STEPS + 1))
    for step in range(resumed + 1, KILL_STEPS + 1):
        assert got[step] == want[step], f"step {step}: {got[step]} against {want[step]}"


def test_a_killed_rank_resumes_from_the_latest_checkpoint_with_the_same_losses(
    corpus, tmp_path, uninterrupted
):
    """kill -9 of rank 1 at a random step after the first checkpoint: the
    others end at once, torchrun restarts the group, the run resumes from
    the latest complete checkpoint and every later loss is the uninterrupted
    run's, exactly."""
    job = _killed_job(corpus, tmp_path, keep=2)
    metrics = tmp_path / "killed.jsonl"
    # Steps before the last checkpoint (16) are a margin for the kill to land.
    kill_step = random.Random().randint(6, 10)

    def due():
        return metrics.exists() and max(_losses(str(metrics)), default=0) >= kill_step

    out = _run(job, "killed", kill_when=due)
    assert "resumed from" in out and "another data-parallel size" not in out, out[-3000:]
    resumed = int(out.split("resumed from")[1].split("after step")[1].split()[0])
    # The kill lands at kill_step or a little later (the poll, the steps
    # going on meanwhile), before the end: some complete checkpoint before it.
    assert 4 <= resumed < KILL_STEPS and resumed % 4 == 0
    _assert_same_after(resumed, _losses(str(metrics)), uninterrupted)
    assert sorted(os.listdir(tmp_path / "ck")) == ["step-12", "step-16"]  # the last two


def test_a_kill_during_an_async_checkpoint_write_resumes_from_the_previous_one(
    corpus, tmp_path, uninterrupted
):
    """Checkpoints written in the background (each write slowed by 3 s): a
    kill while step 8's is being written leaves step 4's as the latest
    complete one; the run resumes from it with the uninterrupted losses."""
    ck = tmp_path / "ck"
    job = _killed_job(corpus, tmp_path, keep=0, async_save=True)

    def writing_step_8():
        return (ck / "step-8.partial").exists() and not (ck / "step-8").exists()

    script = os.path.join(os.path.dirname(__file__), "train_slow_writer.py")
    out = _run(job, "killed", kill_when=writing_step_8, script=script)
    assert f"resumed from {ck / 'step-4'} after step 4" in out, out[-3000:]
    _assert_same_after(4, _losses(str(tmp_path / "killed.jsonl")), uninterrupted)
    assert sorted(os.listdir(ck)) == [f"step-{s}" for s in (12, 16, 4, 8)]


# ------------------------------------------- context parallel, another layout


def test_context_parallel_runs_resume_at_another_layout(corpus, tmp_path):
    """Llama in fp64 at tp 2 x cp 2 (ring), 8 steps, checkpoints at 4 and 8;
    resumed from step 4 at pp 2 x cp 2 (Ulysses), steps 5-8 are the first
    run's (rounding only: the layouts add in other orders); DeepSeek-V3 at
    ep 2 x cp 2 with ZeRO 1 learns."""
    vocab = Tokenizer(str(corpus / "tok")).vocab_size
    model_dir = str(tmp_path / "hf")
    _save_hf("llama", model_dir, vocab)
    ck = tmp_path / "ck"
    model = dict(name=model_dir, dtype="float64")
    first = _job(corpus, model=model, parallel=dict(tensor=2, context=2))
    first["train"]["steps"] = 8
    first["optim"]["lr"] = 1e-2
    first["checkpoint"] = dict(dir=str(ck), every=4, keep=0)
    want = run_ranks(_fit, 4, first, timeout=240)[0]["loss"]
    second = _job(
        corpus,
        model=model,
        parallel=dict(pipeline=2, micro_batches=2, context=2, cp_mode="ulysses"),
    )
    second["train"]["steps"] = 8
    second["optim"]["lr"] = 1e-2
    second["checkpoint"] = dict(dir=str(tmp_path / "ck2"), resume=str(ck / "step-4"))
    got = run_ranks(_fit, 4, second, timeout=240)[0]["loss"]
    assert sorted(got) == [5, 6, 7, 8]
    for step in range(5, 9):
        assert got[step] == pytest.approx(want[step], rel=1e-9), step
    assert want[8] < want[1] - 0.5  # it learns
    deepseek = str(tmp_path / "deepseek")
    _save_hf("deepseek", deepseek, vocab)
    job = _job(
        corpus,
        model=dict(name=deepseek),
        parallel=dict(expert=2, context=2, zero_stage=1),
    )
    job["train"]["steps"] = 12
    job["optim"]["lr"] = 1e-2
    losses = run_ranks(_fit, 4, job, timeout=240)[0]["loss"]
    assert losses[12] < losses[1] - 0.5, losses
