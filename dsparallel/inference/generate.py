"""Generation with a KV cache under tensor and pipeline parallelism, the
tokens of ``transformers``' ``generate`` with the same arguments.

Every rank of the model calls ``generate`` with the same prompts. The
prompts run through the model once (prefill) and fill the cache, then each
step feeds one token per sequence. Prompts of different lengths come left
padded with their attention mask; positions count the kept tokens
(``cumsum(mask) - 1``, pads at 1), as ``transformers`` does.

Tokens: every tensor-parallel rank holds the same full-vocabulary logits
(gathered) and the same generator state (a seed broadcast over the
tensor-parallel group, or the caller's generator seeded alike on every
rank), so every rank draws the same token without another message.

Under pipeline parallelism the batch is split into one micro-batch per
pipeline rank (at most one per sequence), all in flight through the
model's stages (``models.forward_stages``, whatever their placement):
while the last stage samples micro-batch m, the first already runs m + 1.
The last stage's rank sends each micro-batch's tokens back to the first
stage's for its next step, and the whole output to every rank at the end. The pipeline runs all
``max_new_tokens`` steps (finished sequences are padded, as
``transformers`` does), and the output is cut where every sequence had
finished, as ``transformers``' early stop leaves it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..models.forward_stages import ForwardStages
from .fast_linear import fast_decoding
from .kv_cache import KVCache


def generate(
    model,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.LongTensor:
    """[batch, prompt + new] token ids on every rank (``transformers``'
    ``generate`` semantics: greedy unless ``do_sample``; temperature, then
    top-k, then top-p; a sequence that produced ``eos_token_id`` continues
    with ``pad_token_id``, which defaults to the eos token)."""
    model = getattr(model, "module", model)
    lay = model.layout
    _check(model, input_ids, attention_mask, max_new_tokens)
    with fast_decoding(model):
        return _generate(
            model,
            input_ids,
            max_new_tokens,
            attention_mask,
            eos_token_id,
            pad_token_id,
            _Sampler(do_sample, temperature, top_k, top_p, generator, lay),
        )


def _generate(
    model, input_ids, max_new_tokens, attention_mask, eos_token_id, pad_token_id, sampler
):
    b, p = input_ids.shape
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    if max_new_tokens == 0:
        return input_ids.clone()
    eos = _as_list(eos_token_id)
    if pad_token_id is None and eos:
        pad_token_id = eos[0]
    full_mask = torch.cat([mask, mask.new_ones(b, max_new_tokens)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).masked_fill_(full_mask == 0, 1)
    cache = KVCache(model, b, p + max_new_tokens, model._dtype())
    stop = _Stop(eos, pad_token_id, b)
    # Without padding the layers take no mask: the fused attention kernels.
    keys = full_mask if not bool(mask.all()) else None
    job = (model, input_ids, keys, positions, cache, sampler, stop, max_new_tokens)
    new = _run_local(*job) if model.layout.pp_size == 1 else _run_pipelined(*job)
    return torch.cat([input_ids, new[:, : stop.length(new)]], dim=1)


def _check(model, input_ids, attention_mask, max_new_tokens) -> None:
    """Bad input raises the same error on every rank (each checks its own
    copy of the same arguments) before any collective."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(
            f"generate: max_new_tokens must be an integer >= 0, got {max_new_tokens!r}"
        )
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"generate: input_ids must be integer [batch, prompt], got {input_ids.dtype} "
            f"{tuple(input_ids.shape)}"
        )
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"generate: attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
            f"{tuple(input_ids.shape)}: batch and length must match"
        )
    total = input_ids.shape[1] + max_new_tokens
    limit = model.config.get("max_position_embeddings")
    if limit is not None and total > limit:
        raise ValueError(
            f"generate: the prompt ({input_ids.shape[1]} tokens) plus max_new_tokens "
            f"({max_new_tokens}) is {total} positions, more than the model's "
            f"max_position_embeddings={limit}"
        )
    if model.layout.sp:
        raise ValueError(
            "generate: the model was built with sequence_parallel=True, which splits the "
            "sequence; build it without for generation"
        )


def _as_list(eos) -> list[int]:
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


class _Stop:
    """Per sequence: whether it has produced an eos token; a finished
    sequence's later tokens become the pad token."""

    def __init__(self, eos: list[int], pad: int | None, batch: int):
        self.eos = torch.tensor(eos, dtype=torch.long)
        self.pad = pad
        self.finished = torch.zeros(batch, dtype=torch.bool)

    def apply(self, tokens: torch.Tensor, rows=slice(None)) -> torch.Tensor:
        if not len(self.eos):
            return tokens
        done = self.finished[rows]
        tokens = torch.where(done, torch.full_like(tokens, self.pad), tokens)
        self.finished[rows] = done | torch.isin(tokens, self.eos)
        return tokens

    def all_done(self) -> bool:
        return bool(len(self.eos)) and bool(self.finished.all())

    def length(self, new: torch.Tensor) -> int:
        """The number of steps ``transformers`` would have made: up to the
        step where the last sequence finished."""
        if not len(self.eos):
            return new.shape[1]
        hit = torch.isin(new, self.eos)
        first = torch.where(hit.any(1), hit.float().argmax(1), new.shape[1] - 1)
        return int(first.max()) + 1


