"""Typed, validated configuration for the GPT-2 model.

Field names follow nanoGPT (``block_size``, ``vocab_size``, ``n_layer``, ``n_head``,
``n_embd``, ``dropout``, ``bias``) so configs and checkpoints read the same.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# GPT-2's byte-level BPE has 50,257 tokens: 50,000 merges + 256 byte tokens + <|endoftext|>.
GPT2_VOCAB_SIZE = 50257
# Padding the vocabulary to a multiple of 64 (50257 -> 50304) gives the embedding / LM-head
# matmuls shapes that tile cleanly on tensor cores; the extra rows are never sampled and never
# enter the loss (the model slices them off its logits).
VOCAB_PAD_MULTIPLE = 64

PRESETS: dict[str, dict[str, int]] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}


@dataclass
class GPTConfig:
    """Shape and regularisation of a GPT-2 model.

    ``vocab_size`` is the real vocabulary (50257 for GPT-2). ``pad_vocab_multiple`` rounds the
    embedding / LM-head rows up (64 turns 50257 into 50304, a measurable speed-up on GPUs);
    padded rows are sliced off the logits, so they are never sampled and never change the loss.
    """

    block_size: int = 1024  # maximum context length (number of learned positions)
    vocab_size: int = GPT2_VOCAB_SIZE
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers, as in GPT-2
    pad_vocab_multiple: int = 1  # 1 = no padding; 64 gives 50304 for GPT-2
    layer_norm_epsilon: float = 1e-5  # GPT-2's value
    flash: bool = True  # F.scaled_dot_product_attention; False = explicit softmax attention

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "pad_vocab_multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}): "
                f"each head gets n_embd // n_head channels"
            )
        if not (0.0 <= float(self.dropout) < 1.0):
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.layer_norm_epsilon > 0:
            raise ValueError(f"GPTConfig.layer_norm_epsilon must be > 0, got {self.layer_norm_epsilon!r}")

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and LM head: ``vocab_size`` rounded up to ``pad_vocab_multiple``."""
        m = self.pad_vocab_multiple
        return ((self.vocab_size + m - 1) // m) * m

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "GPTConfig":
        """A preset (``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``) with optional overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown GPT-2 preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GPTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**data)
