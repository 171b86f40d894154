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


def rounded_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (both positive)."""
    return -(-n // multiple) * multiple


def _from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Build the dataclass ``cls`` from a dict (e.g. read from JSON), naming any unknown field."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise InvalidValueError(f"unknown {cls.__name__} field(s) {unknown}; known fields: {sorted(known)}")
    return cls(**data)


# How a lower bound is written in messages, by whether it is open: (interval bracket, comparison).
_LOW_SPELLING = {False: ("[", ">="), True: ("(", ">")}


@dataclass(frozen=True)
class Range:
    """The values one numeric config field accepts: finite, of the right kind, within bounds. NaN is refused explicitly:
    it passes every ``x < 0`` check, and ``grad_clip=nan`` turns every weight NaN in one step.
    """

    # None: no lower bound.
    low: float | None = None
    # None: no upper bound; given only with ``low`` (messages write the two as an interval).
    high: float | None = None
    # True: ``low`` itself is not allowed (x > low).
    low_open: bool = False
    # True: ``high`` itself is not allowed (x < high).
    high_open: bool = False
    # None is allowed (and kept).
    optional: bool = False
    # An int (no bool, no float); else a float (ints are converted).
    integer: bool = False

    def describe(self) -> str:
        """The accepted values in words, as error messages say them: ``a finite number in [0, 1)``."""
        if self.integer and self.low == 1 and self.high is None:
            text = "a positive integer"
        elif self.integer:
            text = "an integer" + self._bounds()
        else:
            text = "a finite number" + self._bounds()
        if self.optional:
            text += " (or None)"
        return text

    def _bounds(self) -> str:
        low_bracket, low_comparison = _LOW_SPELLING[self.low_open]
        # every rule with an upper bound has a lower one: an interval
        if self.high is not None:
            return f" in {low_bracket}{self.low}, {self.high}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f" {low_comparison} {self.low}"
        return ""

    def has_kind(self, value: Any) -> bool:
        """Whether ``value`` is a number of this field's kind (numpy's scalars count; a bool never does)."""
        if isinstance(value, bool):
            return False
        if self.integer:
            return isinstance(value, numbers.Integral)
        return isinstance(value, numbers.Real)

    def contains(self, value: float) -> bool:
        """Whether the number ``value`` is finite and within bounds (NaN is neither low nor high, so it is
        refused here by name).
        """
        if not (self.integer or math.isfinite(value)):
            return False
        too_low = self.low is not None and (value < self.low or (self.low_open and value == self.low))
        too_high = self.high is not None and (value > self.high or (self.high_open and value == self.high))
        return not (too_low or too_high)


def check_value(owner: str, name: str, value: Any, rule: Range) -> Any:
    """``value`` checked against ``rule`` (a float field's int becomes a float); a ValueError
    naming ``owner.name`` otherwise.
    """
    if value is None and rule.optional:
        return None
    if not rule.has_kind(value):
        # what a value of the wrong kind most likely means (an int field's string needs no hint: its quotes show)
        hint = ""
        if isinstance(value, str) and not rule.integer:
            hint = " (YAML 1.1 reads 6e-4 as a string; write 6.0e-4)"
        elif isinstance(value, float) and rule.integer:
            hint = " (not a float)"
        raise InvalidValueError(f"{owner}.{name} must be {rule.describe()}, got {value!r}{hint}")
    if rule.integer:
        value = int(value)
    else:
        value = float(value)
    if not rule.contains(value):
        raise InvalidValueError(f"{owner}.{name} must be {rule.describe()}, got {value!r}")
    return value


def check_fields(config: Any, rules: dict[str, Range]) -> None:
    """Check (and normalise in place) every field of the dataclass ``config`` named in ``rules``, and
    that each ``bool`` field is a real bool (``compile="false"`` would otherwise be true).
    """
    owner = type(config).__name__
    for name, rule in rules.items():
        setattr(config, name, check_value(owner, name, getattr(config, name), rule))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.type in ("bool", bool) and not isinstance(value, bool):
            raise InvalidValueError(f"{owner}.{f.name} must be True or False, got {value!r}")


POSITIVE_INT = Range(low=1, integer=True)
NON_NEGATIVE_INT = Range(low=0, integer=True)
# A finite float > 0.
POSITIVE = Range(low=0, low_open=True)
NON_NEGATIVE = Range(low=0)
# [0, 1): dropout, Adam's betas.
PROBABILITY = Range(low=0, high=1, high_open=True)


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
    # ~7M parameters, 6.4M of them the 50257 x 128 token embedding: small enough to train on a
    # laptop CPU, where the 50257-way softmax is most of the cost.
    "mini": dict(n_layer=4, n_head=4, n_embd=128),
    # For tests and smoke runs.
    "tiny": dict(n_layer=2, n_head=2, n_embd=32),
}
SHAPE_NAMES = tuple(SHAPES)


@dataclass
class GPTConfig:
    """Shape and regularisation of a GPT-2 model. ``pad_vocab_multiple`` rounds the embedding and
    LM-head rows up (64: 50257 -> 50304, faster on GPUs); the padded rows are sliced off the
    logits, so they are never sampled and never change the loss.
    """

    # The maximum context length (the number of learned positions).
    block_size: int = 1024
    vocab_size: int = GPT2_VOCAB_SIZE
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    # Biases in the Linear and LayerNorm layers, as in GPT-2.
    bias: bool = True
    # 1: no padding; 64 gives 50304 rows for GPT-2.
    pad_vocab_multiple: int = 1
    # GPT-2's value.
    layer_norm_epsilon: float = 1e-5
    # F.scaled_dot_product_attention; False: explicit softmax attention.
    flash: bool = True

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
        return rounded_up(self.vocab_size, self.pad_vocab_multiple)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> GPTConfig:
        """A shape of :data:`SHAPES` (``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``, or the small ``mini``
        and ``tiny``) with optional overrides.
        """
        if name not in SHAPES:
            raise InvalidValueError(f"unknown model shape {name!r}; choose one of {sorted(SHAPES)}")
        return cls(**{**SHAPES[name], **overrides})

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
