"""Inference: ``generate`` with a KV cache, under tensor and pipeline
parallelism, for ``dsparallel.models``' Llama and DeepSeek-V3."""

from .generate import generate
from .kv_cache import KVCache

__all__ = ["KVCache", "generate"]
