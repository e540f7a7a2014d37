"""The DP x PP x TP layout of a hybrid job on one DeviceMesh.

Ranks are laid out as a (pp, dp, tp) mesh in row-major order, so the ranks of
one tensor-parallel group are adjacent (``torchrun`` gives a host adjacent
ranks, and tensor parallelism, which communicates in every layer, stays on a
host); data-parallel replicas of one stage come next and pipeline stages are
furthest apart.

With ``context_parallel_size=C`` the mesh is (pp, dp, cp, tp): C adjacent
groups of tensor-parallel ranks hold different parts of the same sequences
(``dsparallel.context_parallel``). They hold the same parameters, so
gradients are reduced over dp x cp: ``dp_cp_group`` (the data-parallel
group itself when C is 1), which DDP and ZeRO take.

With ``expert_parallel_size=E`` the data-parallel dimension (dp x cp with
context parallelism: for the experts, whose tokens are any tokens, cp ranks
are data-parallel ranks) is also read as (edp, ep): E consecutive such
ranks form an expert-parallel group (they split the routed experts of a
mixture-of-experts layer between them), and the ranks at the same place in
each such group form the expert data-parallel group, over which expert
gradients are reduced (as Megatron and DeepSpeed lay them out, Megatron
also across cp). The tensor-parallel ranks then hold the same experts.

With ``experts_over_tp=True`` the expert-parallel group also spans the
tensor-parallel ranks (Megatron's expert parallelism folded over tp, with
an expert tensor-parallel size of 1): E = tp x E' ranks, E' consecutive
dp x cp ranks times their tp groups, split the routed experts, so no expert
is replicated over tp and no expert gradient is reduced over it. The
models then route each tensor-parallel rank's own part of the tokens
(under sequence parallelism its part of the sequence; without it, its
share of the rows it holds).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .tensor_parallel.group import set_default_group

_state: ParallelState | None = None
_we_initialised = False


@dataclass(frozen=True)
class ParallelState:
    """The layout ``init_parallel`` made, seen from this rank (Megatron's
    ``mpu`` as one object): for each parallelism its process group, this
    rank's place in it and its size.

    - ``mesh``: the DeviceMesh over [pp, dp, (cp,) tp] (its dimensions named
      so), for DTensor and FSDP2;
    - ``tp_group``, ``tp_rank``, ``tp_size``: tensor parallelism;
    - ``pp_group``, ``pp_rank``, ``pp_size``: the pipeline (stage order);
    - ``dp_group``, ``dp_rank``, ``dp_size``: the replicas that read
      different batches (expert parallelism runs inside them);
    - ``ep_group``, ``ep_rank``, ``ep_size``: expert parallelism (the group
      None at size 1); ``expert_dp_group``: the replicas of this rank's
      experts, which average their gradients; ``experts_over_tp``: the
      expert-parallel group spans the tensor-parallel ranks;
    - ``cp_group``, ``cp_rank``, ``cp_size``: context parallelism (the group
      None at size 1); ``dp_cp_group``: the ranks whose gradients are
      averaged (dp x cp; ``dp_group`` when cp is 1).

    The ranks of one tp, pp and cp group see the same batch."""

    mesh: DeviceMesh
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    ep_group: dist.ProcessGroup | None = None  # None when expert_parallel_size is 1
    expert_dp_group: dist.ProcessGroup | None = None  # dp_group when it is 1
    ep_rank: int = 0
    ep_size: int = 1
    cp_group: dist.ProcessGroup | None = None  # None when context_parallel_size is 1
    dp_cp_group: dist.ProcessGroup | None = None  # gradients' group; dp_group when cp is 1
    cp_rank: int = 0
    cp_size: int = 1
    experts_over_tp: bool = False  # the ep group spans the tp ranks

    @property
    def expert_replicas(self) -> int:
        """How many data-parallel replicas (each with its own loss) send
        tokens to this rank's experts: the expert-parallel size, over the
        tensor-parallel size when the group spans the tp ranks (which share
        one replica's loss)."""
        return self.ep_size // self.tp_size if self.experts_over_tp else self.ep_size

    def __repr__(self) -> str:
        return (
            f"ParallelState(rank {dist.get_rank()}: tp {self.tp_rank}/{self.tp_size}, "
            f"pp {self.pp_rank}/{self.pp_size}, dp {self.dp_rank}/{self.dp_size}, "
            f"ep {self.ep_rank}/{self.ep_size}, cp {self.cp_rank}/{self.cp_size})"
        )


def init_parallel(
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    backend: str | None = None,
    *,
    expert_parallel_size: int = 1,
    context_parallel_size: int = 1,
    experts_over_tp: bool = False,
) -> ParallelState:
    """Builds the layout (initialising torch.distributed with ``backend``, by
    default "dsp" for CPU and "cpu:dsp,cuda:nccl" with CUDA, if not done yet)
    and makes its tensor-parallel group the default of the tensor-parallel
    layers.

    ``expert_parallel_size`` is the number of ranks the routed experts are
    split over: carved out of the data-parallel (x context-parallel) ranks,
    or with ``experts_over_tp`` a multiple of the tensor-parallel size whose
    groups span the tp ranks (see the module docstring)."""
    global _state, _we_initialised
    if _state is not None:
        raise RuntimeError("init_parallel was already called; call destroy_parallel first")
    for name, value in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("pipeline_parallel_size", pipeline_parallel_size),
        ("expert_parallel_size", expert_parallel_size),
        ("context_parallel_size", context_parallel_size),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"init_parallel: {name} must be a positive integer, got {value!r}")
    if not dist.is_initialized():
        if backend is None:
            backend = "cpu:dsp,cuda:nccl" if torch.cuda.is_available() else "dsp"
        dist.init_process_group(backend)
        _we_initialised = True
    world = dist.get_world_size()
    tp, pp, cp = tensor_parallel_size, pipeline_parallel_size, context_parallel_size
    if world % (tp * pp * cp):
        raise ValueError(
            f"init_parallel: world size {world} is not divisible by tensor_parallel_size "
            f"({tp}) x pipeline_parallel_size ({pp}) x context_parallel_size ({cp}) = "
            f"{tp * pp * cp}"
        )
    dp = world // (tp * pp * cp)
    ep = expert_parallel_size
    if not isinstance(experts_over_tp, bool):
        raise ValueError(f"init_parallel: experts_over_tp must be a bool, got {experts_over_tp!r}")
    if experts_over_tp and (ep % tp or (dp * cp) % (ep // tp)):
        raise ValueError(
            f"init_parallel: with experts_over_tp, expert_parallel_size ({ep}) must be the "
            f"tensor-parallel size ({tp}) times a divisor of the data-parallel x "
            f"context-parallel size ({dp} x {cp} = {dp * cp}): the expert-parallel group spans "
            "whole tensor-parallel groups"
        )
    if not experts_over_tp and (dp * cp) % ep:
        if cp == 1:
            over = f"data-parallel size ({dp} = world {world} / (tp {tp} x pp {pp}))"
        else:
            over = (
                f"data-parallel x context-parallel size ({dp} x {cp} = {dp * cp}; dp = world "
                f"{world} / (tp {tp} x pp {pp} x cp {cp}))"
            )
        fold = ""
        if tp > 1 and ep % tp == 0 and (dp * cp) % (ep // tp) == 0:
            fold = " (or pass experts_over_tp=True to split the experts over the tp ranks too)"
        raise ValueError(
            f"init_parallel: expert_parallel_size ({ep}) must divide the {over}: "
            f"expert-parallel groups are carved out of those ranks{fold}"
        )
    device = "cuda" if torch.cuda.is_available() and dist.get_backend() != "dsp" else "cpu"
    if cp == 1:
        mesh = init_device_mesh(device, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    else:
        mesh = init_device_mesh(device, (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    _state = ParallelState(
        mesh=mesh,
        tp_group=mesh.get_group("tp"),
        pp_group=mesh.get_group("pp"),
        dp_group=mesh.get_group("dp"),
        tp_rank=mesh.get_local_rank("tp"),
        pp_rank=mesh.get_local_rank("pp"),
        dp_rank=mesh.get_local_rank("dp"),
        tp_size=tp,
        pp_size=pp,
        dp_size=dp,
        expert_dp_group=mesh.get_group("dp"),
        dp_cp_group=mesh.get_group("dp"),
    )
    if cp > 1:
        # The same (pp, tp) place's dp x cp ranks, as one dimension.
        flat = init_device_mesh(device, (pp, dp * cp, tp), mesh_dim_names=("pp", "dp_cp", "tp"))
        _state = dataclasses.replace(
            _state,
            cp_group=mesh.get_group("cp"),
            cp_rank=mesh.get_local_rank("cp"),
            cp_size=cp,
            dp_cp_group=flat.get_group("dp_cp"),
        )
    if experts_over_tp and ep > 1:
        # (pp, edp, ep' x tp): the ep group is ep' consecutive dp x cp ranks'
        # tp groups, the edp group the ranks at the same place in each.
        experts = init_device_mesh(
            device, (pp, dp * cp * tp // ep, ep), mesh_dim_names=("pp", "edp", "ep")
        )
        _state = dataclasses.replace(
            _state,
            ep_group=experts.get_group("ep"),
            expert_dp_group=experts.get_group("edp"),
            ep_rank=experts.get_local_rank("ep"),
            ep_size=ep,
            experts_over_tp=True,
        )
    elif ep > 1:
        experts = init_device_mesh(
            device, (pp, dp * cp // ep, ep, tp), mesh_dim_names=("pp", "edp", "ep", "tp")
        )
        _state = dataclasses.replace(
            _state,
            ep_group=experts.get_group("ep"),
            expert_dp_group=experts.get_group("edp"),
            ep_rank=experts.get_local_rank("ep"),
            ep_size=ep,
        )
    set_default_group(_state.tp_group)
    return _state


def expert_dp_group_of(name: str, p: torch.Tensor, who: str) -> dist.ProcessGroup:
    """The group that reduces (and shards) the expert parameter ``p``: the
    ranks holding the same experts, which init_parallel's layout provides."""
    group = p._dsp_expert_group
    if (
        _state is None
        or _state.ep_group is None
        or (_state.ep_group.group_name != group.group_name)
    ):
        raise ValueError(
            f"{who}: parameter {name!r} belongs to experts split over an expert-parallel group "
            "that is not init_parallel's: build the layout with "
            "dsparallel.init_parallel(expert_parallel_size=E) and the MoE layers with its "
            "ep_group, so that expert parameters can be reduced over the ranks holding the "
            "same experts"
        )
    return _state.expert_dp_group


def get_parallel_state() -> ParallelState:
    """The ``ParallelState`` of the last ``init_parallel`` (an error before
    it)."""
    if _state is None:
        raise RuntimeError("call dsparallel.init_parallel() first")
    return _state


def parallel_state_or_none() -> ParallelState | None:
    """The layout ``init_parallel`` made, or None before it."""
    return _state


def destroy_parallel() -> None:
    """Forgets the layout (and destroys the default process group if
    ``init_parallel`` created it)."""
    global _state, _we_initialised
    set_default_group(None)
    _state = None
    if _we_initialised and dist.is_initialized():
        dist.destroy_process_group()
    _we_initialised = False
