"""Small reference models built from dsparallel's layers."""

from .gpt import GPTConfig, build_stage, gpt_loss, stage_blocks

__all__ = ["GPTConfig", "build_stage", "gpt_loss", "stage_blocks"]
