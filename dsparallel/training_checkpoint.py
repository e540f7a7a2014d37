"""Training checkpoints that any layout loads: ``save_checkpoint(path, model,
optimizer)`` at one tensor x pipeline x data (x expert) parallel layout and
ZeRO stage, ``load_checkpoint(path, model, optimizer)`` at any other.

The checkpoint is ``torch.distributed.checkpoint`` state keyed by the
Hugging Face tensor names and their global offsets, never by rank: each
rank offers the blocks of checkpoint tensors its parameters are made of
(the model's ``checkpoint_map``, the one mapping ``from_pretrained`` and
``save_pretrained`` read), a block split over tensor parallelism as a
DTensor sharded on the tensor-parallel mesh dimension, a whole one as a
plain tensor (replicas are written once: DCP keeps one of each). Loading
asks for the blocks of the new layout, and DCP reads what overlaps them.

The optimizer's per-element state (Adam's moments) has its parameter's
shape, so it is cut by the same map, under ``optim.<name>.<state>``;
``optim.<name>.param_step`` is the step count of the parameter it is part
of (``optim.step`` the largest). Each rank's CPU random generator state is
saved (``rng.cpu.<rank>``) and restored by a run of the same world size.
A half-precision parameter that a ``ZeroRedundancyOptimizer`` steps
through an fp32 master copy has that copy saved too
(``optim.<name>.master``), so that a resumed run continues from the
masters, not from the rounded parameters. A ``ZeroRedundancyOptimizer``
first gathers each parameter's state from the slices of its data-parallel
group (so a rank holds its parameters' whole state while saving or
loading, not only its slice: the price of a layout-free format, paid at
checkpoint time only). Hyperparameters (learning rate, schedules) are the
caller's: they come from the optimizer built for the new run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .models.agreement import publish, raise_if_any_failed, staging_path
from .models.hf_map import Piece, materialize, split
from .zero import MASTER, ZeroRedundancyOptimizer

STEP = "param_step"  # optim.<name>.param_step: a parameter's own step count


def _rng_key() -> str:
    """This rank's CPU generator state: restored at the same world size."""
    return f"rng.cpu.{dist.get_rank() if dist.is_initialized() else 0}"


def _unwrap(model):
    inner = getattr(model, "module", model)
    if not hasattr(inner, "checkpoint_map"):
        raise TypeError(
            f"save_checkpoint/load_checkpoint take a dsparallel.models model (Llama, "
            f"DeepseekV3), optionally wrapped in DistributedDataParallel; got "
            f"{type(inner).__name__}"
        )
    return inner


def _wrap(model, piece: Piece, block: torch.Tensor):
    """The block as DCP should see it: a DTensor when it is this rank's
    share of a tensor split over tensor parallelism."""
    from torch.distributed.tensor import DTensor, Shard  # 0.5 s: only when used

    lay = model.layout
    if piece.dim is None or lay.tp_size == 1:
        return block
    if piece.length * lay.tp_size != piece.shape[piece.dim] or (
        piece.start != lay.tp_rank * piece.length
    ):
        raise AssertionError(f"{piece.key}: a block that is not an even tensor-parallel share")
    stride = torch.empty(piece.shape, device="meta").stride()
    return DTensor.from_local(
        block.contiguous(),
        lay.mesh["tp"],
        [Shard(piece.dim)],
        run_check=False,
        shape=torch.Size(piece.shape),
        stride=stride,
    )


def _param_states(model, optimizer) -> dict[torch.Tensor, dict]:
    if optimizer is None:
        return {}
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.param_states()
    return {p: dict(s) for p, s in optimizer.state.items()}


def _entries(model):
    """(name, node, parameter or buffer) of everything the checkpoint holds."""
    return [(name, node, model._tensor(name)) for name, node in model.checkpoint_map().items()]


def _padded_key(model, name: str) -> str | None:
    """The checkpoint key of ``name`` if it is a padded vocabulary's table."""
    return getattr(model, "padded_keys", {}).get(name)


def _pieces(model, name: str, node, t: torch.Tensor) -> list[Piece]:
    """The checkpoint blocks ``t`` is saved as: its node's, or for a padded
    vocabulary's table the whole real tensor."""
    key = _padded_key(model, name)
    if key is None:
        return [piece for piece, _ in split(node, t)]
    return [Piece(key, (model.config.vocab_size, *t.shape[1:]))]


