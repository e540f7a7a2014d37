"""Continuous batching over the paged KV cache, in lockstep on every
tensor-parallel rank.

Rank 0 (the one that serves HTTP) schedules: each step it takes the next
token of every running sequence, then chunks of waiting prompts up to the
step's token budget (chunked prefill), and grows each sequence's block
table as it goes. A request that finds no free blocks waits in the queue;
when a running sequence cannot grow, the most recently admitted one is
preempted (its blocks freed, its tokens recomputed later, as vLLM does).
Rank 0 broadcasts the step's plan (token ids, positions, cache slots,
attention groups) to every rank of the model; the tensor-parallel ranks
of a stage run the same forward. Under pipeline parallelism the step's
sequences are split into up to pp micro-batches that go through the
stages together (stage s runs micro-batch m while stage s + 1 runs m - 1),
and the last stage sends the logits back to rank 0. Rank 0 samples each
sequence's token with its own parameters and generator, and reports
tokens and text to the request.

Ranks other than 0 only follow (``Engine.follow``). While idle, rank 0
sends a heartbeat every few seconds so that no rank waits past the
process group's timeout.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..inference.fast_linear import fast_decoding
from ..inference.paged import BlockPool, PagedStep, plan_group
from ..models.forward_stages import ForwardStages

_IDLE, _STOP = "idle", "stop"
_HEARTBEAT_S = 5.0


@dataclass
class SamplingParams:
    """One request's decoding: ``temperature`` 0 is greedy; top-k (0: off),
    then top-p, as ``transformers``' warpers; ``stop`` strings end the text
    before them; ``seed`` makes sampling reproducible."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass
class Sequence:
    id: int
    prompt: list[int]
    params: SamplingParams
    sink: object  # called with each Event, from the engine's thread
    tokens: list[int] = field(default_factory=list)
    computed: int = 0  # positions whose keys and values are in the cache
    table: list[int] = field(default_factory=list)
    text: str = ""  # the decoded output so far (cut at a stop string)
    sent: int = 0  # characters of ``text`` already reported
    generator: torch.Generator | None = None
    aborted: bool = False

    @property
    def all(self) -> list[int]:
        return self.prompt + self.tokens


