"""Loads the extension, first checking that it was built against the torch
that is running: an extension built against another torch fails with an
undefined C++ symbol, which says nothing about the cause."""

from __future__ import annotations

import torch


def load_extension():
    try:
        from ._build_info import TORCH_VERSION as built_against
    except ImportError:  # a source tree that was never built
        built_against = None
    if built_against is not None and built_against != torch.__version__:
        raise ImportError(
            f"dsparallel was built against torch {built_against} but torch "
            f"{torch.__version__} is installed; rebuild it for this torch: "
            "pip install --no-build-isolation --force-reinstall --no-deps dsparallel "
            "(or, from a source checkout, pip install --no-build-isolation -e .)"
        )
    from . import _C

    return _C