def _blocks(model, name: str, node, t: torch.Tensor) -> list[tuple[Piece, torch.Tensor]]:
    """(piece, block) of ``t`` as ``_pieces`` cuts it. A padded table's
    rows do not fall in torch's even shards (each rank holds padded / tp
    rows, the last ones padding): it is gathered over the tensor-parallel
    group and saved whole, as a replicated tensor is (written once), at
    the price of the whole table on each of its ranks while saving."""
    if _padded_key(model, name) is None:
        return split(node, t)
    lay = model.layout
    whole = torch.empty((t.shape[0] * lay.tp_size, *t.shape[1:]), dtype=t.dtype)
    dist.all_gather_into_tensor(whole, t.contiguous(), group=lay.tp_group)
    (piece,) = _pieces(model, name, node, t)
    return [(piece, whole[: piece.shape[0]])]


def _assemble(model, name: str, node, t: torch.Tensor, read) -> torch.Tensor:
    """``t``'s value from the blocks ``read(piece)`` returns: the inverse of ``_blocks``."""
    if _padded_key(model, name) is None:
        return materialize(node, read)
    (piece,) = _pieces(model, name, node, t)
    whole = read(piece)
    per, start = t.shape[0], model.layout.tp_rank * t.shape[0]
    mine = torch.zeros_like(t, dtype=whole.dtype)
    real = whole[start : start + per]
    mine[: real.shape[0]] = real
    return mine