@dataclass
class Event:
    """What one step added to a request: ``text`` and ``token_ids``, and
    when it ended its ``finish_reason`` ("stop", "length", "abort",
    "error: ...")."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Engine:
    """``Engine(model, tokenizer, pool, ...)`` on every rank of the model;
    rank 0 calls ``start()`` and ``submit``, the others ``follow()``."""

    def __init__(
        self,
        model,
        tokenizer,
        pool: BlockPool,
        *,
        max_model_len: int,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_waiting: int = 256,
        eos_token_ids: tuple[int, ...] = (),
    ):
        self.model, self.tokenizer, self.pool = model, tokenizer, pool
        # The plan goes to every rank of the model (tp x pp).
        many = dist.is_initialized() and dist.get_world_size() > 1
        self.group = dist.group.WORLD if many else None
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.budget, self.max_waiting = max_num_batched_tokens, max_waiting
        self.eos = tuple(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._lock, self._wake = threading.Lock(), threading.Event()
        self._ids = itertools.count()
        self._thread = None
        self._stopping = False
        self.error: BaseException | None = None
        self.steps = self.preemptions = 0

    # ----------------------------------------------------------- rank 0 API

    def submit(self, prompt: list[int], params: SamplingParams, sink) -> Sequence:
        """Queues a sequence (thread-safe). Raises ``QueueFull`` past the
        bound and ``ValueError`` for a prompt the model cannot hold."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) is "
                f"more than the model's context of {self.max_model_len} tokens"
            )
        if self.pool.blocks_for(len(prompt) + params.max_tokens) > self.pool.num_blocks:
            raise ValueError(
                f"the request needs more KV-cache blocks than the whole pool holds "
                f"({self.pool.num_blocks} of {self.pool.block_size} positions)"
            )
        vocab = self.model.config.vocab_size
        if max(prompt) >= vocab or min(prompt) < 0:
            raise ValueError(f"a prompt token id is outside the vocabulary [0, {vocab})")
        seq = Sequence(next(self._ids), list(prompt), params, sink)
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)))
            seq.generator = torch.Generator().manual_seed(seed)
        with self._lock:
            if self.error is not None:
                raise RuntimeError(f"the engine stopped: {self.error}")
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are already waiting")
            self.waiting.append(seq)
        self._wake.set()
        return seq

    def abort(self, seq: Sequence) -> None:
        """Ends ``seq`` at the next step and frees its blocks (thread-safe)."""
        seq.aborted = True
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dsparallel-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends the loop on rank 0 and releases the followers."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------ followers

    def follow(self) -> None:
        """Ranks other than 0: run every step rank 0 sends until it stops."""
        with fast_decoding(self.model):
            while True:
                plan = self._broadcast(None)
                if plan == _STOP:
                    return
                if plan != _IDLE:
                    self._forward(plan)

    # ------------------------------------------------------------- the loop

    def _loop(self) -> None:
        with fast_decoding(self.model):
            self._serve()

    def _serve(self) -> None:
        try:
            while not self._stopping:
                plan, batch = self._schedule()
                if plan is None:
                    if self._wake.wait(timeout=_HEARTBEAT_S) or self._stopping:
                        self._wake.clear()
                        continue
                    self._broadcast(_IDLE)
                    continue
                self._broadcast(plan)
                logits = self._forward(plan)
                self._finish_step(batch, logits)
                self.steps += 1
        except BaseException as e:  # noqa: BLE001 -- every request hears of it
            self.error = e
            for seq in list(self.running) + list(self.waiting):
                seq.sink(Event("", [], f"error: {e}"))
            raise
        finally:
            if self.group is not None:
                self._broadcast(_STOP)

    def _broadcast(self, plan):
        if self.group is None:
            return plan
        box = [plan]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _forward(self, plans: list[dict]) -> torch.Tensor | None:
        """Runs this rank's stages over the step's micro-batches (in flight
        together under pipeline parallelism: while stage s runs micro-batch
        m, stage s - 1 runs m + 1); returns the logits of every due row, in
        order, on global rank 0 (None elsewhere)."""
        model = self.model
        steps = [PagedStep(self.pool, p["slots"], p["groups"]) for p in plans]
        if model.layout.pp_size == 1:
            (plan,) = plans
            ids, positions = plan["ids"][None], plan["positions"][None]
            return model.paged_stage(0, ids, positions, steps[0], plan["rows"])
        stages = ForwardStages(model)
        hidden, dtype = model.config.hidden_size, model._dtype()

        def compute(stage, m, x):
            p = plans[m]
            return model.paged_stage(stage, x, p["positions"][None], steps[m], p["rows"])

        out = stages.step(
            len(plans),
            lambda m: plans[m]["ids"][None],
            compute,
            lambda stage, m: ((len(plans[m]["ids"]), 1, hidden), dtype),
        )
        # The last stage's first tensor-parallel rank sends the logits to
        # global rank 0 (the first stage's), over the pipeline group.
        last = model.stage_owner(model.num_stages - 1)
        lay = model.layout
        logits = torch.cat([out[m] for m in range(len(plans))]) if out else None
        if lay.tp_rank == 0 and last != 0:
            rows = sum(len(p["rows"]) for p in plans)
            if lay.pp_rank == last:
                stages.send("logits", logits.float().contiguous(), 0)
            elif lay.pp_rank == 0:
                logits = stages.recv((rows, model.config.vocab_size), torch.float32, last)
        stages.finish()
        return logits if dist.get_rank() == 0 else None

    def _schedule(self):
        """The next step's plan and its sequences [(seq, start, count)], or
        (None, None) with nothing to run."""
        with self._lock:
            for seq in [s for s in self.running if s.aborted]:
                self._end(seq, Event("", [], "abort"))
            for seq in [s for s in self.waiting if s.aborted]:
                self.waiting.remove(seq)
                self._end(seq, Event("", [], "abort"))
            batch = self._pick()
            while not batch and self.running:
                # Prefills part way hold every block: the latest gives way.
                self._preempt(self.running[-1])
                batch = self._pick()
        if not batch:
            return None, None
        return self._plan(batch), batch

    def _pick(self) -> list:
        budget = self.budget
        batch = []  # (seq, start, count)
        # Decoding sequences first, one token each; one that cannot grow
        # preempts the latest admitted.
        for seq in list(self.running):
            if seq not in self.running or len(seq.all) - seq.computed != 1:
                continue
            while not self.pool.grow(seq.table, seq.computed + 1):
                victim = self.running[-1]
                self._preempt(victim)
                batch = [b for b in batch if b[0] is not victim]
                if victim is seq:
                    break
            if seq in self.running:
                batch.append((seq, seq.computed, 1))
                budget -= 1
        # Then prefill chunks: running ones part way, then new ones.
        candidates = [s for s in self.running if len(s.all) - s.computed > 1]
        while budget > 0:
            if candidates:
                seq = candidates.pop(0)
            elif self.waiting and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
            else:
                break
            count = min(len(seq.all) - seq.computed, budget)
            if not self.pool.grow(seq.table, seq.computed + count):
                break  # it waits for blocks
            if seq not in self.running:
                self.waiting.popleft()
                self.running.append(seq)
            batch.append((seq, seq.computed, count))
            budget -= count
        return batch

    def _plan(self, batch) -> list[dict]:
        """The step's micro-batches (one per pipeline rank at most, the
        sequences split in order, balanced by tokens), each one plan."""
        parts = min(self.model.layout.pp_size, len(batch))
        if parts == 1:
            return [self._micro_plan(batch)]
        total = sum(c for _, _, c in batch)
        plans, part, done = [], [], 0
        for i, item in enumerate(batch):
            part.append(item)
            done += item[2]
            left = len(batch) - i - 1
            need = parts - len(plans) - 1  # parts still to fill after this one
            if need and (done >= total * (len(plans) + 1) / parts or left == need):
                plans.append(self._micro_plan(part))
                part = []
        plans.append(self._micro_plan(part))
        return plans

    def _micro_plan(self, batch) -> dict:
        ids, positions, slots, rows = [], [], [], []
        bs = self.pool.block_size
        for seq, start, count in batch:
            ids += seq.all[start : start + count]
            for p in range(start, start + count):
                positions.append(p)
                slots.append(seq.table[p // bs] * bs + p % bs)
        offsets = list(itertools.accumulate([c for _, _, c in batch], initial=0))[:-1]
        groups, decode = [], [i for i, (_, _, c) in enumerate(batch) if c == 1]
        members = [decode] if decode else []
        members += [[i] for i, (_, _, c) in enumerate(batch) if c > 1]
        for m in members:
            groups.append(
                plan_group(
                    [batch[i][0].table for i in m],
                    [batch[i][1] for i in m],
                    [batch[i][2] for i in m],
                    [offsets[i] for i in m],
                    bs,
                )
            )
        for i, (seq, start, count) in enumerate(batch):
            if start + count == len(seq.all):  # its next token is due
                rows.append(offsets[i] + count - 1)
        return {
            "ids": torch.tensor(ids, dtype=torch.long),
            "positions": torch.tensor(positions, dtype=torch.long),
            "slots": torch.tensor(slots, dtype=torch.long),
            "groups": groups,
            "rows": torch.tensor(rows, dtype=torch.long),
        }

    def _finish_step(self, batch, logits: torch.Tensor) -> None:
        row = 0
        for seq, start, count in batch:
            seq.computed = start + count
            if seq.computed < len(seq.all):
                continue
            token = self._sample(seq, logits[row])
            row += 1
            if seq.aborted:
                continue  # ended at the next schedule
            self._append(seq, token)

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> int:
        p = seq.params
        scores = logits.float()
        if p.temperature <= 0:
            return int(scores.argmax())
        scores = scores / p.temperature
        if p.top_k and p.top_k > 0:
            kth = scores.topk(min(p.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            ordered, order = scores.sort()
            drop = ordered.softmax(-1).cumsum(-1) <= 1 - p.top_p
            drop[-1] = False
            scores = scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
        return int(torch.multinomial(scores.softmax(-1), 1, generator=seq.generator))

    def _append(self, seq: Sequence, token: int) -> None:
        p = seq.params
        seq.tokens.append(token)
        reason = None
        if (token in self.eos and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        elif len(seq.tokens) >= p.max_tokens or len(seq.all) >= self.max_model_len:
            reason = "length"
        kept = seq.tokens[:-1] if reason == "stop" else seq.tokens
        text = self.tokenizer.decode(kept, skip_special_tokens=True) if self.tokenizer else ""
        for s in p.stop:
            at = text.find(s)
            if at >= 0:
                text, reason = text[:at], "stop"
        if reason is None:
            # Hold back an incomplete character and what may begin a stop string.
            hold = len(text) - len(text.rstrip("\ufffd"))
            for s in p.stop:
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        hold = max(hold, k)
                        break
            visible = text[: len(text) - hold]
        else:
            visible = text
        delta = visible[seq.sent :] if len(visible) > seq.sent else ""
        seq.sent = max(seq.sent, len(visible))
        seq.text = text
        event = Event(delta, [token], reason, len(seq.prompt), len(seq.tokens))
        if reason is None:
            seq.sink(event)
        else:
            with self._lock:
                self._end(seq, event)

    def _end(self, seq: Sequence, event: Event) -> None:
        """Frees ``seq``'s blocks and tells its request (under the lock)."""
        if seq in self.running:
            self.running.remove(seq)
        self.pool.release(seq.table)
        event.prompt_tokens, event.completion_tokens = len(seq.prompt), len(seq.tokens)
        seq.sink(event)

    def _preempt(self, seq: Sequence) -> None:
        """Frees a running sequence's blocks; it is recomputed from its
        tokens when there is room again (first in the queue)."""
        self.running.remove(seq)
        self.pool.release(seq.table)
        seq.computed = 0
        self.preemptions += 1
        self.waiting.appendleft(seq)


class QueueFull(RuntimeError):
    """More requests wait than the engine's bound: HTTP 429."""
