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

        if not dist.is_available() or BACKEND_NAME.upper() in dist.Backend._plugins:
            return
        dist.Backend.register_backend(
            BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
        )
    except Exception:  # noqa: BLE001  (never break import torch)
        pass
