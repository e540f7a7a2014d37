"""A small GPT built from the tensor-parallel layers, cut into pipeline stages.

The model is [embedding, block x layers, head]: token embedding split by
vocabulary plus a learned position embedding; pre-LayerNorm blocks of causal
``ParallelAttention`` and ``ParallelMLP``; a final LayerNorm and an LM head
split by vocabulary whose logits go to ``vocab_parallel_cross_entropy``.

Layer ``i`` is initialised under its own seed (``seed + i``), so a stage
builds exactly the layers the whole model would have, whatever the pipeline
and tensor-parallel sizes: the same seed gives the same model in one process
and in any layout.

With ``moe_experts`` > 0 each block's MLP is a mixture of experts
(``dsparallel.moe.MoE``): ``moe_top_k`` routed experts per token, each
``4 * hidden / moe_top_k`` wide so that the routed part has the dense MLP's
active parameters, plus ``moe_shared_experts`` shared ones, the routed
experts split over init_parallel's expert-parallel group.

Every dense parameter states, next to the layer that holds it, where it
lies in the whole one-process model (``hf_specs``, as the Hugging Face
models do), so that a layout's pieces can be put back together and held
against one process. This is the lecture's GPT, built stage by stage by
hand; the GPT the trainer, ``from_pretrained`` and ``generate`` know is
``GPT2``, a ``CausalLM`` like Llama and DeepSeek-V3.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .. import context_parallel
from .. import tensor_parallel as tp
from ..checkpoint import checkpoint as recompute
from ..moe import MoE
from .hf_map import Cat, Piece, cols, rows, whole


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 128
    seq_len: int = 64
    hidden: int = 128
    heads: int = 4
    layers: int = 4
    dropout: float = 0.0
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_shared_experts: int = 0
    moe_capacity_factor: float | None = None


class Embedding(nn.Module):
    """Token embedding split by vocabulary plus a learned position embedding;
    under context parallelism ids hold this rank's part of the sequence,
    whose global positions it looks up."""

    def __init__(self, cfg: GPTConfig, group, cp_group=None):
        super().__init__()
        self.tok = tp.VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, group=group)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.cp_group = cp_group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.cp_group is None:
            positions = torch.arange(ids.shape[1], device=ids.device)
        else:
            whole = ids.shape[1] * self.cp_group.size()
            positions = context_parallel.positions(whole, self.cp_group, device=ids.device)
        return self.tok(ids) + self.pos(positions)


class Block(nn.Module):
    """Pre-LayerNorm transformer block. With ``checkpoint`` only its input is
    kept for backward and the rest is recomputed (per block, as Megatron's
    full recomputation does), with the same dropout masks."""

    def __init__(
        self, cfg: GPTConfig, group, checkpoint: bool = False, cp_group=None, cp_mode="ring"
    ):
        super().__init__()
        self.checkpoint = checkpoint
        self.ln1, self.ln2 = nn.LayerNorm(cfg.hidden), nn.LayerNorm(cfg.hidden)
        self.attn = tp.ParallelAttention(
            cfg.hidden,
            cfg.heads,
            group=group,
            causal=True,
            dropout=cfg.dropout,
            context_parallel_group=cp_group,
            cp_mode=cp_mode,
        )
        if cfg.moe_experts:
            # Experts are not split by tensor parallelism: every rank of a
            # tensor-parallel group routes the same (replicated) tokens.
            self.mlp = MoE(
                cfg.hidden,
                max(1, 4 * cfg.hidden // cfg.moe_top_k),
                cfg.moe_experts,
                cfg.moe_top_k,
                num_shared_experts=cfg.moe_shared_experts,
                capacity_factor=cfg.moe_capacity_factor,
            )
        else:
            self.mlp = tp.ParallelMLP(cfg.hidden, 4 * cfg.hidden, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint and torch.is_grad_enabled():
            return recompute(self._forward, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm and the LM head; returns this rank's vocabulary slice
    of the logits."""

    def __init__(self, cfg: GPTConfig, group):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.hidden)
        self.proj = tp.ColumnParallelLinear(cfg.hidden, cfg.vocab_size, bias=False, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln(x))


