"""What a run reports: one JSON object per logged step and per evaluation
(``[metrics] jsonl``), the same scalars to TensorBoard (``[metrics]
tensorboard``), and a line per logged step. Rank 0 writes; the values are
already the whole run's (reduced over the ranks by the trainer)."""

from __future__ import annotations

import json
import os
import time

import torch


def memory_mb() -> float:
    """This process's memory: the accelerator's peak allocation, or on the
    CPU the resident set now."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure_peak_flops(dtype: torch.dtype, size: int = 512, seconds: float = 0.3) -> float:
    """One process's dense matmul FLOP/s in ``dtype``: MFU's denominator when
    the config gives none (on the CPU no data sheet knows the share of the
    cores a rank gets)."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b  # warm up
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        calls += 1
    return 2 * size**3 * calls / (time.perf_counter() - start)


class Metrics:
    def __init__(self, cfg, rank: int):
        self.cfg = cfg
        self.writes = rank == 0
        self._jsonl = None
        self._tb = None
        if not self.writes:
            return
        if cfg.jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.jsonl)), exist_ok=True)
            self._jsonl = open(cfg.jsonl, "a")
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(cfg.tensorboard)

    def log(self, values: dict, step: int) -> None:
        """``values`` (``step`` among them) to every sink."""
        if not self.writes:
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(values) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in values.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self.cfg.progress:
            parts = [f"step {step}"]
            for key, value in values.items():
                if key == "step":
                    continue
                parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
            print(" | ".join(parts), flush=True)

    def plot(self, history: dict) -> None:
        """The training (and evaluation) loss by step, as a PNG."""
        if not (self.writes and self.cfg.plot):
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, label in (("loss", "train"), ("eval_loss", "eval (held out)")):
            points = sorted(history[key].items())
            if points:
                ax.plot(*zip(*points), marker="o" if key == "eval_loss" else None, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats per token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(self.cfg.plot)), exist_ok=True)
        fig.savefig(self.cfg.plot, dpi=120)
        plt.close(fig)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
