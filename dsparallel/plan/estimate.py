"""``estimate(model, layout, cluster, global_batch, seq_len)``: per rank,
the memory by kind, the communication bytes of a step by kind, and the
step time split into compute, exposed communication, pipeline bubble and
the optimizer's step.

Time model. Each pipeline stage's forward, input-gradient and
weight-gradient costs per micro-batch are its FLOPs over the device's
FLOP/s, its eager ops times the per-op overhead, and the collectives on
its critical path (alpha-beta, ring algorithms: an all-reduce takes
2(n-1) alpha + 2(n-1)/n M / beta, an all-gather, reduce-scatter or
all-to-all half of that; a transfer alpha + M / beta): tensor
parallelism's two all-reduces per layer each way, context parallelism's
ring transfers or Ulysses' all-to-alls, expert parallelism's dispatch and
combine, the pipeline's transfers. dsparallel's collectives run on the
ranks' own threads (on one host: shared-memory copies), so none of them is
taken as hidden. The schedule's C++ simulation turns those costs into the
time of the pipeline (``makespan``), whose idle part is the bubble. The
gradients' reduction over the replicas (all-reduce, or reduce-scatter and
all-gather under ZeRO) and AdamW's step follow.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..models.gpt import stage_blocks
from .activations import activation_bytes, schedule_of, stage_bytes
from .cluster import Cluster, read_cluster
from .flops import OPS, head_flops, layer_flops, layer_ops, model_flops_per_token
from .layout import Layout
from .memory import model_state
from .model import Model, rank_tensors, read_model
from .shared_cores import step_time

KINDS = ("dp", "tp", "pp", "ep", "cp")


@dataclass
class Estimate:
    layout: Layout
    # Bytes on the most loaded rank: params, grads, optimizer, activations, total.
    memory: dict = field(default_factory=dict)
    # Bytes one rank sends and receives per step, by kind.
    comm_bytes: dict = field(default_factory=dict)
    # Seconds per step: compute, comm (exposed), bubble, optimizer, total.
    time: dict = field(default_factory=dict)
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    fits: bool = True

    def row(self) -> dict:
        return {
            "layout": dataclasses.asdict(self.layout),
            "memory": self.memory,
            "comm_bytes": self.comm_bytes,
            "time": self.time,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "fits": self.fits,
        }


class _Links:
    """Alpha-beta times of a collective over a group of the mesh (pp, dp,
    cp, tp), tp fastest: a group whose ranks lie on one host uses the
    host's links, else the links between hosts."""

    def __init__(self, cluster: Cluster, lay: Layout):
        self.c, self.lay = cluster, lay

    def _ab(self, stride: int, size: int) -> tuple[float, float]:
        if stride * size <= self.c.devices_per_host:
            return self.c.intra_latency, self.c.intra_bandwidth
        return self.c.inter_latency, self.c.inter_bandwidth

    def all_reduce(self, nbytes: float, stride: int, n: int) -> float:
        if n == 1:
            return 0.0
        a, b = self._ab(stride, n)
        return 2 * (n - 1) * a + 2 * (n - 1) / n * nbytes / b

    def gather(self, nbytes: float, stride: int, n: int) -> float:
        """An all-gather, reduce-scatter or all-to-all of ``nbytes`` in all."""
        if n == 1:
            return 0.0
        a, b = self._ab(stride, n)
        return (n - 1) * a + (n - 1) / n * nbytes / b

    def transfer(self, nbytes: float, stride: int, n: int) -> float:
        a, b = self._ab(stride, n)
        return a + nbytes / b


