"""gpt2: a reusable GPT-2 library (model, generation, Hugging Face interop, data, Trainer)."""

from .config import PRESETS, GPTConfig
from .generate import KVCache, generate, pad_prompts, sample_next, stream
from .model import GPT

__all__ = [
    "GPT",
    "GPTConfig",
    "PRESETS",
    "KVCache",
    "generate",
    "stream",
    "sample_next",
    "pad_prompts",
]
__version__ = "0.1.0"
