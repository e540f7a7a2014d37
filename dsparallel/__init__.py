"""dsparallel: data, tensor and pipeline parallel training for PyTorch.

Importing the package registers the torch.distributed backend ``"dsp"``.
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from . import backend

backend.register()

__version__ = "0.1.0"
__all__ = ["backend"]