def stage_blocks(num_layers: int, stage: int, num_stages: int) -> range:
    """The blocks of ``stage``: an even split, earlier stages taking the
    remainder (the last stage also carries the head)."""
    if num_layers < num_stages:
        raise ValueError(f"{num_layers} layers cannot fill {num_stages} pipeline stages")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def build_stage(
    cfg: GPTConfig,
    stage: int = 0,
    num_stages: int = 1,
    group: dist.ProcessGroup | None = None,
    seed: int = 0,
    checkpoint: bool = False,
    context_parallel_group: dist.ProcessGroup | None = None,
    cp_mode: str = "ring",
) -> nn.Sequential:
    """The layers of pipeline stage ``stage`` (all of them for one stage),
    tensor-parallel over ``group``; ``checkpoint`` recomputes each block's
    activations in backward; ``context_parallel_group``: each rank holds
    its part of the sequence (``context_parallel.shard_sequence``), its
    attention ring (``cp_mode="ring"``) or Ulysses."""
    cp = context_parallel_group
    if cfg.vocab_size % _group_size(group):
        raise ValueError(
            f"vocab_size={cfg.vocab_size} must be divisible by the tensor-parallel size "
            f"{_group_size(group)} (the LM head splits it evenly)"
        )

    def seeded(index: int, make):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + index)
            return make()

    layers = []
    r, n = tp.group.resolve_group(group, "GPT").rank(), _group_size(group)
    if stage == 0:
        layers.append(_with_specs(seeded(0, lambda: Embedding(cfg, group, cp)), cfg, "embed", r, n))
    for i in stage_blocks(cfg.layers, stage, num_stages):
        block = seeded(1 + i, lambda: Block(cfg, group, checkpoint, cp, cp_mode))
        layers.append(_with_specs(block, cfg, f"blocks.{i}", r, n))
    if stage == num_stages - 1:
        layers.append(
            _with_specs(seeded(1 + cfg.layers, lambda: Head(cfg, group)), cfg, "head", r, n)
        )
    return nn.Sequential(*layers)


def _with_specs(layer: nn.Module, cfg: GPTConfig, key: str, r: int, n: int) -> nn.Module:
    """Marks each dense parameter of ``layer`` with its place in the whole
    model: ``key.<name>`` split by rows (column-parallel), by columns
    (row-parallel) or whole. The fused q/k/v rows are this rank's heads of
    q, then of k, then of v (``ParallelAttention``'s order)."""
    h, v = cfg.hidden, cfg.vocab_size

    def mark(module, prefix, **specs):
        module.hf_specs = {name: spec(f"{key}.{prefix}{name}") for name, spec in specs.items()}

    def norm(module, prefix):
        mark(module, prefix, weight=lambda k: whole(k, (h,)), bias=lambda k: whole(k, (h,)))

    if isinstance(layer, Embedding):
        mark(layer.tok, "tok.", weight=lambda k: rows(k, (v, h), r, n))
        mark(layer.pos, "pos.", weight=lambda k: whole(k, (cfg.seq_len, h)))
    elif isinstance(layer, Head):
        norm(layer.ln, "ln.")
        mark(layer.proj, "proj.", weight=lambda k: rows(k, (v, h), r, n))
    else:
        norm(layer.ln1, "ln1.")
        norm(layer.ln2, "ln2.")
        local = h // n

        def qkv(k, shape):
            return Cat(tuple(Piece(k, shape, 0, part * h + r * local, local) for part in range(3)))

        attn = layer.attn
        mark(
            attn.qkv,
            "attn.qkv.",
            weight=lambda k: qkv(k, (3 * h, h)),
            bias=lambda k: qkv(k, (3 * h,)),
        )
        mark(
            attn.proj,
            "attn.proj.",
            weight=lambda k: cols(k, (h, h), r, n),
            bias=lambda k: whole(k, (h,)),
        )
        if isinstance(layer.mlp, tp.ParallelMLP):  # MoE blocks keep none: not saved this way
            f = layer.mlp.fc1.out_features
            mark(
                layer.mlp.fc1,
                "mlp.fc1.",
                weight=lambda k: rows(k, (f, h), r, n),
                bias=lambda k: rows(k, (f,), r, n),
            )
            mark(
                layer.mlp.fc2,
                "mlp.fc2.",
                weight=lambda k: cols(k, (h, f), r, n),
                bias=lambda k: whole(k, (h,)),
            )
    return layer


def _group_size(group) -> int:
    return tp.group.resolve_group(group, "GPT").size()


def gpt_loss(group: dist.ProcessGroup | None = None):
    """The loss on the last stage: cross-entropy of vocabulary-parallel logits
    (batch, seq, vocab slice) against targets (batch, seq)."""

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return tp.vocab_parallel_cross_entropy(logits, target, group=group)

    return loss_fn