def _check(m: Model, lay: Layout, cluster: Cluster, global_batch: int, seq: int) -> None:
    lay.check(cluster.devices)
    if lay.micro_batch * lay.micro_batches * lay.dp != global_batch:
        raise ValueError(
            f"plan: micro_batch {lay.micro_batch} x micro_batches {lay.micro_batches} x dp "
            f"{lay.dp} = {lay.micro_batch * lay.micro_batches * lay.dp} sequences, not the "
            f"global batch {global_batch}"
        )
    if m.heads % lay.tp:
        raise ValueError(f"plan: {m.heads} attention heads are not divisible by tp {lay.tp}")
    if seq % (2 * lay.cp):
        raise ValueError(f"plan: seq_len {seq} is not a multiple of 2 x cp = {2 * lay.cp}")
    if lay.sequence_parallel and (seq // lay.cp) % lay.tp:
        raise ValueError(f"plan: sequence parallelism splits {seq // lay.cp} tokens over tp")
    if m.layers < lay.num_stages:
        raise ValueError(f"plan: {m.layers} layers cannot fill {lay.num_stages} stages")
    if lay.pp > 1 and lay.schedule in ("interleaved_1f1b", "zb1p") and lay.per_rank > 1:
        if lay.micro_batches % lay.pp:
            raise ValueError(f"plan: {lay.schedule} needs micro_batches a multiple of pp {lay.pp}")
    experts = m.get("n_routed_experts") if m.kind == "deepseek_v3" else None
    if m.kind == "gpt":
        experts = m.config.moe_experts or None
    if lay.ep > 1 and not experts:
        raise ValueError("plan: expert parallelism needs a mixture-of-experts model")
    if experts and experts % lay.ep:
        raise ValueError(f"plan: {experts} experts are not divisible by ep {lay.ep}")
    if lay.cp_mode == "ulysses" and lay.cp > 1 and (m.heads // lay.tp) % lay.cp:
        raise ValueError(f"plan: Ulysses splits {m.heads // lay.tp} heads per rank over cp")
    rank_tensors(m, lay.tp, lay.num_stages, lay.ep, 0)  # raises on shapes that do not split


def _moe(m: Model, index: int) -> bool:
    if m.kind == "gpt":
        return bool(m.config.moe_experts)
    return m.kind == "deepseek_v3" and index >= m.get("first_k_dense_replace", 0)


def _stage_costs(m, lay, cluster, links, stage, seq, comm):
    """(forward, input gradient, weight gradient) seconds of one micro-batch
    on ``stage``; adds the stage's bytes to ``comm``."""
    t, c, e = lay.tp, lay.cp, lay.ep
    db = lay.dtype_bytes
    local = seq / c
    tokens = lay.micro_batch * local
    h = m.hidden
    act = tokens * h * db  # one hidden state of this rank's tokens
    fwd_compute = fwd_comm = bwd_comm = 0.0
    ops = 0
    # A layer's matmuls are [tokens, h] x [h, ~h / t]: their size sets the
    # FLOP/s they reach.
    rate = cluster.flops_at((tokens * h * h / t) ** (1 / 3))
    for i in stage_blocks(m.layers, stage, lay.num_stages):
        fwd_compute += tokens * layer_flops(m, lay, i, seq) / rate
        ops += layer_ops(m, i, lay)
        # Tensor parallelism: two all-reduces forward, two backward (under
        # sp an all-gather and a reduce-scatter each: the same time).
        if t > 1:
            ar = links.all_reduce(act, 1, t)
            fwd_comm += 2 * ar
            bwd_comm += 2 * ar
            comm["tp"] += 4 * 2 * (t - 1) / t * act
        if c > 1:
            if lay.cp_mode == "ring":
                kv = _kv_bytes(m, lay, tokens)
                hop = links.transfer(kv, t, c)
                fwd_comm += (c - 1) * hop
                bwd_comm += (2 * c - 1) * hop  # keys and values on, gradients back
                comm["cp"] += (3 * c - 2) * kv
            else:
                a2a = links.gather(act / t * c, t, c)
                fwd_comm += 4 * a2a
                bwd_comm += 4 * a2a
                comm["cp"] += 8 * (c - 1) / c * act / t * c
        if _moe(m, i):
            k = m.config.moe_top_k if m.kind == "gpt" else m.get("num_experts_per_tok")
            # Each rank dispatches its own tokens: 1/t of them when they are
            # split over tp (sequence parallelism, or the experts over tp,
            # whose group then has stride 1).
            split = t if lay.tokens_split_for_experts else 1
            rows = k * act / split
            if e > 1:
                a2a = links.gather(rows, 1 if lay.experts_over_tp else t, e)
                fwd_comm += 2 * a2a
                bwd_comm += 2 * a2a
                comm["ep"] += 4 * (e - 1) / e * rows
            if lay.experts_over_tp and not lay.sequence_parallel and t > 1:
                # The routed rows gathered back over tp (forward), the
                # split's gradient gathered (backward).
                ag = links.gather(act, 1, t)
                fwd_comm += ag
                bwd_comm += ag
                comm["tp"] += 2 * (t - 1) / t * act
    if stage == lay.num_stages - 1:
        fwd_compute += tokens * head_flops(m, lay) / rate
        ops += OPS["head"]
    if cluster.memory_bandwidth:
        # Elementwise work moves the activations: each saved byte written
        # forward and read backward, and as much again for the gradients.
        moved = 2 * stage_bytes(m, lay, stage, lay.micro_batch, seq)
        if c > 1:
            # Ring attention merges each step's partial output into the
            # running one (a dozen float32 passes over the output forward,
            # a few backward); Ulysses reorders what its all-to-alls move.
            layers = len(stage_blocks(m.layers, stage, lay.num_stages))
            passes = 18 * c if lay.cp_mode == "ring" else 8
            moved += layers * passes * tokens * h / t * 4
        fwd_compute += moved / cluster.memory_bandwidth
    if stage == 0 and t > 1:  # the vocabulary-parallel embedding's all-reduce
        fwd_comm += links.all_reduce(act, 1, t)
        comm["tp"] += 2 * (t - 1) / t * act
    if lay.pp > 1:
        stride = t * c * lay.dp
        hop = links.transfer(act, stride, lay.pp)
        fwd_comm += hop
        bwd_comm += hop
        comm["pp"] += 2 * act
    overhead = ops * cluster.op_overhead
    if cluster.async_launch:  # launches overlap the kernels
        work = max(fwd_compute, overhead)
    else:
        work = fwd_compute + overhead
    forward = work + fwd_comm
    # Backward: the input and the weight gradients, a forward's work each;
    # recomputation runs the forward again first.
    redo = forward if lay.recompute else 0.0
    return forward, redo + work + bwd_comm, work


def _kv_bytes(m: Model, lay: Layout, tokens: float) -> float:
    """One ring step's key and value block on a rank."""
    db = lay.dtype_bytes
    if m.kind == "gpt":
        return 2 * tokens * m.hidden / lay.tp * db
    if m.kind == "llama":
        kv = m.get("num_key_value_heads", m.heads)
        d = m.get("head_dim") or m.hidden // m.heads
        return 2 * tokens * max(1, kv // lay.tp) * d * db
    qk = m.get("qk_nope_head_dim") + m.get("qk_rope_head_dim")
    return 2 * tokens * m.heads // lay.tp * qk * db


def estimate(
    model,
    layout: Layout,
    cluster,
    global_batch: int,
    seq_len: int,
    margin: float = 0.9,
    time_if_unfit: bool = True,
) -> Estimate:
    """The prediction for one layout (see the module docstring). ``margin``:
    the share of a device's memory a plan may fill; ``time_if_unfit=False``
    leaves the time out of a layout that does not fit (a search's
    shortcut)."""
    m = read_model(model)
    cluster = read_cluster(cluster)
    lay = layout
    _check(m, lay, cluster, global_batch, seq_len)
    links = _Links(cluster, lay)
    comm = dict.fromkeys(KINDS, 0.0)

    # Memory: the most loaded pipeline rank (its first dp, cp place).
    worst = None
    for r in range(lay.pp):
        state = model_state(m, lay, r)
        act = activation_bytes(m, lay, r, seq_len)
        total = state.total + act
        if worst is None or total > worst["total"]:
            worst = {
                "params": state.params,
                "grads": state.grads,
                "optimizer": state.optimizer,
                "activations": act,
                "total": total,
                "pp_rank": r,
            }

    fits = worst["total"] <= margin * cluster.memory_bytes
    if not (fits or time_if_unfit):
        return Estimate(lay, worst, comm, {}, 0.0, 0.0, False)

    # The pipeline: per-stage costs through the schedule's simulation.
    costs = [_stage_costs(m, lay, cluster, links, s, seq_len, comm) for s in range(lay.num_stages)]
    # comm holds one micro-batch of every stage; a rank runs its own stages'.
    per_rank_stages = lay.per_rank
    for k in ("tp", "cp", "ep", "pp"):
        comm[k] *= lay.micro_batches * per_rank_stages / lay.num_stages
    us = 1e6
    schedule = None
    if lay.pp == 1 and lay.per_rank == 1:
        f, i, w = costs[0]
        pipeline = lay.micro_batches * (f + i + w)
        busy = pipeline
    else:
        schedule = schedule_of(lay.schedule, lay.num_stages, lay.micro_batches, lay.per_rank)
        ints = [
            (
                max(1, round(f * us)),
                max(1, round((i + w) * us)),
                max(1, round(i * us)),
                max(1, round(w * us)),
            )
            for f, i, w in costs
        ]
        stats = schedule.validate(ints)
        pipeline = stats.makespan / us
        busy = pipeline * (1 - stats.bubble)
    # Exposed communication inside the pipeline: the collectives' share of
    # the busy time (they are part of the stage costs).
    # The busiest rank's compute without communication: a stage's weight
    # gradient is a forward's work, and each micro-batch runs three of them
    # (forward, input and weight gradients), four with recomputation.
    passes = 4 if lay.recompute else 3
    pure = lay.micro_batches * max(
        sum(passes * costs[s][2] for s in lay.stages_of(r)) for r in range(lay.pp)
    )
    exposed_inside = max(0.0, busy - pure)

    # Gradients over the replicas, then the optimizer.
    dense = [
        t
        for s in lay.stages_of(worst["pp_rank"])
        for t in rank_tensors(m, lay.tp, lay.num_stages, lay.ep, s)
    ]
    grad_bytes = sum(t.numel for t in dense if not t.expert) * lay.dtype_bytes
    expert_bytes = sum(t.numel for t in dense if t.expert) * lay.dtype_bytes
    replicas = lay.dp * lay.cp
    grads_time = 0.0
    for nbytes, n in ((grad_bytes, replicas), (expert_bytes, replicas // lay.expert_split)):
        if n > 1 and nbytes:
            # Stage 0 and 1: our DDP all-reduces the gradients; stage 2
            # reduce-scatters them. ZeRO then all-gathers the parameters.
            if lay.zero < 2:
                grads_time += links.all_reduce(nbytes, lay.tp, n)
                comm["dp"] += 2 * (n - 1) / n * nbytes
            else:
                grads_time += links.gather(nbytes, lay.tp, n)
                comm["dp"] += (n - 1) / n * nbytes
            if lay.zero:
                grads_time += links.gather(nbytes, lay.tp, n)
                comm["dp"] += (n - 1) / n * nbytes
    params_here = sum(t.numel for t in dense)
    if lay.zero:
        params_here = sum(t.numel for t in dense if not t.expert) / replicas + sum(
            t.numel for t in dense if t.expert
        ) / max(1, replicas // lay.expert_split)
    optimizer = params_here * cluster.optimizer_per_param

    total = pipeline + grads_time + optimizer
    bubble = max(0.0, pipeline - busy)
    sharing = 0.0
    cores = cluster.cores_per_host
    if cores and cluster.devices_per_host > cores:
        # More ranks than cores: they take turns on the cores (shared_cores).
        total = step_time(
            schedule, lay, costs, grads_time + optimizer, cores, cluster.devices_per_host
        )
        sharing = total - (pure + exposed_inside + grads_time + bubble + optimizer)
        if sharing < 0:  # a rank waiting in the bubble lent its core
            bubble = max(0.0, bubble + sharing)
    time = {
        "compute": pure,
        "comm": exposed_inside + grads_time,
        "bubble": bubble,
        "optimizer": optimizer,
        "sharing": max(0.0, sharing),  # ranks waiting for a core (more ranks than cores)
        "total": total,
    }
    tokens = global_batch * seq_len
    tokens_per_s = tokens / total
    mfu = tokens_per_s * model_flops_per_token(m, seq_len) / (cluster.devices * cluster.flops)
    return Estimate(lay, worst, comm, time, tokens_per_s, mfu, fits)
