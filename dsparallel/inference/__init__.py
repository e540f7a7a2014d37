"""Inference: ``generate`` with a KV cache, under tensor and pipeline
parallelism, for ``dsparallel.models``' Llama, DeepSeek-V3 and GPT-2."""

from .generate import generate
from .kv_cache import KVCache

__all__ = ["KVCache", "generate"]