class _Sampler:
    """The next token from full logits [batch, vocab], as ``transformers``'
    greedy search or its sampling (float32 logits; temperature, top-k,
    top-p warpers in that order; ``torch.multinomial``)."""

    def __init__(self, do_sample, temperature, top_k, top_p, generator, lay):
        self.do_sample, self.temperature, self.top_k, self.top_p = (
            do_sample,
            temperature,
            top_k,
            top_p,
        )
        if not do_sample:
            return
        if not temperature > 0:
            raise ValueError(f"generate: temperature must be positive, got {temperature}")
        if generator is None:
            # One seed for the tensor-parallel group: the ranks draw alike.
            seed = torch.randint(0, 2**62, (1,))
            if lay.tp_size > 1:
                dist.broadcast(seed, group=lay.tp_group, group_src=0)
            generator = torch.Generator().manual_seed(int(seed))
        self.generator = generator

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        scores = logits.float()
        if not self.do_sample:
            return scores.argmax(-1)
        if self.temperature != 1.0:
            scores = scores / self.temperature
        if self.top_k is not None and self.top_k > 0:
            k = min(self.top_k, scores.shape[-1])
            kth = scores.topk(k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1.0:
            ordered, order = scores.sort(dim=-1)
            cumulative = ordered.softmax(-1).cumsum(-1)
            drop = cumulative <= 1 - self.top_p
            drop[..., -1:] = False
            scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        probs = scores.softmax(-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1)


def _run_local(model, input_ids, full_mask, positions, cache, sampler, stop, steps):
    """One pipeline stage: prefill, then one token per step."""
    p = input_ids.shape[1]
    # With experts split over ranks each step is collective: all run alike.
    can_stop = model.layout.ep_size == 1
    logits = model.cached_step(input_ids, positions[:, :p], full_mask, cache.layers, 0)
    new = torch.empty(input_ids.shape[0], steps, dtype=torch.long)  # written in place
    for n in range(steps):
        new[:, n] = stop.apply(sampler(logits))
        if n == steps - 1 or (can_stop and stop.all_done()):
            return new[:, : n + 1]
        at = p + n
        logits = model.cached_step(
            new[:, n : n + 1], positions[:, at : at + 1], full_mask, cache.layers, at
        )
    return new


def _run_pipelined(model, input_ids, full_mask, positions, cache, sampler, stop, steps):
    """Micro-batches in flight through the stages (see the module docstring)."""
    lay = model.layout
    b, p = input_ids.shape
    bounds = [
        (int(c[0]), int(c[-1]) + 1) for c in torch.arange(b).tensor_split(min(b, lay.pp_size))
    ]
    hidden, dtype = model.config.hidden_size, model._dtype()
    caches = [cache.rows(a, z) for a, z in bounds]
    out = torch.empty(b, steps, dtype=torch.long)  # the last stage's tokens, in place
    stages = ForwardStages(model)
    last = model.num_stages - 1
    first_rank, last_rank = model.stage_owner(0), model.stage_owner(last)
    fed = {}  # micro-batch -> its next input, where one rank holds the first and last stage

    def run(n):  # step n: the prompts (n = 0), then one token each
        start, q = (0, p) if n == 0 else (p + n - 1, 1)

        def first(m):
            a, z = bounds[m]
            if n == 0:
                return input_ids[a:z]
            if first_rank == last_rank:
                return fed.pop(m)
            return stages.recv((z - a, 1), torch.long, last_rank)

        def compute(s, m, x):
            a, z = bounds[m]
            keys = None if full_mask is None else full_mask[a:z]
            h = model.cached_step(x, positions[a:z, start : start + q], keys, caches[m], start, s)
            if s < last:
                return h
            tokens = stop.apply(sampler(h), slice(a, z))
            out[a:z, n] = tokens
            if n < steps - 1 and first_rank == last_rank:
                fed[m] = tokens[:, None]
            elif n < steps - 1:
                stages.send(("tokens", m), tokens[:, None].contiguous(), first_rank)
            return tokens

        def buffer(s, m):
            return (q, bounds[m][1] - bounds[m][0], hidden), dtype

        stages.step(len(bounds), first, compute, buffer)

    for n in range(steps):
        run(n)
    stages.finish()
    dist.broadcast(out, group=lay.pp_group, group_src=last_rank)
    return out
