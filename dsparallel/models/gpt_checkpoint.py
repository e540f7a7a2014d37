"""The GPT's weights in one file that any layout loads.

``save_gpt(path, module, cfg, state)`` (every rank calls it): each rank
cuts its parameters into blocks of the whole model's tensors (the
``hf_specs`` that ``build_stage`` puts on each layer); the blocks of the
first data-parallel replica are gathered on rank 0, which writes
``{"config": ..., "model": {name: tensor}}`` with ``torch.save``.
``load_gpt(path, state)`` builds this rank's stage of another layout and
fills each parameter from its blocks of the file.

The whole model passes through rank 0 while saving: this serves the small
GPT of the training job. The Hugging Face models save per stage
(``save_pretrained``) and resume training in any layout through
``dsparallel.save_checkpoint``.
"""

from __future__ import annotations

import os
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint_io import _assemble
from .gpt import GPTConfig, build_stage
from .hf_map import materialize, specs_of, split


def save_gpt(path: str, module: nn.Module, cfg: GPTConfig, state=None) -> None:
    """Writes the whole model that the ranks' ``module`` (their stages,
    possibly wrapped in DDP or a ModuleList of stages) make up."""
    specs = _specs(module, "save_gpt")
    params = dict(module.named_parameters())
    blocks = [
        (piece, block.detach().cpu().clone())
        for name, node in specs.items()
        for piece, block in split(node, params[name])
    ]
    if not dist.is_initialized():
        everyone = [blocks]
    else:
        # Data-parallel replicas hold equal values: the first one's suffice.
        mine = blocks if state is None or state.dp_rank == 0 else []
        everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, everyone, dst=0)
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save({"config": asdict(cfg), "model": _assemble(everyone)}, path)
    if dist.is_initialized():
        dist.barrier()  # the file is whole when any rank returns


def load_gpt(path: str, state=None) -> tuple[nn.Module, GPTConfig]:
    """This rank's stage (``state``: ``init_parallel``'s; None: the whole
    model in one process) of the GPT saved in ``path``, and its config.
    Every rank checks the whole file, so a bad one fails alike on all."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_gpt: {path} does not exist")
    saved = torch.load(path, weights_only=True)
    if not isinstance(saved, dict) or set(saved) != {"config", "model"}:
        raise ValueError(f"load_gpt: {path} is not a file save_gpt wrote")
    cfg = GPTConfig(**saved["config"])
    if cfg.moe_experts:
        raise ValueError(
            f"load_gpt: {path} holds a mixture-of-experts GPT; only dense ones are saved this way"
        )
    tensors = saved["model"]
    expected = _shapes(cfg)
    wrong = sorted(set(expected) ^ set(tensors)) or [
        k for k in expected if tuple(tensors[k].shape) != expected[k]
    ]
    if wrong:
        k = wrong[0]
        found = tuple(tensors[k].shape) if k in tensors else "absent"
        raise ValueError(
            f"load_gpt: {path} does not match its config {saved['config']}: {k} is {found}, "
            f"expected {expected.get(k, 'absent')} ({len(wrong)} tensors differ)"
        )
    if state is None:
        module = build_stage(cfg)
    else:
        module = build_stage(cfg, state.pp_rank, state.pp_size, group=state.tp_group)
    specs = _specs(module, "load_gpt")
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(materialize(specs[name], lambda piece: tensors[piece.key][piece.index()]))
    return module, cfg


def _specs(module: nn.Module, what: str) -> dict:
    specs = specs_of(module)
    for name, _ in module.named_parameters():
        if name not in specs:
            raise ValueError(
                f"{what}: parameter {name} has no place in the whole model "
                "(mixture-of-experts blocks are not saved this way)"
            )
    return specs


def _shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the whole dense GPT and its shape."""
    h, f, v = cfg.hidden, 4 * cfg.hidden, cfg.vocab_size
    out = {"embed.tok.weight": (v, h), "embed.pos.weight": (cfg.seq_len, h)}
    for i in range(cfg.layers):
        b = f"blocks.{i}."
        for norm in ("ln1", "ln2"):
            out[b + norm + ".weight"] = out[b + norm + ".bias"] = (h,)
        out[b + "attn.qkv.weight"], out[b + "attn.qkv.bias"] = (3 * h, h), (3 * h,)
        out[b + "attn.proj.weight"], out[b + "attn.proj.bias"] = (h, h), (h,)
        out[b + "mlp.fc1.weight"], out[b + "mlp.fc1.bias"] = (f, h), (f,)
        out[b + "mlp.fc2.weight"], out[b + "mlp.fc2.bias"] = (h, f), (h,)
    out["head.ln.weight"] = out["head.ln.bias"] = (h,)
    out["head.proj.weight"] = (v, h)
    return out
