"""What Llama and DeepSeek-V3 share around their decoder layers: the
embedding, the final norm and LM head, the cut into pipeline stages, the
forward users know (``out = model(input_ids, labels=...)``), and the way
into and out of a Hugging Face checkpoint.

A model is built on the meta device and then given this rank's storage
only, so neither a fresh model nor ``from_pretrained`` ever holds a whole
tensor it does not keep (``from_pretrained`` at most its shard plus the
block of one tensor being read).

Under pipeline parallelism each rank holds its stages' decoder layers
(the first stage also the embedding, the last the norm and LM head): one
stage, or with ``stages_per_rank`` several, placed as the schedule wants
them (``stage_placement``: "loop", rank r holding r, r + p, ...; "v",
rank r holding r and 2p - 1 - r, for ZBV and DualPipeV). ``model(...)``
then runs a forward-only pass through the stages (every rank of the
pipeline calls it with the same inputs; the rank of the last stage returns
the logits and loss): for evaluation (``forward_stages`` drives it, as it
drives generation's). Training runs the stages under one of the pipeline
schedules through ``model.pipeline_stages()`` and ``model.loss_fn``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import _C, context_parallel
from .. import tensor_parallel as tp
from ..checkpoint import checkpoint as recompute
from ..context_parallel import check_mode
from ..mixed_precision import MixedPrecision, compute_dtype
from ..mixed_precision import apply as apply_mixed_precision
from ..mixed_precision import describe as describe_precision
from .forward_stages import ForwardStages, stage_ids
from .gpt import stage_blocks
from .hf_config import read_config
from .hf_map import initial_block, materialize, padded_rows, specs_of, split
from .layers import Layout, RMSNorm, attention_mask_for, cached_mask, last_logits

IGNORE_INDEX = -100


@dataclass
class CausalLMOutput:
    """``logits``: [batch, seq, vocab] (None on a stage that is not the
    last, and when labels were given without ``return_logits``);
    ``loss``: the mean next-token cross entropy over labels that are not
    -100 (labels are shifted inside, as in ``transformers``)."""

    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None


# A pytree node, so that DistributedDataParallel finds the loss in it.
torch.utils._pytree.register_dataclass(CausalLMOutput)


class CausalLM(nn.Module):
    """``stages_per_rank`` and ``stage_placement`` ("loop" or "v"): this
    rank's pipeline stages (``stage_ids``), as a schedule of several stages
    per rank wants them (see the module docstring).

    Subclasses set ``model_type``, ``architecture``, ``defaults`` (the
    config fields ``transformers`` fills in) and build ``make_layer(i)``,
    ``make_rotary()`` and ``check(config)``."""

    model_type = ""
    architecture = ""
    defaults: dict = {}
    aliases: dict = {}  # common config name -> the model's own (read_config)
    # Checkpoint names of the embedding, the final norm and the LM head.
    embed_key = "model.embed_tokens.weight"
    norm_key = "model.norm"
    head_key = "lm_head.weight"

    def __init__(
        self,
        config,
        state=None,
        *,
        seed: int = 0,
        dtype: torch.dtype | None = None,
        checkpoint: bool = False,
        sequence_parallel: bool = False,
        cp_mode: str = "ring",
        mixed_precision: MixedPrecision | None = None,
        pad_vocab_to: int = 64,
        stages_per_rank: int = 1,
        stage_placement: str = "loop",
        _initialize: bool = True,
    ):
        super().__init__()
        if mixed_precision is not None and dtype not in (None, torch.float32):
            raise ValueError(
                f"{type(self).__name__}: mixed_precision keeps float32 master weights, so the "
                f"model's dtype is float32, not {dtype} (leave dtype out; dtype={dtype} "
                "without mixed_precision is pure low precision)"
            )
        cfg = read_config(config, self.model_type, self.defaults, self.aliases)
        self.config = cfg
        lay = Layout.of(state)
        self.layout = lay = dataclasses.replace(
            lay, sp=sequence_parallel and lay.tp_size > 1, cp_mode=cp_mode
        )
        self.checkpoint = checkpoint
        self.check(cfg)
        vocab, hidden = cfg.vocab_size, cfg.hidden_size
        self.padded_vocab = padded_vocab(vocab, lay.tp_size, pad_vocab_to)
        # This rank's pipeline stages, ascending; is_first / is_last: it
        # holds the first (the embedding) / the last (norm and LM head).
        self.stage_ids = stage_ids(lay.pp_rank, lay.pp_size, stages_per_rank, stage_placement)
        self.num_stages = lay.pp_size * stages_per_rank
        self.stage_placement = stage_placement
        self.is_first, self.is_last = 0 in self.stage_ids, self.num_stages - 1 in self.stage_ids
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        # One stage holding both ends reads the embedding as its LM head;
        # otherwise the last stage holds a copy (Megatron's), whose
        # gradient allreduce_tied_grads sums with the embedding's.
        self._head_is_embedding = self.tied and self.num_stages == 1
        embed_key = self.embed_key
        g, r, n = lay.tp_group, lay.tp_rank, lay.tp_size
        self.rotary = self.make_rotary()
        table = self.padded_vocab, hidden
        # Parameter name -> checkpoint key of the tables holding padded rows.
        self.padded_keys: dict[str, str] = {}
        if self.is_first:
            self.embed_tokens = tp.VocabParallelEmbedding(*table, group=g, device="meta")
            spec = padded_rows(embed_key, (vocab, hidden), r, n, self.padded_vocab)
            self.embed_tokens.hf_specs = {"weight": spec}
            if self.padded_vocab != vocab:
                self.padded_keys["embed_tokens.weight"] = embed_key
            self.embed_positions = self.make_position_embedding()
        self.stage_layers = {
            s: [str(i) for i in stage_blocks(cfg.num_hidden_layers, s, self.num_stages)]
            for s in self.stage_ids
        }
        blocks = [int(i) for names in self.stage_layers.values() for i in names]
        self.layers = nn.ModuleDict({str(i): self.make_layer(i) for i in blocks})
        check_mode(
            cp_mode, cfg.num_attention_heads // lay.tp_size, lay.cp_size, type(self).__name__
        )
        # Parameters another stage also holds and saves (a tied LM head).
        self._copies: set[str] = set()
        self._tied_group = None
        if self.is_last:
            self.norm = self.make_norm(self.norm_key)
            if not self._head_is_embedding:
                self.lm_head = tp.ColumnParallelLinear(
                    hidden, table[0], bias=False, group=g, sequence_parallel=lay.sp, device="meta"
                )
                key = embed_key if self.tied else self.head_key
                spec = padded_rows(key, (vocab, hidden), r, n, self.padded_vocab)
                self.lm_head.hf_specs = {"weight": spec}
                if self.padded_vocab != vocab:
                    self.padded_keys["lm_head.weight"] = key
                if self.tied:
                    self._copies.add("lm_head.weight")
        if self.tied and self.num_stages > 1 and self.stage_owner(self.num_stages - 1) != 0:
            self._tied_group = _first_last_stage_group(lay)
        # Checkpoint keys saved twice: key -> the other keys it is also
        # written under (DeepSeek's MTP layer keeps copies of the embedding
        # and the LM head).
        self.saved_twice: dict[str, list[str]] = {}
        self.make_extras()
        # to_empty makes new Parameters (meta -> cpu): carry over the marks
        # our DDP, ZeRO and dtype handling read.
        marks = {n: _dsp_marks(p) for n, p in self.named_parameters()}
        self.to_empty(device="cpu")
        for name, p in self.named_parameters():
            for key, value in marks[name].items():
                setattr(p, key, value)
        for p in self.parameters():
            if dtype is not None and not getattr(p, "_dsp_keep_fp32", False):
                p.data = p.data.to(dtype)
        if _initialize:
            self._initialize(seed)
        if mixed_precision is not None:
            apply_mixed_precision(self, mixed_precision)

    # ------------------------------------------------------------ subclasses

    def check(self, cfg) -> None:
        pass

    @classmethod
    def checkpoint_options(cls, config: dict, weight_map: dict) -> dict:
        """Constructor arguments a checkpoint implies (``from_pretrained``
        passes them unless given): none by default."""
        return {}

    def make_layer(self, index: int) -> nn.Module:
        raise NotImplementedError

    def make_extras(self) -> None:
        """Modules past the decoder layers, built with the rest (on the
        meta device, filled from the checkpoint): DeepSeek-V3's
        multi-token prediction. None by default."""

    def extra_loss(self, h, input_ids, labels, position_ids, mask, num_items):
        """A training objective added to the loss of a forward with labels
        in training mode, from the last layer's output ``h`` and the whole
        sequences' ``input_ids`` (None: none)."""
        return None

    def make_rotary(self):
        raise NotImplementedError

    def make_norm(self, key: str) -> nn.Module:
        """The final norm (checkpoint name ``key``): RMSNorm by default."""
        cfg = self.config
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, f"{key}.weight", self.layout)

    def make_position_embedding(self) -> nn.Module | None:
        """Learned position embeddings added to the token embeddings
        (``module(position_ids)``), or None (rotary positions in attention)."""
        return None

    # ---------------------------------------------------------------- forward

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        return_logits: bool | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> CausalLMOutput:
        """As ``transformers``' causal LM forward: ``input_ids`` [batch,
        seq], ``attention_mask`` [batch, seq] (1 keeps a token; left or
        right padding), ``position_ids`` by default 0..seq-1,
        ``num_items_in_batch`` as ``loss_fn``'s (gradient accumulation with
        a per-token loss: ``count_items`` of every accumulation step's
        labels). The logits
        are gathered over tensor parallelism only when returned
        (``return_logits``, by default when no labels are given); the loss
        never needs them gathered.

        Under context parallelism every rank of a cp group is given the
        same whole sequences (as the ranks of a tensor-parallel group are)
        and takes its part of them (``context_parallel.shard_sequence``);
        the loss is the mean over the whole sequences on every rank, and
        returned logits are gathered whole, without a gradient (for
        evaluation)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        b, s = input_ids.shape
        for name, t in (("attention_mask", attention_mask), ("labels", labels)):
            if t is not None and tuple(t.shape) != (b, s):
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}, input_ids {tuple(input_ids.shape)}: "
                    "they must match"
                )
        if return_logits is None:
            return_logits = labels is None
        lay = self.layout
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0)
        whole_ids = input_ids
        if lay.cp_size > 1:
            input_ids, position_ids, mask = self._shard(input_ids, position_ids, attention_mask)
        else:
            mask = attention_mask_for(attention_mask, s)
        local = input_ids.shape[1]
        if lay.sp and local % lay.tp_size:
            raise ValueError(
                f"sequence parallelism splits the sequence over {lay.tp_size} ranks: "
                f"its length {local} (this rank's part under context parallelism) must be a "
                "multiple of that"
            )
        if lay.pp_size == 1:
            h = self.run_layers(self.embed(input_ids, position_ids), position_ids, mask)
            out = self._output(h, labels, return_logits, num_items_in_batch)
            if labels is not None and self.training and torch.is_grad_enabled():
                extra = self.extra_loss(
                    h, whole_ids, labels, position_ids, mask, num_items_in_batch
                )
                if extra is not None:
                    out.loss = out.loss + extra
            return out
        with torch.no_grad():
            return self._pipelined(
                input_ids, labels, position_ids, mask, return_logits, num_items_in_batch
            )

    def _shard(self, input_ids, position_ids, attention_mask):
        """This rank's part of the tokens, their positions and their
        attention mask under context parallelism (the mask as document
        ids: ``layers.attend``)."""
        group = self.layout.cp_group
        b, s = input_ids.shape
        ids = context_parallel.shard_sequence(input_ids, group)
        position_ids = context_parallel.shard_sequence(position_ids.expand(-1, s), group)
        mask = None
        if attention_mask is not None:
            mask = context_parallel.shard_sequence(attention_mask, group)
        return ids, position_ids, mask

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None):
        """[batch, seq] ids -> [seq (/tp), batch, hidden], this rank's part
        of the sequence under sequence parallelism; ``position_ids``
        ([1 or batch, seq], by default 0..seq-1) for learned position
        embeddings."""
        vocab = self.config.vocab_size
        if self.padded_vocab != vocab and input_ids.numel() and int(input_ids.max()) >= vocab:
            # The embedding would take ids of its padded rows.
            raise IndexError(
                f"{type(self).__name__}: token id {int(input_ids.max())} is outside the "
                f"vocabulary [0, {vocab})"
            )
        h = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
            h = h + self.embed_positions(position_ids)
        h = h.transpose(0, 1).contiguous()
        if self.layout.sp:
            h = tp.scatter_to_sequence_parallel_region(h, self.layout.tp_group)
        return h

    def run_layers(self, h, position_ids, mask, stage: int | None = None) -> torch.Tensor:
        """The decoder layers of pipeline stage ``stage`` (all of this
        rank's layers for None)."""
        cos, sin = self.rotary.cos_sin(position_ids, h.dtype)
        names = self.layers.keys() if stage is None else self.stage_layers[stage]
        for layer in (self.layers[n] for n in names):
            if self.checkpoint and torch.is_grad_enabled():
                h = recompute(layer, h, cos, sin, mask)
            else:
                h = layer(h, cos, sin, mask)
        return h

    def vocab_parallel_logits(self, h: torch.Tensor, norm: nn.Module | None = None):
        """This rank's vocabulary slice of the logits [seq, batch, vocab / tp]
        of the last stage (after ``norm``, by default the final norm)."""
        h = (norm or self.norm)(h)
        if self._head_is_embedding:
            # Read outside the embedding's forward: no cast copy there.
            w = self.embed_tokens.weight.to(h.dtype)
            logits = F.linear(self.layout.enter(h), w)
        else:
            logits = self.lm_head(h)
        real = self._real_columns()
        if real < logits.shape[-1]:
            # The padded rows of a padded vocabulary never win and add
            # nothing to the softmax (their gradient is zero).
            logits[..., real:] = torch.finfo(logits.dtype).min
        return logits

    def _real_columns(self) -> int:
        """How many of this rank's vocabulary columns are real (not padding)."""
        per = self.padded_vocab // self.layout.tp_size
        return max(0, min(per, self.config.vocab_size - self.layout.tp_rank * per))

    def loss_fn(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Next-token cross entropy of vocabulary-parallel logits [seq, batch,
        vocab / tp] against labels [batch, seq]: position t predicts
        labels[t + 1], -100 ignored.

        Without ``num_items_in_batch``: the mean over this batch's kept
        labels. With it (as ``transformers``' argument of that name): the
        kept labels of the whole global batch, every micro-batch,
        accumulation step and data-parallel rank together
        (``count_items``): the loss is then this batch's sum of token
        losses over that count, times the data-parallel size (which the
        gradients' averaging over the replicas divides out), so that the
        gradient is that of the mean over every kept label of the global
        batch, however unevenly the labels fall. The pipeline schedules pass
        it by themselves (they call ``count_items`` first)."""
        shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()  # as transformers' loss (float64 stays so)
        lay = self.layout
        if num_items_in_batch is None:
            count = (shifted != IGNORE_INDEX).sum().clamp(min=1)
        else:
            count = torch.as_tensor(num_items_in_batch).clamp(min=1) / lay.dp_size
        if lay.cp_size == 1:
            if num_items_in_batch is None:
                return tp.vocab_parallel_cross_entropy(
                    logits, shifted.t(), group=lay.tp_group, ignore_index=IGNORE_INDEX
                )
            total = tp.vocab_parallel_cross_entropy(
                logits, shifted.t(), group=lay.tp_group, ignore_index=IGNORE_INDEX, reduction="sum"
            )
            return total / count
        # Context parallelism: the logits are this rank's positions, the
        # labels (shifted above) the whole sequences'. The value is the sum
        # over the whole sequences over the count, the same on every rank of
        # the group (one all-reduce of a scalar); the gradient is C times
        # this rank's share of it, so that averaging gradients over dp x cp
        # (DDP over dp_cp_group) gives the gradient of the whole sequences'.
        mine = context_parallel.shard_sequence(shifted, lay.cp_group).t()
        total = tp.vocab_parallel_cross_entropy(
            logits, mine, group=lay.tp_group, ignore_index=IGNORE_INDEX, reduction="sum"
        )
        share = total * lay.cp_size / count
        mean = total.detach().clone()
        dist.all_reduce(mean, group=lay.cp_group)
        mean /= count
        return share + (mean - share).detach()

    def count_items(self, labels: list[torch.Tensor]) -> torch.Tensor:
        """The kept labels (not -100, after the shift) of ``labels``, the
        [batch, seq] labels of every micro-batch or accumulation step of
        this rank's step, summed over the data-parallel ranks: the
        ``num_items_in_batch`` of ``loss_fn`` and of ``forward``. Every
        rank of the data-parallel group calls it."""
        n = sum(int((t[:, 1:] != IGNORE_INDEX).sum()) for t in labels)
        count = torch.tensor(n, dtype=torch.int64)
        if self.layout.dp_size > 1:
            dist.all_reduce(count, group=self.layout.dp_group)
        return count

    def _output(self, h, labels, return_logits, num_items=None) -> CausalLMOutput:
        local = self.vocab_parallel_logits(h)
        out = CausalLMOutput()
        if labels is not None:
            out.loss = self.loss_fn(local, labels, num_items)
        if return_logits:
            lay = self.layout
            logits = (
                local
                if lay.tp_size == 1
                else tp.gather_from_tensor_parallel_region(local, lay.tp_group)
            )
            if lay.cp_size > 1:
                logits = context_parallel.unshard_sequence(logits, lay.cp_group, dim=0)
            out.logits = logits.transpose(0, 1)[..., : self.config.vocab_size]
        return out

    def _pipelined(self, input_ids, labels, position_ids, mask, return_logits, num_items):
        lay = self.layout
        b, s = input_ids.shape
        local = s // lay.tp_size if lay.sp else s
        shape = (local, b, self.config.hidden_size)

        def compute(stage, m, x):
            h = self.embed(x, position_ids) if stage == 0 else x
            h = self.run_layers(h, position_ids, mask, stage)
            if stage < self.num_stages - 1:
                return h
            return self._output(h, labels, return_logits, num_items)

        stages = ForwardStages(self)
        out = stages.step(1, lambda m: input_ids, compute, lambda s, m: (shape, self._dtype()))
        stages.finish()
        return out.get(0, CausalLMOutput())

    @torch.no_grad()
    def cached_step(
        self, x, position_ids, attention_mask, cache, start: int, stage: int | None = None
    ) -> torch.Tensor:
        """One forward of pipeline stage ``stage`` (by default this rank's
        only one) over queries at positions start.. with the KV cache
        (``dsparallel.inference``): ``x`` the token ids [batch, q] (first
        stage) or the previous stage's hidden states; ``attention_mask``
        [batch, >= start + q] over every position so far; ``cache`` this
        rank's per-layer caches. Returns the hidden states, or on the last
        stage the full-vocabulary logits of the last position [batch,
        vocab]. ``attention_mask=None``: no padding."""
        if stage is None:
            (stage,) = self.stage_ids
        h = self.embed(x, position_ids) if stage == 0 else x
        mask = cached_mask(attention_mask, h.shape[1], h.shape[0], start)
        cos, sin = self.rotary.cos_sin(position_ids, h.dtype)
        for index in self.stage_layers[stage]:
            h = self.layers[index](h, cos, sin, mask, (cache[index], start))
        if stage < self.num_stages - 1:
            return h
        logits = last_logits(self.vocab_parallel_logits(h[-1:]), self.layout)
        return logits[:, : self.config.vocab_size]

    @torch.no_grad()
    def paged_stage(self, stage: int, x, position_ids, paged, rows) -> torch.Tensor:
        """Pipeline stage ``stage`` of one continuous-batching step over a
        paged KV cache (``dsparallel.inference.paged``): ``x`` the token ids
        [1, tokens] (stage 0; every sequence's new tokens one after another)
        or the previous stage's hidden states; ``position_ids`` [1, tokens];
        ``paged`` the step's ``PagedStep``; ``rows`` the places in
        ``tokens`` whose next-token logits are wanted. Returns the hidden
        states, or on the last stage those logits, full vocabulary
        [len(rows), vocab], on every tensor-parallel rank."""
        h = self.embed(x, position_ids) if stage == 0 else x
        cos, sin = self.rotary.cos_sin(position_ids, h.dtype)
        for index in self.stage_layers[stage]:
            h = self.layers[index](h, cos, sin, None, paged.layer(index))
        if stage < self.num_stages - 1:
            return h
        logits = last_logits(self.vocab_parallel_logits(h[rows].transpose(0, 1)), self.layout)
        return logits[:, : self.config.vocab_size]

    def cache_entries(self) -> dict:
        """Per layer of this rank: the shapes one cached position holds
        (a paged cache's pool is [positions, *shape] of each)."""
        return {i: layer.self_attn.cache_entries() for i, layer in self.layers.items()}

    def new_cache(self, batch: int, length: int, dtype: torch.dtype) -> dict:
        """This stage's KV cache: each layer's ``new_cache``."""
        if self.layout.cp_size > 1:
            raise NotImplementedError(
                f"{type(self).__name__}: generation under context parallelism is not supported: "
                "build the model for generation without context_parallel_size"
            )
        return {
            i: layer.self_attn.new_cache(batch, length, dtype) for i, layer in self.layers.items()
        }

    def _dtype(self) -> torch.dtype:
        """The dtype of the hidden states (of buffers between stages, of
        the KV cache)."""
        return compute_dtype(self)

    @property
    def precision(self) -> str:
        """ "float32", "pure bfloat16" (weights, gradients and optimizer
        state in bfloat16) or "mixed bfloat16 (float32 masters)"."""
        return describe_precision(self)

    # --------------------------------------------------------------- pipeline

    def stage_owner(self, stage: int) -> int:
        """The pipeline rank holding pipeline stage ``stage``."""
        return _C.rank_of_stage(stage, self.layout.pp_size, self.stage_placement)

    def pipeline_stage(self, wrap=None):
        """This rank's stage for a pipeline schedule of one stage per rank
        (``pipeline_stages`` for several)."""
        if len(self.stage_ids) != 1:
            raise ValueError(
                f"{type(self).__name__}.pipeline_stage: this rank holds stages "
                f"{self.stage_ids}: use pipeline_stages()"
            )
        return self.pipeline_stages(wrap)[0]

    def pipeline_stages(self, wrap=None) -> list:
        """This rank's stages for a pipeline schedule, ascending: a stage's
        input is the token ids (first stage) or the previous stage's hidden
        states, its output the hidden states or, on the last stage, the
        vocabulary-parallel logits for ``loss_fn``. Causal attention
        without padding, positions 0..seq-1. Under context parallelism the
        first stage takes the whole sequences' ids, as ``loss_fn`` their
        whole labels; the stages pass on this rank's part. ``wrap`` wraps
        each stage's module, which holds that stage's parameters only
        (``wrap=DistributedDataParallel`` for data parallelism)."""
        from ..pipeline import PipelineStage

        lay = self.layout
        if hasattr(self, "unshard"):
            raise NotImplementedError(
                f"{type(self).__name__}.pipeline_stage: the model is sharded by FSDP2 "
                "(fully_shard), whose hooks run around the model's own forward, which a "
                "pipeline stage does not call: under pipeline parallelism shard the optimizer "
                "and gradients with ZeRO (DistributedDataParallel(zero_stage=2) and "
                "ZeroRedundancyOptimizer) instead"
            )
        if getattr(self, "mtp_depth", 0) and self.training:
            raise NotImplementedError(
                f"{type(self).__name__}.pipeline_stages: the pipeline schedules do not train "
                "multi-token prediction yet (its last stage would need the token ids); load "
                "the model with mtp_depth=0 (the trainer: [model] mtp_depth = 0) to train it "
                "without, or train MTP at pipeline size 1"
            )
        wrap = wrap or (lambda module: module)
        return [
            PipelineStage(wrap(_Stage(self, s)), s, self.num_stages, group=lay.pp_group)
            for s in self.stage_ids
        ]

    def allreduce_tied_grads(self) -> None:
        """With tied embeddings under pipeline parallelism the last stage
        holds a copy of the embedding as its LM head: sums the two copies'
        gradients (as Megatron does) so that they stay equal. Call it after
        backward, before the optimizer step, on every rank.

        Wherever the gradient is held: ``.grad`` (a DTensor's local shard
        under FSDP2, sharded alike on both stages), or ZeRO-2's gradient
        shards, whose slices of the two copies differ (each lies in its own
        stage's buckets): there the copy's whole gradient is pieced
        together over the data-parallel group first."""
        if not self.tied or self._head_is_embedding or not (self.is_first or self.is_last):
            return
        if self.is_first and self.is_last:  # both copies on this rank (a V)
            copies = [self.embed_tokens.weight, self.lm_head.weight]
            total = sum(_grad_of(p) for p in copies)
            for p in copies:
                _set_grad(p, total)
            return
        p = self.embed_tokens.weight if self.is_first else self.lm_head.weight
        grad = _grad_of(p)
        dist.all_reduce(grad, group=self._tied_group)
        _set_grad(p, grad)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, optimizer=None):
        """Clips every gradient of the model by the whole model's norm,
        whatever the layout (tensor, pipeline, expert, context and data
        parallel, ZeRO slices, FSDP2 shards, tied copies counted once):
        the norm and the clipped gradients of
        ``torch.nn.utils.clip_grad_norm_`` over the model in one process.
        Every rank calls it, after ``allreduce_tied_grads``, before the
        step; ``optimizer``: the ``ZeroRedundancyOptimizer`` holding the
        gradients under ZeRO. Returns the norm."""
        from .grad_norm import clip_grad_norm_

        return clip_grad_norm_(self, max_norm, norm_type, optimizer)

    # ------------------------------------------------------------ checkpoints

    def checkpoint_map(self) -> dict:
        """Our parameter and buffer names -> where they lie in a checkpoint."""
        return specs_of(self)

    def _tensor(self, name: str) -> torch.Tensor:
        try:
            return self.get_parameter(name)
        except AttributeError:
            return self.get_buffer(name)

    @torch.no_grad()
    def _initialize(self, seed: int) -> None:
        std = self.config.get("initializer_range", 0.02)
        for name, node in self.checkpoint_map().items():
            t = self._tensor(name)
            full = materialize(node, lambda p: initial_block(p, seed, std))
            t.copy_(full)

    @torch.no_grad()
    def load_hf(self, read) -> set[str]:
        """Fills every parameter from ``read(piece)``; returns the keys read."""
        used = set()

        def block(piece):
            used.add(piece.key)
            return read(piece)

        for name, node in self.checkpoint_map().items():
            t = self._tensor(name)
            t.copy_(materialize(node, block))  # copy_ casts to the model's dtype
        return used

    def hf_blocks(self, grads: bool = False):
        """(piece, block) of everything this rank saves: its parameters and
        buffers (or the parameters' gradients, zeros where none) cut back
        into checkpoint blocks."""
        out = []
        params = dict(self.named_parameters())
        for name, node in self.checkpoint_map().items():
            if name in self._copies or (grads and name not in params):
                continue
            t = self._tensor(name)
            if grads:
                t = t.grad if t.grad is not None else torch.zeros_like(t)
            for piece, b in split(node, t):
                b = b.detach().cpu().clone()
                out.append((piece, b))
                if not grads:
                    out.extend(
                        (dataclasses.replace(piece, key=k), b)
                        for k in self.saved_twice.get(piece.key, ())
                    )
        return out

    def save_pretrained(self, path: str) -> None:
        """A Hugging Face checkpoint of the whole model (every rank calls
        it): each pipeline stage's tensors are gathered on that stage's
        first rank, which writes them as one safetensors file; the first
        rank writes the index and config.json. ``transformers``'
        ``from_pretrained`` loads it."""
        from .checkpoint_io import save_pretrained

        save_pretrained(self, path)

    def hf_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """The whole model (or its gradients) under checkpoint names, on
        every rank: for tests and small models (everything is gathered)."""
        from .checkpoint_io import gather_full

        return gather_full(self, grads)

    def config_dict(self) -> dict:
        values = self.config.to_dict()
        for common in self.aliases:  # saved under the model's own names only
            values.pop(common, None)
        values["architectures"] = [self.architecture]
        values["model_type"] = self.model_type
        # The dtype of the tensors saved: float32 masters under mixed precision.
        stored = next(p.dtype for p in self.parameters() if not getattr(p, "_dsp_keep_fp32", False))
        values["dtype"] = str(stored).removeprefix("torch.")
        return values


def padded_vocab(vocab: int, tp: int, multiple: int) -> int:
    """The vocabulary size the embedding and LM head hold: ``vocab`` when
    the tensor-parallel size divides it, else padded (as Megatron's
    ``make_vocab_size_divisible_by``, vLLM's 64 per rank) to a multiple of
    ``tp x multiple``."""
    if vocab % tp == 0:
        return vocab
    if multiple < 1:
        raise ValueError(f"pad_vocab_to must be a positive integer, got {multiple}")
    step = tp * multiple
    return -(-vocab // step) * step


def _grad_of(p: torch.Tensor) -> torch.Tensor:
    """The gradient of ``p`` wherever it is held: ZeRO-2's gradient shards,
    whose slices of the two tied copies differ (each lies in its own
    stage's buckets), pieced together over the data-parallel group; else
    ``.grad`` (a DTensor's local shard under FSDP2, sharded alike on both
    stages), zeros where none."""
    buffer = getattr(p, "_dsp_zero_buffer", None)
    if buffer is not None:
        return buffer.param_grad(p)
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad


def _set_grad(p: torch.Tensor, grad: torch.Tensor) -> None:
    buffer = getattr(p, "_dsp_zero_buffer", None)
    if buffer is not None:
        buffer.set_param_grad(p, grad)
        return
    local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
    if local.data_ptr() != grad.data_ptr():
        local.copy_(grad)


def _dsp_marks(p: torch.Tensor) -> dict:
    return {k: v for k, v in vars(p).items() if k.startswith("_dsp_")}


class _Stage(nn.Module):
    """Pipeline stage ``stage`` of a model as a schedule calls it: one
    tensor in, one out. It holds the stage's own modules only (the
    embedding, its layers, the norm and LM head), so that a wrapper (DDP)
    around it sees this stage's parameters and no other's."""

    def __init__(self, model: CausalLM, stage: int):
        super().__init__()
        object.__setattr__(self, "model", model)  # not a submodule: its parameters are not ours
        self.stage = stage
        self.is_first, self.is_last = stage == 0, stage == model.num_stages - 1
        policy = getattr(model, "_dsp_mixed_precision", None)
        if policy is not None:  # what a DDP around the stage reduces in
            self._dsp_mixed_precision = policy
        if self.is_first:
            self.embed_tokens = model.embed_tokens
            if model.embed_positions is not None:
                self.embed_positions = model.embed_positions
        self.layers = nn.ModuleDict({n: model.layers[n] for n in model.stage_layers[stage]})
        if self.is_last:
            self.norm = model.norm
            if not model._head_is_embedding:
                self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m, lay = self.model, self.model.layout
        if self.is_first and lay.cp_size > 1:  # the whole sequences' ids
            x = context_parallel.shard_sequence(x, lay.cp_group)
        if self.is_first:
            seq = x.shape[1]
        else:
            seq = x.shape[0] * (lay.tp_size if lay.sp else 1)
        if lay.cp_size == 1:
            positions = torch.arange(seq, device=x.device)[None]
        else:
            positions = context_parallel.positions(seq * lay.cp_size, lay.cp_group, x.device)[None]
        h = m.embed(x, positions) if self.is_first else x
        h = m.run_layers(h, positions, None, self.stage)
        return m.vocab_parallel_logits(h) if self.is_last else h


def _first_last_stage_group(lay: Layout):
    """The group of the first and last stage's ranks at this rank's
    (dp, tp) place; every rank creates every such group, in one order."""
    grid = lay.mesh.mesh  # [pp, dp, tp] global ranks ([pp, dp, cp, tp] with cp)
    grid = grid.reshape(grid.shape[0], -1, grid.shape[-1])
    me = dist.get_rank()
    mine = None
    for d in range(grid.shape[1]):
        for t in range(grid.shape[2]):
            ranks = [int(grid[0, d, t]), int(grid[-1, d, t])]
            group = dist.new_group(ranks)
            if me in ranks:
                mine = group
    return mine
