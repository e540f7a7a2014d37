"""The trainer: ``torchrun --nproc-per-node N -m dsparallel.train --config
job.toml [--section.field=value ...]``, or ``Trainer(config).fit()`` from a
script. See ``config.py`` for every field."""

from .config import JobConfig, load
from .trainer import Trainer

__all__ = ["JobConfig", "Trainer", "load"]
