"""Registers the "dsp" backend when torch is imported, so that
``init_process_group("dsp")`` works without ``import dsparallel``.

torch calls ``autoload()`` at the end of ``import torch`` for every entry
point in the ``torch.backends`` group (unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``).
This module lives outside the ``dsparallel`` package on purpose: importing
the package loads the C++ extension, which must not happen while torch is
still importing, nor cost every torch user its load time. The creator
registered here imports dsparallel only when a "dsp" group is created.
It must never raise: an exception here would break ``import torch``.
"""

from __future__ import annotations

BACKEND_NAME = "dsp"


def _create_backend(dist_backend_opts, backend_options=None):
    from dsparallel.backend import _create_backend

    return _create_backend(dist_backend_opts, backend_options)


def autoload() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and BACKEND_NAME.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(
                BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
            )
    except Exception:  # noqa: BLE001  (never break import torch)
        pass
    _default_if_asked()


def make_default() -> None:
    """ "dsp" becomes torch's default backend for CPU tensors: the device map
    that ``init_device_mesh`` and torch's lazy groups read, and the backend
    ``init_process_group()`` takes when none is named ("cpu:dsp", with
    ",cuda:nccl" where torch has CUDA). The latter is set as that argument's
    default rather than left to torch's "undefined" backend, which marks a
    group's default backend gloo whatever the map says, so that DDP's
    construction then fails ("Could not find backend type 1")."""
    import inspect

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    dist.Backend.default_device_backend_map["cpu"] = BACKEND_NAME
    backend = f"cpu:{BACKEND_NAME}" + (",cuda:nccl" if torch.cuda.is_available() else "")
    fn = inspect.unwrap(distributed_c10d.init_process_group)
    names = list(inspect.signature(fn).parameters)
    defaults = list(fn.__defaults__ or ())
    first = len(names) - len(defaults)  # the parameter the first default belongs to
    if names.index("backend") >= first:
        defaults[names.index("backend") - first] = backend
        fn.__defaults__ = tuple(defaults)


def _default_if_asked() -> None:
    """``DSPARALLEL_DEFAULT_BACKEND=1``: ``make_default()`` at ``import
    torch`` (``dsparallel.use_as_default()`` without code)."""
    try:
        import os

        if os.environ.get("DSPARALLEL_DEFAULT_BACKEND", "").lower() in ("1", "true", "dsp"):
            import torch.distributed as dist

            if BACKEND_NAME.upper() in dist.Backend._plugins:
                make_default()
    except Exception:  # noqa: BLE001  (never break import torch)
        pass
