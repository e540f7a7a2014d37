"""Models built from dsparallel's layers: Llama, DeepSeek-V3 and GPT-2
(``CausalLM``s, from Hugging Face configs and checkpoints), and the
lecture's small GPT built stage by stage (``build_stage``)."""

from .causal_lm import CausalLMOutput
from .checkpoint_io import from_pretrained
from .deepseek_v3 import DeepseekV3
from .gpt import GPTConfig, build_stage, gpt_loss, stage_blocks
from .gpt2 import GPT2
from .llama import Llama

__all__ = [
    "CausalLMOutput",
    "DeepseekV3",
    "GPT2",
    "GPTConfig",
    "Llama",
    "build_stage",
    "from_pretrained",
    "gpt_loss",
    "stage_blocks",
]