def _state_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the optimizer state is read in: the parameter's, fp32 for
    half precision (ZeRO's fp32 master slices and their moments; a plain
    optimizer's half-precision moments are cast back exactly)."""
    return t.dtype if t.dtype in (torch.float32, torch.float64) else torch.float32


@torch.no_grad()
def _save_state(model, optimizer, extra: dict | None) -> dict[str, object]:
    """What ``save_checkpoint`` writes: copies, so that training may go on
    while they are written."""
    model = _unwrap(model)
    states = _param_states(model, optimizer)
    sd: dict[str, object] = {}
    step = 0.0
    for name, node, t in _entries(model):
        if name in model._copies:
            continue
        for piece, block in _blocks(model, name, node, t.detach()):
            sd[f"model.{piece.key}"] = _wrap(model, piece, block.clone())
        for kind, v in states.get(t, {}).items():
            if torch.is_tensor(v) and v.dim() >= 1:
                for piece, block in _blocks(model, name, node, v):
                    sd[f"optim.{piece.key}.{kind}"] = _wrap(model, piece, block.clone())
            elif kind == "step":
                # The parameter's own count (a parameter without a gradient
                # in some step lags), under each of its checkpoint tensors.
                own = torch.tensor(float(v), dtype=torch.float64)
                for piece in _pieces(model, name, node, t):
                    sd[f"optim.{piece.key}.{STEP}"] = own
                step = max(step, float(v))
    if optimizer is not None:
        sd["optim.step"] = torch.tensor(step, dtype=torch.float64)
    sd[_rng_key()] = torch.get_rng_state()
    for key, value in (extra or {}).items():
        sd[f"extra.{key}"] = value.detach().clone()
    return sd


def save_checkpoint(path: str, model, optimizer=None, extra: dict | None = None) -> None:
    """Every rank calls it. ``model``: a ``dsparallel.models`` model (or our
    DDP around one); ``optimizer``: a ``torch.optim`` optimizer or a
    ``ZeroRedundancyOptimizer`` over its parameters, or None; ``extra``:
    tensors of the caller's (a trainer's step and data position) saved
    under ``extra.<key>`` in the same checkpoint, so that they are complete
    exactly when it is (ranks giving one key must give equal tensors)."""
    import torch.distributed.checkpoint as dcp

    sd = _save_state(model, optimizer, extra)
    # Written aside and renamed once complete: a failure leaves the
    # previous checkpoint at ``path`` as it was (DCP raises on every rank).
    staging = staging_path(path)
    dcp.save(sd, checkpoint_id=staging)
    publish(staging, path)


class PendingSave:
    """A checkpoint being written in the background (``async_save_checkpoint``)."""

    def __init__(self, future, staging: str, path: str):
        self._future, self._staging, self.path = future, staging, path

    def done(self) -> bool:
        """Whether every rank has written its part (every rank calls it:
        it agrees over the ranks, so that all of them finish together)."""
        flag = torch.tensor([int(self._future.done())], dtype=torch.int64)
        # Over the training's group: the writer's is the background thread's.
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def finish(self) -> str:
        """Waits for the write and puts the checkpoint under its name
        (every rank calls it). Returns the path."""
        self._future.result()  # a failed write raises here
        publish(self._staging, self.path)
        return self.path


def async_save_checkpoint(
    path: str, model, optimizer=None, extra: dict | None = None, group=None
) -> PendingSave:
    """``save_checkpoint`` whose writing goes on in a background thread
    once the state is copied: training may change the model and optimizer
    at once. ``group``: a process group for the writer's own collectives
    (a gloo group beside the training's, which the background thread must
    not share). Until ``finish()`` the checkpoint is under a staging name,
    so a run killed meanwhile resumes from the previous one."""
    import torch.distributed.checkpoint as dcp

    sd = _save_state(model, optimizer, extra)
    staging = staging_path(path)
    future = dcp.async_save(sd, checkpoint_id=staging, process_group=group)
    return PendingSave(future, staging, path)


def _ask_for(path, model, optimizer, entries, wanted: dict, local: dict, extra: dict) -> list[str]:
    """Fills ``wanted`` (DCP's request: a DTensor where the block is split
    over tensor parallelism) and ``local`` (the blocks themselves) with
    what this rank loads; raises if the checkpoint lacks any of it.
    Returns the kinds of optimizer state saved (Adam's moments, masters)."""
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    kinds = sorted(
        {k.rsplit(".", 1)[1] for k in saved if k.startswith("optim.") and k != "optim.step"}
        - {STEP}
    )
    if optimizer is not None and "optim.step" not in saved:
        raise ValueError(f"load_checkpoint: {path} holds no optimizer state (saved without one)")

    def ask(name: str, piece: Piece, dtype: torch.dtype):
        if name not in saved:
            raise KeyError(f"load_checkpoint: {path} lacks {name} (a checkpoint of another model?)")
        block = torch.empty(piece.block_shape, dtype=dtype)
        local[name] = block
        wanted[name] = _wrap(model, piece, block)

    for name, node, t in entries:
        for piece in _pieces(model, name, node, t):
            ask(f"model.{piece.key}", piece, t.dtype)
            if optimizer is not None and t.requires_grad:
                for kind in kinds:
                    name = f"optim.{piece.key}.{kind}"
                    if kind == MASTER and name not in saved:
                        continue  # a parameter saved in full precision has none
                    ask(name, piece, _state_dtype(t))
                name = f"optim.{piece.key}.{STEP}"
                if name in saved:  # older checkpoints: the largest count only
                    wanted[name] = torch.zeros((), dtype=torch.float64)
    if optimizer is not None:
        wanted["optim.step"] = torch.zeros((), dtype=torch.float64)
    if _rng_key() in saved:  # at another world size the streams are new ones
        wanted[_rng_key()] = torch.empty_like(torch.get_rng_state())
    for key, value in extra.items():
        name = f"extra.{key}"
        if name not in saved:
            raise KeyError(f"load_checkpoint: {path} lacks {name}")
        wanted[name] = value
    return kinds


@torch.no_grad()
def load_checkpoint(path: str, model, optimizer=None, extra: dict | None = None) -> None:
    """Every rank calls it, with the model (and optimizer) of the new
    layout already built: fills the parameters, buffers and the
    optimizer's state from a ``save_checkpoint`` of any layout, and the
    tensors of ``extra`` (key -> a tensor of the saved shape) in place
    from what ``save_checkpoint``'s ``extra`` saved under that key."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    model = _unwrap(model)
    wanted: dict[str, object] = {}
    local: dict[str, torch.Tensor] = {}
    entries = _entries(model)
    # What this rank asks for may be missing where another rank's is not
    # (a stage of another model): every rank learns of it before the
    # collective load, and raises the same error.
    kinds, error = [], None
    try:
        kinds = _ask_for(path, model, optimizer, entries, wanted, local, extra or {})
    except Exception as e:
        error = e
    raise_if_any_failed(error, "load_checkpoint")
    dcp.load(wanted, checkpoint_id=path)
    for name, value in wanted.items():
        if isinstance(value, DTensor):
            local[name].copy_(value.to_local())
    if _rng_key() in wanted:
        torch.set_rng_state(wanted[_rng_key()])
    states = {}
    for name, node, t in entries:
        t.copy_(_assemble(model, name, node, t, lambda p: local[f"model.{p.key}"]))
        if optimizer is not None and t.requires_grad:
            pieces = _pieces(model, name, node, t)
            entry = {
                k: _assemble(model, name, node, t, lambda p, k=k: local[f"optim.{p.key}.{k}"])
                for k in kinds
                if k != MASTER or (pieces and all(f"optim.{p.key}.{k}" in local for p in pieces))
            }
            own = [wanted.get(f"optim.{p.key}.{STEP}") for p in pieces]
            step = own[0] if own and own[0] is not None else wanted["optim.step"]
            entry["step"] = torch.tensor(float(step), dtype=torch.float32)
            states[t] = entry
    if optimizer is None:
        return
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.load_param_states(states)
    else:
        # A plain optimizer keeps its state in the parameter's dtype (bf16
        # moments under a pure-bf16 model) and has no master copy.
        for p, entry in states.items():
            entry.pop(MASTER, None)
            optimizer.state[p] = {k: v.to(p.dtype) if k != "step" else v for k, v in entry.items()}
    if dist.is_initialized():
        dist.barrier()
