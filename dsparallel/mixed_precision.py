"""Mixed precision: float32 master weights, bfloat16 compute.

``MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``
(the names of torch FSDP2's ``MixedPrecisionPolicy``) is one policy for
every strategy. Applied to a module (``apply``, which our
``DistributedDataParallel(mixed_precision=...)`` and the models'
``mixed_precision=`` call), it makes

- the parameters the float32 masters: what the optimizer steps (whole
  under DDP, its slice under ZeRO), so any ``torch.optim`` optimizer keeps
  float32 state, and a checkpoint of the parameters is a checkpoint of the
  masters;
- its floating-point inputs cast to ``param_dtype`` (FSDP2's
  ``cast_forward_inputs``), and every module cast its own parameters to
  ``param_dtype`` as its forward starts (a forward pre-hook puts the cast
  copy where ``module.weight`` finds it, and the forward's end takes it
  away), so the compute runs in bfloat16 under any layout, schedule and
  recomputation (a recomputed forward casts again);
- the gradients float32: the cast's backward hands the bfloat16 gradient
  to the float32 parameter, and autograd adds micro-batches and
  ``no_sync`` steps into its float32 ``.grad``; DDP reduces them in
  ``reduce_dtype``.

This is FSDP2's cast without the sharding, and Megatron's float32
``main_grad`` and main parameters without the second copy of the model:
per parameter with AdamW 4 (master) + 4 (gradient) + 8 (moments) bytes,
plus 2 for the bfloat16 copy each forward in flight keeps for its backward.
Parameters a model keeps in float32 whatever its dtype (DeepSeek-V3's
router, marked ``_dsp_keep_fp32``) are not cast.

Without a policy, ``dtype=torch.bfloat16`` is pure bfloat16: weights,
gradients and optimizer state in bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

_NARROW = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: the dtype modules compute in; ``reduce_dtype``: the
    dtype DDP reduces gradients in (float32 keeps every bit of the float32
    gradients; bfloat16 halves the bytes on the wire)."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if self.param_dtype != torch.bfloat16:
            # float16's narrow exponent needs a loss scaler, which the
            # strategies and checkpoints do not carry yet.
            raise ValueError(
                f"MixedPrecision: param_dtype must be torch.bfloat16, got {self.param_dtype} "
                "(float16 would need a loss scaler; float32 compute needs no policy)"
            )
        if self.reduce_dtype not in (torch.float32, *_NARROW):
            raise ValueError(
                f"MixedPrecision: reduce_dtype must be torch.float32, torch.bfloat16 or "
                f"torch.float16, got {self.reduce_dtype}"
            )


def apply(module: nn.Module, policy: MixedPrecision) -> nn.Module:
    """Puts ``module`` under ``policy``: its floating parameters become
    float32 masters (upcast exactly, in place: the Parameter objects an
    optimizer may already hold stay the same) and each submodule casts its
    own to ``policy.param_dtype`` for its forward. Applying the same policy
    again does nothing; another one is refused."""
    current = policy_of(module)
    if current is not None:
        if current != policy:
            raise ValueError(
                f"mixed precision: the module is already under {current}; it cannot also be "
                f"put under {policy}"
            )
        return module
    for sub in module.modules():
        names = []
        for name, p in sub.named_parameters(recurse=False):
            if not p.is_floating_point() or getattr(p, "_dsp_keep_fp32", False):
                continue
            if p.dtype != torch.float32:
                p.data = p.data.float()
            names.append(name)
        if names:
            sub._dsp_cast = (tuple(names), policy.param_dtype)
            sub.register_forward_pre_hook(_cast_in)
            # always_call: a forward that raises must not leave the cast
            # copies where later reads of module.weight would find them.
            sub.register_forward_hook(_cast_out, always_call=True)
    # As FSDP2's cast_forward_inputs: the floating inputs of the module put
    # under the policy enter in its dtype (a model's token ids are not cast).
    module.register_forward_pre_hook(_cast_inputs, with_kwargs=True)
    module._dsp_mixed_precision = policy
    return module


def policy_of(module: nn.Module) -> MixedPrecision | None:
    """The policy ``module`` or a module inside it is under (None: none)."""
    for sub in module.modules():
        policy = getattr(sub, "_dsp_mixed_precision", None)
        if policy is not None:
            return policy
    return None


def compute_dtype(module: nn.Module) -> torch.dtype:
    """The dtype ``module`` computes in: the policy's, else its parameters'."""
    policy = policy_of(module)
    if policy is not None:
        return policy.param_dtype
    return next(p.dtype for p in module.parameters() if p.is_floating_point())


def describe(module: nn.Module) -> str:
    """ "mixed bfloat16 (float32 masters)", "pure bfloat16" or "float32"."""
    policy = policy_of(module)
    if policy is not None:
        return f"mixed {_name(policy.param_dtype)} (float32 masters)"
    dtype = compute_dtype(module)
    return f"pure {_name(dtype)}" if dtype in _NARROW else _name(dtype)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cast_in(module: nn.Module, _inputs) -> None:
    names, dtype = module._dsp_cast
    params = module._parameters
    for name in names:
        # The instance dict is looked up before nn.Module.__getattr__ (which
        # finds parameters): module.weight reads the cast copy, while
        # named_parameters, state_dict and the optimizer keep the master.
        module.__dict__[name] = params[name].to(dtype)


def _cast_inputs(module: nn.Module, args, kwargs):
    dtype = module._dsp_mixed_precision.param_dtype

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    return torch.utils._pytree.tree_map_only(torch.Tensor, cast, (args, kwargs))


def _cast_out(module: nn.Module, _inputs, _output) -> None:
    for name in module._dsp_cast[0]:
        module.__dict__.pop(name, None)
