"""The optimizer and its learning-rate schedule.

Weight decay is applied to the matrices only: not to norms and biases
(one-dimensional) nor to the embedding table and a tied LM head, as
Megatron-LM and ``transformers``' ``Trainer`` group them.

The schedule multiplies ``lr`` at optimizer step ``s`` (0 for the first
step) of ``T = steps``, with ``W = warmup_steps`` and ``m = min_lr_ratio``:

- warmup, ``s < W``: ``(s + 1) / (W + 1)`` (torchtitan's linear warmup);
- then with ``p = (s - W) / max(1, T - W - 1)`` (0 at the first step after
  warmup, 1 at the last):
  - ``constant``: 1;
  - ``linear``: ``1 - (1 - m) p``;
  - ``cosine``: ``m + (1 - m) (1 + cos(pi p)) / 2``;
  - ``wsd`` (warmup, stable, decay): 1 until the last
    ``D = round(wsd_decay_ratio (T - W))`` steps, then linear from 1 to
    ``m`` over them.
"""

from __future__ import annotations

import math

import torch

DECAYS = ("cosine", "linear", "constant", "wsd")


def lr_factor(
    step: int,
    steps: int,
    warmup_steps: int,
    decay: str,
    min_lr_ratio: float,
    wsd_decay_ratio: float = 0.2,
) -> float:
    """The factor of the learning rate at optimizer step ``step`` (see the
    module docstring)."""
    if decay not in DECAYS:
        raise ValueError(f"[optim] decay: {decay!r} is not one of {', '.join(DECAYS)}")
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    m = min_lr_ratio
    if decay == "constant":
        return 1.0
    if decay == "wsd":
        span = round(wsd_decay_ratio * (steps - warmup_steps))
        first = steps - span  # the first decaying step
        if step < first:
            return 1.0
        return 1.0 - (1.0 - m) * (step - first + 1) / max(1, span)
    p = min(1.0, (step - warmup_steps) / max(1, steps - warmup_steps - 1))
    if decay == "linear":
        return 1.0 - (1.0 - m) * p
    return m + (1.0 - m) * (1.0 + math.cos(math.pi * p)) / 2.0


def decays(name: str, p: torch.Tensor, copies: set[str]) -> bool:
    """Whether weight decay applies to parameter ``name``: the matrices,
    not the norms, biases, embeddings nor a tied LM head (``copies``)."""
    return p.dim() >= 2 and "embed" not in name and name not in copies


def param_groups(model, weight_decay: float) -> list[dict]:
    """The model's trainable parameters in two groups: with and without
    weight decay (a group left empty is dropped)."""
    copies = getattr(model, "_copies", set())
    yes, no = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (yes if decays(name, p, copies) else no).append(p)
    groups = [
        {"params": yes, "weight_decay": weight_decay},
        {"params": no, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def optimizer_class(name: str) -> type:
    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"[optim] name: torch.optim has no optimizer {name!r}")
    return cls


def options(cfg, cls: type) -> dict:
    """The keyword arguments of ``cls`` the config gives: ``lr`` always,
    ``betas`` and ``eps`` where the class takes them."""
    import inspect

    takes = inspect.signature(cls.__init__).parameters
    out = {"lr": cfg.lr}
    if "betas" in takes:
        out["betas"] = tuple(cfg.betas)
    if "eps" in takes:
        out["eps"] = cfg.eps
    return out


def build_optimizer(cls: type, groups: list[dict], kwargs: dict):
    """``cls(groups, **kwargs)`` with torch's fused kernel where the class
    has one for these parameters (AdamW, Adam, SGD, Adagrad): the same
    update in one kernel per group, several times faster than the loop over
    tensors on the CPU (as ``transformers``' ``Trainer`` defaults to it)."""
    import inspect

    if "fused" in inspect.signature(cls.__init__).parameters:
        try:
            return cls(groups, fused=True, **kwargs)
        except (RuntimeError, ValueError, TypeError):
            pass  # a device or dtype without the kernel
    return cls(groups, **kwargs)
