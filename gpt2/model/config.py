"""Typed, validated configuration for the GPT-2 model (field names as in nanoGPT), and the field
checks every config dataclass uses.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

from gpt2.errors import InvalidValueError

# GPT-2's byte-level BPE has 50,257 tokens: 50,000 merges + 256 byte tokens + <|endoftext|>.
GPT2_VOCAB_SIZE = 50257


def _from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Build the dataclass ``cls`` from a dict (e.g. read from JSON), naming any unknown field."""
    known = {f.name for f in dataclasses.fields(cls)}
    if unknown := sorted(set(data) - known):
        raise InvalidValueError(f"unknown {cls.__name__} field(s) {unknown}; known fields: {sorted(known)}")
    return cls(**data)


@dataclass(frozen=True)
class Range:
    """The values one numeric config field accepts: finite, of the right kind, within bounds. NaN is refused explicitly:
    it passes every ``x < 0`` check, and ``grad_clip=nan`` turns every weight NaN in one step.
    """

    low: float | None = None  # None = no lower bound
    high: float | None = None  # None = no upper bound
    low_open: bool = False  # True: ``low`` itself is not allowed (x > low)
    high_open: bool = False  # True: ``high`` itself is not allowed (x < high)
    optional: bool = False  # None is allowed (and kept)
    integer: bool = False  # an int (no bool, no float); else a float (ints are converted)

    def describe(self) -> str:
        if self.integer and self.low == 1 and self.high is None:
            return "a positive integer" + (" (or None)" if self.optional else "")
        kind, bounds = "an integer" if self.integer else "a finite number", ""
        low, high = (str(b) if isinstance(b, int) else f"{b:g}" for b in (self.low or 0, self.high or 0))
        if self.low is not None and self.high is not None:
            bounds = f" in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        elif self.low is not None:
            bounds = f" {'>' if self.low_open else '>='} {low}"
        elif self.high is not None:
            bounds = f" {'<' if self.high_open else '<='} {high}"
        return kind + bounds + (" (or None)" if self.optional else "")


def check_value(owner: str, name: str, value: Any, rule: Range) -> Any:
    """``value`` checked against ``rule`` (a float field's int becomes a float); a ValueError
    naming ``owner.name`` otherwise.
    """
    if value is None and rule.optional:
        return None
    ok_type = isinstance(value, numbers.Integral) if rule.integer else isinstance(value, numbers.Real)  # numpy's too
    if isinstance(value, bool) or not ok_type:
        hint = ""
        if isinstance(value, str):
            hint = " (YAML 1.1 reads 6e-4 as a string; write 6.0e-4)" if not rule.integer else " (not a string)"
        elif isinstance(value, float) and rule.integer:
            hint = " (not a float)"
        raise InvalidValueError(f"{owner}.{name} must be {rule.describe()}, got {value!r}{hint}")
    value = int(value) if rule.integer else float(value)
    too_low = rule.low is not None and (value <= rule.low if rule.low_open else value < rule.low)
    too_high = rule.high is not None and (value >= rule.high if rule.high_open else value > rule.high)
    if too_low or too_high or not (rule.integer or math.isfinite(value)):  # NaN is neither low nor high
        raise InvalidValueError(f"{owner}.{name} must be {rule.describe()}, got {value!r}")
    return value


def check_fields(config: Any, rules: dict[str, Range]) -> None:
    """Check (and normalise in place) every field of the dataclass ``config`` named in ``rules``, and
    that each ``bool`` field is a real bool (``compile="false"`` would otherwise be true).
    """
    owner = type(config).__name__
    for name, rule in rules.items():
        setattr(config, name, check_value(owner, name, getattr(config, name), rule))
    for name in (f.name for f in dataclasses.fields(config) if f.type in ("bool", bool)):
        if not isinstance(value := getattr(config, name), bool):
            raise InvalidValueError(f"{owner}.{name} must be True or False, got {value!r}")


POSITIVE_INT = Range(low=1, integer=True)
NON_NEGATIVE_INT = Range(low=0, integer=True)
POSITIVE = Range(low=0, low_open=True)  # a finite float > 0
NON_NEGATIVE = Range(low=0)
PROBABILITY = Range(low=0, high=1, high_open=True)  # [0, 1): dropout, Adam's betas


PRESETS: dict[str, dict[str, int]] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}

# Model shapes by name (``gpt2 train --model``, ``gpt2 bench --model``): GPT-2's presets plus two
# small ones for CPUs and tests.
SHAPES: dict[str, dict[str, int]] = {
    **PRESETS,
    # ~7M parameters, 6.4M of them the 50257 x 128 token embedding: trains at a few steps per
    # second on a laptop CPU, where the 50257-way softmax is most of the cost.
    "mini": dict(n_layer=4, n_head=4, n_embd=128),
    "tiny": dict(n_layer=2, n_head=2, n_embd=32),  # for tests and smoke runs
}
SHAPE_NAMES = tuple(SHAPES)


@dataclass
class GPTConfig:
    """Shape and regularisation of a GPT-2 model. ``pad_vocab_multiple`` rounds the embedding and
    LM-head rows up (64: 50257 -> 50304, faster on GPUs); the padded rows are sliced off the
    logits, so they are never sampled and never change the loss.
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
        check_fields(self, GPT_CONFIG_RULES)
        if self.n_embd % self.n_head != 0:
            raise InvalidValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}): "
                f"each head gets n_embd // n_head channels"
            )

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and LM head: ``vocab_size`` rounded up to ``pad_vocab_multiple``."""
        m = self.pad_vocab_multiple
        return ((self.vocab_size + m - 1) // m) * m

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> GPTConfig:
        """A preset (``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``) with optional overrides."""
        if name not in PRESETS:
            raise InvalidValueError(f"unknown GPT-2 preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        return _from_dict(cls, data)


# What each numeric GPTConfig field accepts (checked in __post_init__).
GPT_CONFIG_RULES: dict[str, Range] = {
    "block_size": POSITIVE_INT,
    "vocab_size": POSITIVE_INT,
    "n_layer": POSITIVE_INT,
    "n_head": POSITIVE_INT,
    "n_embd": POSITIVE_INT,
    "pad_vocab_multiple": POSITIVE_INT,
    "dropout": PROBABILITY,
    "layer_norm_epsilon": POSITIVE,
}
