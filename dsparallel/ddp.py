"""dsparallel.DistributedDataParallel: torch's DDP, with the reducer in C++.

Changing the import is the whole migration: the constructor takes torch's
arguments, ``module``, ``no_sync()``, ``register_comm_hook`` and the
``state_dict`` keys (``module.`` prefix) are torch's. Gradients are reduced
in fused buckets whose all-reduce is launched the moment the bucket fills,
overlapping the rest of backward (see csrc/ddp/reducer.h).

``zero_stage=2`` (keyword-only; 0 and 1 reduce as above) makes the reducer
reduce-scatter each bucket into this rank's gradient shard instead (ZeRO
stage 2): ``.grad`` is not kept, and ``dsparallel.ZeroRedundancyOptimizer``
steps the shards (see dsparallel/zero.py).

Expert parameters of a mixture-of-experts layer (``dsparallel.moe.MoE``
over an expert-parallel group of ``init_parallel(expert_parallel_size=E)``)
differ between the ranks of one expert-parallel group, so a second reducer
averages them over the expert data-parallel group (the ranks holding the
same experts) instead, scaled by 1/E: each one already sums the gradients of
the E ranks whose tokens it served, so both kinds end up as the mean over
all data-parallel ranks, as in one process on the global batch. (When the
expert-parallel group spans the tensor-parallel ranks, those share one
replica's loss: 1/(E / tp).)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from . import _C
from .comm_hooks import bf16_compress_hook, fp16_compress_hook
from .mixed_precision import MixedPrecision, policy_of
from .mixed_precision import apply as mixed_precision_apply
from .parallel_state import expert_dp_group_of, get_parallel_state
from .zero import ShardedBuffer

_MB = 1024 * 1024
_DEFAULT_FIRST_BUCKET_BYTES = 1 * _MB  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES
_DEFAULT_BUCKET_CAP_MB = 25
_BROADCAST_BUCKET_BYTES = 250 * _MB

# Arguments torch's DDP accepts beyond DESIGN.md's list; passing one with a
# non-default value raises instead of being silently ignored.
_UNSUPPORTED_KWARGS = {
    "init_sync": True,
    "delay_all_reduce_named_params": None,
    "param_to_hook_all_reduce": None,
    "device_mesh": None,
    "skip_all_reduce_unused_params": False,
}


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    """All tensors in a (nested) forward output, for the unused-parameter
    search: torch's pytree walk, which also knows namedtuples, dataclasses
    and any container registered with it (as torch's DDP walks outputs)."""
    return [t for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


class DistributedDataParallel(nn.Module):
    """Data parallelism over a process group; a drop-in for torch's DDP.

    Every rank holds a replica of ``module``; each backward averages the
    gradients across ranks so that the replicas stay identical.

    ``mixed_precision``: a ``dsparallel.MixedPrecision`` the module is put
    under (float32 masters, compute in its ``param_dtype``, gradients
    accumulated in float32 and reduced in its ``reduce_dtype``); a module
    already under one (a model built with ``mixed_precision=``) keeps it.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids=None,
        output_device=None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group=None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        *,
        zero_stage: int = 0,
        overlap_param_gather: bool = False,
        mixed_precision: MixedPrecision | None = None,
        **kwargs,
    ):
        super().__init__()
        for name, value in kwargs.items():
            if name not in _UNSUPPORTED_KWARGS:
                raise TypeError(f"DistributedDataParallel got an unexpected argument {name!r}")
            if value != _UNSUPPORTED_KWARGS[name]:
                raise NotImplementedError(
                    f"dsparallel.DistributedDataParallel does not support {name}={value!r} yet"
                )
        self._check_devices(module, device_ids, output_device)
        if dim != 0:
            raise NotImplementedError(
                "dim != 0 only matters for multi-device modules, "
                "which dsparallel.DistributedDataParallel does not support"
            )
        del check_reduction  # deprecated and ignored by torch as well
        if zero_stage not in (0, 1, 2):
            raise ValueError(
                f"DistributedDataParallel: zero_stage must be 0, 1 or 2, got {zero_stage!r}"
            )
        if zero_stage == 2 and gradient_as_bucket_view:
            raise ValueError(
                "DistributedDataParallel: zero_stage=2 keeps only this rank's shard of each "
                "bucket, so gradient_as_bucket_view=True has no bucket to view"
            )
        if overlap_param_gather and zero_stage != 2:
            raise ValueError(
                "DistributedDataParallel: overlap_param_gather=True needs zero_stage=2 "
                "(the parameters all-gathered after the optimizer step are the DDP's buckets)"
            )
        self.zero_stage = zero_stage
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        if self.process_group is None:
            raise RuntimeError(
                "DistributedDataParallel needs an initialised process group: "
                "call torch.distributed.init_process_group first"
            )
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True

        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError(
                "DistributedDataParallel: mixed_precision must be a dsparallel.MixedPrecision "
                f"(torch DDP's experimental _MixedPrecision is not it), got {mixed_precision!r}"
            )
        if mixed_precision is not None:
            # Before the buckets are laid out: they hold float32 gradients.
            mixed_precision_apply(module, mixed_precision)
        self.mixed_precision = policy_of(module)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module "
                "doesn't have any parameter that requires a gradient."
            )
        self._verify_same_model(named)
        experts = [(n, p) for n, p in named if getattr(p, "_dsp_expert_group", None) is not None]
        named = [(n, p) for n, p in named if getattr(p, "_dsp_expert_group", None) is None]
        self.expert_process_group = (
            expert_dp_group_of(*experts[0], "DistributedDataParallel") if experts else None
        )
        self._sync_module_states([p for _, p in experts])

        cap_mb = _DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        cap = max(1, int(cap_mb * _MB))

        def reducer(params, group, stage):
            return _C.Reducer(
                [p for _, p in params],
                [n for n, _ in params],
                group,
                [min(_DEFAULT_FIRST_BUCKET_BYTES, cap), cap],
                find_unused_parameters,
                gradient_as_bucket_view,
                static_graph,
                zero_stage=stage,
            )

        stage = 2 if zero_stage == 2 else 0
        self.reducer = reducer(named, self.process_group, stage)
        self._expert_reducer = None
        if experts:
            self._expert_reducer = reducer(experts, self.expert_process_group, stage)
            # Each expert's gradient already sums the tokens of the replicas
            # routing to it: their mean is the data-parallel average.
            ep = get_parallel_state().expert_replicas
            self._expert_scale_hooks = [p.register_hook(lambda g: g / ep) for _, p in experts]
        self._zero_buffers = []
        if zero_stage == 2:
            self._zero_buffers = self._shard_buckets(self.reducer, named, self.process_group)
            if experts:
                self._zero_buffers += self._shard_buckets(
                    self._expert_reducer, experts, self.expert_process_group
                )
        if overlap_param_gather:
            self._wait_before_use(named + experts)
        narrow = self.mixed_precision and self.mixed_precision.reduce_dtype != torch.float32
        if narrow:
            self.register_comm_hook(None, _COMPRESS[self.mixed_precision.reduce_dtype])

    # ---------------------------------------------------------------- set-up

    @staticmethod
    def _check_devices(module, device_ids, output_device):
        devices = {p.device for p in module.parameters()}
        if len(devices) > 1:
            raise NotImplementedError(
                f"DistributedDataParallel: the module's parameters span devices {devices}; "
                "multi-device modules are not supported"
            )
        device = next(iter(devices)) if devices else torch.device("cpu")
        if device.type == "cpu" and device_ids:
            raise ValueError(
                f"DistributedDataParallel device_ids must be None for CPU modules, got {device_ids}"
            )
        if device_ids and len(device_ids) > 1:
            raise NotImplementedError("device_ids must hold at most one device")
        if device_ids and torch.device(device_ids[0]) != device:
            raise ValueError(f"device_ids={device_ids} but the module lives on {device}")
        del output_device  # single-device modules: outputs stay where they are

    def _verify_same_model(self, named):
        """Refuses models whose parameters differ across ranks, naming the first one."""
        mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
        world = dist.get_world_size(self.process_group)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine, group=self.process_group)
        ref = everyone[0]
        for rank, theirs in enumerate(everyone):
            if len(theirs) != len(ref):
                raise RuntimeError(
                    f"DistributedDataParallel: rank {rank} has {len(theirs)} parameters that "
                    f"require grad but rank 0 has {len(ref)}: every rank must wrap the same model"
                )
            for (n0, s0, d0), (n1, s1, d1) in zip(ref, theirs):
                if (n0, s0, d0) != (n1, s1, d1):
                    raise RuntimeError(
                        f"DistributedDataParallel: parameter {n1!r} is {d1}{list(s1)} on rank "
                        f"{rank} but parameter {n0!r} is {d0}{list(s0)} on rank 0: every rank "
                        "must wrap the same model"
                    )

    def _sync_module_states(self, experts: list[torch.Tensor]):
        """Parameters and buffers start as rank 0's; expert parameters as
        those of the first rank holding the same experts."""
        expert_ids = {id(p) for p in experts}
        tensors = [p.detach() for p in self.module.parameters() if id(p) not in expert_ids]
        tensors += [b.detach() for b in self.module.buffers()]
        if tensors and dist.get_world_size(self.process_group) > 1:
            dist._broadcast_coalesced(self.process_group, tensors, _BROADCAST_BUCKET_BYTES, 0)
        if experts and dist.get_world_size(self.expert_process_group) > 1:
            src = dist.get_global_rank(self.expert_process_group, 0)
            for p in experts:
                dist.broadcast(p.detach(), src, group=self.expert_process_group)

    @staticmethod
    def _shard_buckets(reducer, named, group) -> list[ShardedBuffer]:
        """ZeRO stage 2: the parameters of each bucket become views into one
        flat buffer laid out like the bucket, whose slices the reducer's
        gradient shards match; ZeroRedundancyOptimizer finds them on the
        parameters and steps them."""
        params = [p for _, p in named]
        buffers = []
        for members, offsets, padded, shard in zip(
            reducer.bucket_indices(),
            reducer.bucket_offsets(),
            reducer.padded_numels(),
            reducer.grad_shards(),
        ):
            ps = [params[i] for i in members]
            buffer = ShardedBuffer(ps, offsets, padded, group, shard, reducer, members)
            for p in ps:
                p._dsp_zero_buffer = buffer
            buffers.append(buffer)
        return buffers

    def _wait_before_use(self, named) -> None:
        """overlap_param_gather: the optimizer step leaves each bucket's
        all-gather running, and a module waits for the buckets of its own
        parameters just before it runs, so the gathers of later layers
        overlap the forward of earlier ones. (A module that uses another
        module's parameter before that module runs would read it stale: such
        models keep the default.)"""
        for b in self._zero_buffers:
            b.overlap_gather = True
        buffer_of = {id(p): p._dsp_zero_buffer for _, p in named}
        for module in self.module.modules():
            own = [buffer_of[id(p)] for p in module.parameters(recurse=False) if id(p) in buffer_of]
            if own:
                # prepend: before a mixed-precision cast reads the parameters.
                waiter = _waiter(list({id(b): b for b in own}.values()))
                module.register_forward_pre_hook(waiter, prepend=True)

    def wait_param_gather(self) -> None:
        """With overlap_param_gather, the parameters hold the last step's
        values only once this returns (or the next forward has run): call it
        before reading them another way (a checkpoint, an evaluation that
        does not go through this module's forward)."""
        for b in self._zero_buffers:
            b.wait_gather()

    # ---------------------------------------------------------------- training

    def forward(self, *inputs, **kwargs):
        if self.broadcast_buffers and self.require_forward_param_sync:
            buffers = [b.detach() for b in self.module.buffers()]
            if buffers and dist.get_world_size(self.process_group) > 1:
                dist._broadcast_coalesced(self.process_group, buffers, _BROADCAST_BUCKET_BYTES, 0)
        output = self.module(*inputs, **kwargs)
        if self._zero_buffers and torch.is_grad_enabled():
            if all(b.owner is None for b in self._zero_buffers):
                raise RuntimeError(
                    "DistributedDataParallel(zero_stage=2) keeps only this rank's shard of each "
                    "gradient (no .grad): step it with dsparallel.ZeroRedundancyOptimizer("
                    "model.parameters(), ...), created before the first forward"
                )
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.prepare_for_backward(_tensors_in(output) if self.find_unused_parameters else [])
        return output

    def prepare_for_backward(self, outputs: list[torch.Tensor]) -> None:
        """Arms the reducers for the next backward (``forward`` does this;
        the pipeline runtime, which runs forwards under ``no_sync``, calls it
        before a stage's last backward)."""
        self.reducer.prepare_for_backward(outputs)
        if self._expert_reducer is not None:
            self._expert_reducer.prepare_for_backward(outputs)

    @contextmanager
    def no_sync(self):
        """Gradients accumulate locally inside; the first backward after syncs them."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook) -> None:
        """``hook(state, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]``.

        Called for each bucket instead of the built-in averaging all-reduce; the
        future's tensor replaces the bucket. Torch's hooks and
        ``dsparallel.comm_hooks`` both fit. Call before the first forward.
        """
        if not callable(hook):
            raise TypeError("register_comm_hook: hook must be callable")
        dtype = _compress_dtype(hook)
        if self.zero_stage == 2 and dtype is not None:
            if state not in (None, self.process_group):
                raise ValueError(
                    "register_comm_hook: under zero_stage=2 a compress hook reduces over the "
                    "DDP's own process group; pass it (or None) as the state"
                )
            # The same compression, under reduce-scatter: buckets travel in
            # the narrow format and each rank adds its slice into its shard.
            self.reducer.set_reduce_dtype(dtype)
            if self._expert_reducer is not None:
                self._expert_reducer.set_reduce_dtype(dtype)
            return
        self.reducer.register_comm_hook(state, hook)
        if self._expert_reducer is not None:
            # The same hook for the expert buckets, over their own group
            # where the state is the group (torch's and our hooks).
            if state is None or state is self.process_group:
                state = self.expert_process_group
            self._expert_reducer.register_comm_hook(state, hook)

    def bucket_indices(self) -> list[list[int]]:
        """Parameter indices per bucket, in launch order (of the parameters
        that are not experts')."""
        return self.reducer.bucket_indices()


DDP = DistributedDataParallel


def _waiter(buffers):
    def wait(_module, _inputs):
        for b in buffers:
            b.wait_gather()

    return wait


# Our compress hook per dtype: a policy's reduce_dtype, and what a hook
# passed to register_comm_hook reduces in.
_COMPRESS = {torch.bfloat16: bf16_compress_hook, torch.float16: fp16_compress_hook}


def _compress_dtype(hook) -> torch.dtype | None:
    """The dtype a known compress hook (ours or torch's) reduces in."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    known = {ours: dtype for dtype, ours in _COMPRESS.items()}
    known[default_hooks.bf16_compress_hook] = torch.bfloat16
    known[default_hooks.fp16_compress_hook] = torch.float16
    return known.get(hook)
