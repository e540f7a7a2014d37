"""``Trainer(config).fit()``: a job's whole run on every rank.

Builds the layout, the tokenizer, the model, its data-parallel wrapping
and pipeline schedule, the optimizer and its schedule; resumes from the
latest complete checkpoint; then trains for ``[train] steps`` optimizer
steps, each over ``global_batch`` sequences, clipping the whole model's
gradient norm, evaluating, checkpointing and reporting as configured.
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist

from ..moe import update_expert_bias
from .checkpoints import prune, resume_path, step_dir
from .config import JobConfig, from_dict, load
from .data import PackedStream, Tokenizer, check_files, expand, load_documents
from .metrics import Metrics, measure_peak_flops, memory_mb
from .models import build_model
from .optim import build_optimizer, lr_factor, optimizer_class, options, param_groups
from .step import make_step


def _agreed(what: str, fn):
    """``fn()`` on every rank; if it raises on any, every rank raises the
    same error (naming the rank), so that no rank waits on the others."""
    from ..models.agreement import raise_if_any_failed

    value, error = None, None
    try:
        value = fn()
    except Exception as e:  # re-raised on every rank just below
        error = e
    raise_if_any_failed(error, what)
    return value


class Trainer:
    """One job (``config``: a ``JobConfig``, a dict of sections, or a TOML
    path) on this rank. Every rank of the job builds one and calls ``fit()``."""

    def __init__(self, config, overrides: list[str] = ()):
        if isinstance(config, JobConfig):
            self.cfg = config
        elif isinstance(config, dict):
            self.cfg = from_dict(config)
        else:
            self.cfg = load(config, overrides)
        self.history: dict[str, dict[int, float]] = {
            "loss": {},
            "eval_loss": {},
            "lr": {},
            "seconds": {},  # each training step's wall time on this rank
        }
        # Seconds this rank spent in the training steps, and within them in
        # the trainer's own work: reading the data and reporting.
        self.timing = {"steps": 0.0, "data": 0.0, "report": 0.0}

    # -------------------------------------------------------------- building

    def _build(self) -> None:
        import dsparallel

        cfg = self.cfg
        par = cfg.parallel
        self.state = state = dsparallel.init_parallel(
            par.tensor,
            par.pipeline,
            expert_parallel_size=par.expert,
            context_parallel_size=par.context,
            experts_over_tp=par.experts_over_tp,
        )
        self.rank = dist.get_rank()
        if self.rank == 0 and cfg.metrics.progress:
            print(f"# dsparallel.train: the whole configuration\n{cfg.to_toml()}", flush=True)
        data = cfg.data
        self.local_batch = self._check_batch(state)
        torch.manual_seed(cfg.train.seed)
        tokenizer_dir = data.tokenizer or (cfg.model.name if os.path.isdir(cfg.model.name) else "")
        if not tokenizer_dir:
            raise ValueError(
                "[data] tokenizer: give a directory with tokenizer.json (a fresh model has none "
                "of its own)"
            )
        self.tokenizer = _agreed("[data] tokenizer", lambda: Tokenizer(tokenizer_dir))
        self.model = model = _agreed(
            "[model]",
            lambda: build_model(cfg.model, par, state, self.tokenizer.vocab_size, cfg.train.seed),
        )
        if self.tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(
                f"the tokenizer has {self.tokenizer.vocab_size} tokens, the model's vocabulary "
                f"{model.config.vocab_size}: ids past it have no embedding"
            )
        o = cfg.optim
        cls = optimizer_class(o.name)

        def make_optimizer(model, zero_group):
            groups = param_groups(model, o.weight_decay)
            if zero_group is None:
                return build_optimizer(cls, groups, options(o, cls))
            return dsparallel.ZeroRedundancyOptimizer(
                groups, cls, process_group=zero_group, **options(o, cls)
            )

        self.step_fn = make_step(
            model,
            state,
            make_optimizer,
            zero_stage=par.zero_stage,
            fsdp=par.fsdp,
            schedule=par.schedule,
            micro_batches=par.micro_batches,
        )
        self.opt = self.step_fn.opt
        self.base_lrs = [g["lr"] for g in self.opt.param_groups]
        self.train_stream = self._stream(data.train, "train", shuffle=True)
        self.eval_batches = self._eval_batches() if data.eval else []
        self.metrics = Metrics(cfg.metrics, self.rank)
        self._flops_per_token, self._peak = self._mfu_terms()
        self._writer_group = None
        if cfg.checkpoint.async_save and cfg.checkpoint.dir:
            # DCP's collectives from the background writer, apart from
            # training's. A group of the job's backend: after a restart by
            # torchrun, which keeps its store, a new gloo group may read the
            # killed attempt's addresses there ("dsp" keys its own by attempt).
            self._writer_group = dist.new_group()

    def _check_batch(self, state) -> int:
        data, par = self.cfg.data, self.cfg.parallel
        if data.global_batch % state.dp_size:
            raise ValueError(
                f"[data] global_batch {data.global_batch} is not a multiple of the "
                f"{state.dp_size} data-parallel ranks"
            )
        local = data.global_batch // state.dp_size
        if state.pp_size > 1 and local % par.micro_batches:
            raise ValueError(
                f"[parallel] micro_batches {par.micro_batches} does not divide the "
                f"{local} sequences of a data-parallel rank's step"
            )
        return local

    def _stream(self, patterns, what: str, shuffle: bool) -> PackedStream:
        data, state = self.cfg.data, self.state

        def files():
            found = expand(patterns, what)
            check_files(found, data.text_field)
            return found

        found = _agreed(f"[data] {what}", files)

        def read():
            return load_documents(found, data.text_field, data.txt_sample_by, data.streaming)

        # One process per host fills the datasets cache; the others read it.
        first = int(os.environ.get("LOCAL_RANK", self.rank)) == 0
        documents = _agreed(f"[data] {what}", lambda: read() if first else None)
        documents = _agreed(f"[data] {what}", lambda: documents if first else read())
        return _agreed(
            f"[data] {what}",
            lambda: PackedStream(
                documents,
                self.tokenizer,
                data.seq_len,
                state.dp_rank,
                state.dp_size,
                self.cfg.train.seed,
                add_bos=data.add_bos,
                shuffle=shuffle,
            ),
        )

    def _eval_batches(self) -> list[torch.Tensor]:
        """The held-out batches every evaluation reads: the first
        ``eval_steps`` of each rank's share, as many on every rank."""
        stream = self._stream(self.cfg.data.eval, "eval", shuffle=False)
        batches = []
        while len(batches) < self.cfg.train.eval_steps:
            rows = stream.next_rows(self.local_batch)
            if rows is None:
                break
            batches.append(rows)
        count = torch.tensor([len(batches)], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        if count.item() == 0:
            raise ValueError(
                f"[data] eval: a data-parallel rank's share of the held-out text is shorter than "
                f"one batch ({self.local_batch} x {self.cfg.data.seq_len} tokens)"
            )
        return batches[: count.item()]

    def _mfu_terms(self) -> tuple[float, float]:
        from ..plan.flops import model_flops_per_token
        from ..plan.model import read_model

        m = self.model
        flops = model_flops_per_token(read_model(m.config_dict()), self.cfg.data.seq_len)
        peak = self.cfg.metrics.peak_flops
        if not peak:
            dtype = torch.bfloat16 if "bfloat16" in m.precision else torch.float32
            peak = measure_peak_flops(dtype)
            value = torch.tensor([peak], dtype=torch.float64)
            dist.all_reduce(value)
            peak = value.item() / dist.get_world_size()
        return flops, peak

    # -------------------------------------------------------------- running

    def _reduce_loss(self, losses: list[torch.Tensor]) -> float:
        """The mean over every label of the batch. Each of this rank's
        ``losses`` is its labels' sum over the global count, times the
        data-parallel size and (a schedule's micro-batches) their number:
        their mean over this rank's micro-batches, summed over one copy per
        replica (its tp and cp ranks hold the same value) over the
        data-parallel size."""
        s = self.state
        mine = s.tp_rank == 0 and s.cp_rank == 0 and self.model.is_last
        value = torch.zeros(1, dtype=torch.float64)
        if mine and losses:
            value += sum(float(v) for v in losses) / len(losses)
        dist.all_reduce(value)
        return value.item() / s.dp_size

    def _set_lr(self, step: int) -> float:
        o = self.cfg.optim
        factor = lr_factor(
            step, self.cfg.train.steps, o.warmup_steps, o.decay, o.min_lr_ratio, o.wsd_decay_ratio
        )
        for group, base in zip(self.opt.param_groups, self.base_lrs):
            group["lr"] = base * factor
        return self.base_lrs[0] * factor

    def _train_step(self, step: int) -> tuple[float, float, float]:
        """One optimizer step (``step`` counted from 0): (loss, lr, the
        gradient norm before clipping)."""
        lr = self._set_lr(step)
        t0 = time.perf_counter()
        rows = self.train_stream.next_rows(self.local_batch)
        self.timing["data"] += time.perf_counter() - t0
        losses = self.step_fn.backward(rows)
        self.model.allreduce_tied_grads()
        clip = self.cfg.optim.grad_clip or math.inf
        zero = self.opt if self.cfg.parallel.zero_stage else None
        norm = float(self.model.clip_grad_norm_(clip, optimizer=zero))
        self.opt.step()
        self.opt.zero_grad()
        update_expert_bias(self.model)  # DeepSeek-V3's balancing; no-op without routers
        return self._reduce_loss(losses), lr, norm

    @torch.no_grad()
    def evaluate(self) -> float:
        """The mean loss over every label of the held-out batches."""
        model = self.model
        n = model.count_items(self.eval_batches)
        losses = []
        for rows in self.eval_batches:
            out = model(rows, labels=rows, num_items_in_batch=n)
            if out.loss is not None:
                losses.append(out.loss)
        # Each batch's share of the whole held-out count: their sum.
        return self._reduce_loss([torch.stack(losses).sum()] if losses else [])

    def _extra(self, step: int) -> dict[str, torch.Tensor]:
        s = self.state
        return {
            "train.step": torch.tensor(step, dtype=torch.int64),
            "train.dp_size": torch.tensor(s.dp_size, dtype=torch.int64),
            "train.tokenizer": torch.tensor(self.tokenizer.fingerprint, dtype=torch.int64),
            f"train.data.{s.dp_rank}": self.train_stream.state(),
        }

    def _resume(self) -> int:
        """Loads the checkpoint ``[checkpoint] resume`` names; returns the
        steps it had done (0 without one)."""
        import torch.distributed.checkpoint as dcp

        import dsparallel

        path = resume_path(self.cfg.checkpoint)
        if path is None:
            return 0
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        extra = {"train.step": torch.zeros((), dtype=torch.int64)}
        data_key = f"train.data.{self.state.dp_rank}"
        same_dp = "extra.train.dp_size" in saved and f"extra.{data_key}" in saved
        if same_dp:
            extra["train.dp_size"] = torch.zeros((), dtype=torch.int64)
            extra[data_key] = torch.zeros(3, dtype=torch.int64)
        if "extra.train.tokenizer" in saved:
            extra["train.tokenizer"] = torch.zeros((), dtype=torch.int64)
        dsparallel.load_checkpoint(path, self.model, self.opt, extra=extra)
        tokenizer = extra.get("train.tokenizer")
        if tokenizer is not None and int(tokenizer) != self.tokenizer.fingerprint:
            # The same ids would mean other text: the model would train (and
            # evaluate) on what it never learned.
            raise ValueError(
                f"resume: {path} was trained with another tokenizer than "
                f"{self.tokenizer.path} (its tokenizer.json differs): resume with the one it "
                'was trained with, or start afresh ([checkpoint] resume = "none" or another dir)'
            )
        same_dp = same_dp and int(extra["train.dp_size"]) == self.state.dp_size
        if same_dp:
            self.train_stream.load_state(extra[data_key])
        elif self.rank == 0:
            print(
                f"resume: {path} was saved at another data-parallel size; the data starts "
                "from the beginning of an epoch",
                flush=True,
            )
        if self.rank == 0 and self.cfg.metrics.progress:
            print(f"resumed from {path} after step {int(extra['train.step'])}", flush=True)
        return int(extra["train.step"])

    def _save(self, step: int) -> None:
        import dsparallel

        from ..training_checkpoint import async_save_checkpoint

        ck = self.cfg.checkpoint
        self._finish_pending(wait=True)
        path = step_dir(ck.dir, step)
        if self._writer_group is not None:
            self._pending = async_save_checkpoint(
                path, self.model, self.opt, self._extra(step), group=self._writer_group
            )
        else:
            dsparallel.save_checkpoint(path, self.model, self.opt, self._extra(step))
            prune(ck.dir, ck.keep)
        self._saved = step

    def _finish_pending(self, wait: bool) -> None:
        pending = getattr(self, "_pending", None)
        if pending is None or not (wait or pending.done()):
            return
        pending.finish()
        self._pending = None
        prune(self.cfg.checkpoint.dir, self.cfg.checkpoint.keep)

    def fit(self) -> dict:
        """Trains; returns the history (step -> loss, lr, eval loss and the
        step's seconds)."""
        self._build()
        cfg, ck = self.cfg, self.cfg.checkpoint
        first = self._resume()
        tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
        world = dist.get_world_size()
        last_log, since = time.perf_counter(), 0
        step = first
        for step in range(first + 1, cfg.train.steps + 1):
            t0 = time.perf_counter()
            loss, lr, norm = self._train_step(step - 1)
            self.history["loss"][step] = loss
            self.history["lr"][step] = lr
            since += 1
            self._finish_pending(wait=False)
            every = max(1, cfg.train.log_every)
            if step % every == 0 or step in (first + 1, cfg.train.steps):
                now = time.perf_counter()
                rate = tokens_per_step * since / (now - last_log)
                self.metrics.log(
                    {
                        "step": step,
                        "loss": loss,
                        "lr": lr,
                        "grad_norm": norm,
                        "tokens_per_s": rate,
                        "mfu": rate * self._flops_per_token / (self._peak * world),
                        "memory_mb": memory_mb(),
                    },
                    step,
                )
                last_log, since = time.perf_counter(), 0
                self.timing["report"] += last_log - now
            self.history["seconds"][step] = time.perf_counter() - t0
            self.timing["steps"] += self.history["seconds"][step]
            if self.eval_batches and cfg.train.eval_every and step % cfg.train.eval_every == 0:
                self._log_eval(step)
            if ck.dir and ck.every and step % ck.every == 0:
                self._save(step)
        if self.eval_batches and step not in self.history["eval_loss"]:
            self._log_eval(step)
        if ck.dir and step > first and getattr(self, "_saved", None) != step:
            self._save(step)
        self._finish_pending(wait=True)
        if ck.export_hf:
            self.model.save_pretrained(ck.export_hf)
            if self.rank == 0:  # a whole checkpoint: the tokenizer beside the weights
                self.tokenizer.copy_to(ck.export_hf)
        self.metrics.plot(self.history)
        self.metrics.close()
        return self.history

    def _log_eval(self, step: int) -> None:
        value = self.evaluate()
        self.history["eval_loss"][step] = value
        self.metrics.log({"step": step, "eval_loss": value}, step)
