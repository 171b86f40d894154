"""Typed, validated configuration for the GPT-2 model.

Field names follow nanoGPT (``block_size``, ``vocab_size``, ``n_layer``, ``n_head``,
``n_embd``, ``dropout``, ``bias``) so configs and checkpoints read the same.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

# GPT-2's byte-level BPE has 50,257 tokens: 50,000 merges + 256 byte tokens + <|endoftext|>.
GPT2_VOCAB_SIZE = 50257
# Padding the vocabulary to a multiple of 64 (50257 -> 50304) gives the embedding / LM-head
# matmuls shapes that tile cleanly on tensor cores; the extra rows are never sampled and never
# enter the loss (the model slices them off its logits).
VOCAB_PAD_MULTIPLE = 64

def _from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Build the dataclass ``cls`` from a dict (e.g. read from JSON), naming any unknown field."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; known fields: {sorted(known)}")
    return cls(**data)


# ------------------------------------------------------------------------------------------
# Field checks
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Range:
    """The values one numeric config field accepts: finite, of the right kind, within bounds.

    NaN must be rejected explicitly: it passes every ``x < 0`` check (all comparisons with NaN
    are false), and ``weight_decay=nan`` or ``grad_clip=nan`` turns every weight NaN in one step.
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
        kind = "an integer" if self.integer else "a finite number"
        if self.low is not None and self.high is not None:
            bounds = f" in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        elif self.low is not None:
            bounds = f" {'>' if self.low_open else '>='} {self.low:g}"
        elif self.high is not None:
            bounds = f" {'<' if self.high_open else '<='} {self.high:g}"
        else:
            bounds = ""
        return kind + bounds + (" (or None)" if self.optional else "")


def check_value(owner: str, name: str, value: Any, rule: Range) -> Any:
    """``value`` checked against ``rule`` (a float field's int becomes a float); a ValueError
    naming ``owner.name`` otherwise."""
    if value is None and rule.optional:
        return None
    ok_type = isinstance(value, int) if rule.integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        hint = ""
        if isinstance(value, str):
            hint = " (YAML 1.1 reads 6e-4 as a string; write 6.0e-4)" if not rule.integer else " (not a string)"
        elif isinstance(value, float) and rule.integer:
            hint = " (not a float)"
        raise ValueError(f"{owner}.{name} must be {rule.describe()}, got {value!r}{hint}")
    if not rule.integer:
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{owner}.{name} must be {rule.describe()}, got {value!r}")
    too_low = rule.low is not None and (value <= rule.low if rule.low_open else value < rule.low)
    too_high = rule.high is not None and (value >= rule.high if rule.high_open else value > rule.high)
    if too_low or too_high:
        raise ValueError(f"{owner}.{name} must be {rule.describe()}, got {value!r}")
    return value


def check_fields(config: Any, rules: dict[str, Range], flags: tuple[str, ...] = ()) -> None:
    """Check (and normalise in place) every field of ``config`` named in ``rules``, and that
    each field in ``flags`` is a real bool (``compile="false"`` would otherwise be true)."""
    owner = type(config).__name__
    for name, rule in rules.items():
        setattr(config, name, check_value(owner, name, getattr(config, name), rule))
    for name in flags:
        value = getattr(config, name)
        if not isinstance(value, bool):
            raise ValueError(f"{owner}.{name} must be True or False, got {value!r}")


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
        check_fields(self, GPT_CONFIG_RULES, flags=("bias", "flash"))
        if self.n_embd % self.n_head != 0:
            raise ValueError(
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
    def from_name(cls, name: str, **overrides: Any) -> "GPTConfig":
        """A preset (``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``) with optional overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown GPT-2 preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GPTConfig":
        return _from_dict(cls, data)


# What each numeric GPTConfig field accepts (checked in __post_init__).
GPT_CONFIG_RULES: dict[str, Range] = {
    "block_size": POSITIVE_INT, "vocab_size": POSITIVE_INT, "n_layer": POSITIVE_INT, "n_head": POSITIVE_INT,
    "n_embd": POSITIVE_INT, "pad_vocab_multiple": POSITIVE_INT,
    "dropout": PROBABILITY, "layer_norm_epsilon": POSITIVE,
}


# ------------------------------------------------------------------------------------------
# Training configuration
# ------------------------------------------------------------------------------------------

# "auto" picks per device: bf16 on CUDA GPUs that support it, fp16 + loss scaling on older CUDA
# GPUs, fp32 elsewhere (CPU). See gpt2.precision.
PRECISIONS = ("auto", "fp32", "tf32", "bf16", "fp16")
LOG_TARGETS = ("tensorboard", "wandb")  # TrainConfig.log_to; see gpt2.metrics.make_sinks


@dataclass
class TrainConfig:
    """Everything :class:`gpt2.trainer.Trainer` needs besides the model and the data.

    Batch sizes are counted in tokens where it matters: ``total_batch_size`` is the number of
    tokens per optimizer step over all processes, and the Trainer derives the gradient
    accumulation steps from it as ``total_batch_size // (micro_batch_size * seq_len *
    world_size)`` (an error if it does not divide). Steps are counted from 1: the record of
    step ``s`` describes the ``s``-th optimizer update and ``checkpoints/step_000s`` holds the
    weights after it.
    """

    # --- batch and length of the run -----------------------------------------------------
    micro_batch_size: int = 16  # sequences per forward/backward on one process
    seq_len: int = 1024  # tokens per sequence (at most the model's block_size)
    # Tokens per optimizer step over all processes and accumulation micro-steps; GPT-2 small
    # used ~0.5M (2**19 = 524,288). None = one micro-batch per process (no accumulation).
    total_batch_size: int | None = None
    max_steps: int = 1000  # optimizer steps in the whole run (a resumed run continues to it)

    # --- optimizer and schedule ------------------------------------------------------------
    max_lr: float = 6e-4  # GPT-3 small's peak learning rate (GPT-3 paper, table 2.1)
    # Floor of the cosine decay; None = max_lr / 10, the ratio GPT-3 and build-nanogpt use.
    min_lr: float | None = None
    warmup_steps: int = 0  # linear warmup from max_lr / warmup_steps to max_lr
    weight_decay: float = 0.1  # GPT-3's value, on 2-D weights only (see decay_embeddings)
    # GPT-3 used beta2 = 0.95 instead of Adam's 0.999: the second-moment estimate then forgets
    # old gradients faster, which keeps updates stable when gradient scales shift during training.
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8  # Adam's epsilon (GPT-3 paper)
    grad_clip: float | None = 1.0  # max global gradient norm; None or 0 = no clipping
    # Weight decay on the embeddings (token table, tied to the LM head, and positions).
    # build-nanogpt decays them (True); the default follows the common practice of exempting them.
    decay_embeddings: bool = False
    fused_adamw: bool | Literal["auto"] = "auto"  # "auto" = fused kernel when every parameter is on CUDA

    # --- precision and speed ---------------------------------------------------------------
    # auto = bf16 on GPUs that support it, fp16 with loss scaling on older GPUs, fp32 on CPU
    precision: Literal["auto", "fp32", "tf32", "bf16", "fp16"] = "auto"
    compile: bool = False  # torch.compile the model for training and evaluation
    device: str = "auto"  # "auto" = cuda:LOCAL_RANK when CUDA is available, else cpu

    # --- evaluation ------------------------------------------------------------------------
    eval_interval: int = 250  # validation loss every N steps and at the end; 0 = never
    # Micro-batches per process averaged per validation (always the same ones: the validation
    # loader restarts each time); with N processes N times as many rows are read.
    eval_steps: int = 20

    # --- checkpoints -----------------------------------------------------------------------
    out_dir: str | None = "out"  # metrics.jsonl, loss.png, checkpoints/; None = write nothing
    checkpoint_interval: int = 1000  # checkpoint every N steps and at the end; 0 = only at the end
    keep_last_checkpoints: int = 3  # older checkpoints are deleted; 0 = keep all
    # Save only parameters with requires_grad=True (e.g. LoRA adapters on a frozen base): small
    # checkpoints; resuming then needs the same base weights in the model passed to the Trainer.
    save_trainable_only: bool = False
    resume: str | None = None  # None | "auto" (newest checkpoint in out_dir, if any) | a path
    # A fresh run refuses an out_dir that holds another run's checkpoints or metrics; True deletes
    # that run's files (checkpoints/, metrics.jsonl, loss.png, results.json, adapter/) first.
    overwrite: bool = False

    # --- safety ----------------------------------------------------------------------------
    # Stop with TrainingDivergedError after this many consecutive steps whose loss or gradient
    # norm was non-finite (each of them is skipped, so the weights stay clean).
    max_bad_steps: int = 5

    # --- logging ---------------------------------------------------------------------------
    log_interval: int = 10  # console line every N steps (every step goes to metrics.jsonl)
    progress: bool = True  # tqdm progress bar on rank 0
    # Peak FLOP/s of one accelerator for MFU; None = looked up from the GPU's name.
    peak_flops: float | None = None
    plot: bool = True  # loss-curve PNG at the end (needs matplotlib, the [plot] extra)
    # Extra metric sinks on rank 0: "tensorboard" (out_dir/tensorboard) and/or "wandb" (out_dir/wandb,
    # offline without an API key); the console and metrics.jsonl are always written.
    log_to: tuple[str, ...] = ()
    seed: int = 1337  # seeds torch, numpy and random when the Trainer is built

    def __post_init__(self) -> None:
        check_fields(self, TRAIN_CONFIG_RULES, flags=TRAIN_CONFIG_FLAGS)
        if self.total_batch_size is not None:
            tokens_per_micro_batch = self.micro_batch_size * self.seq_len
            if self.total_batch_size % tokens_per_micro_batch != 0:
                raise ValueError(
                    f"TrainConfig.total_batch_size ({self.total_batch_size:,} tokens) must be a multiple of "
                    f"micro_batch_size * seq_len = {self.micro_batch_size} * {self.seq_len} = "
                    f"{tokens_per_micro_batch:,} tokens (times the number of processes); e.g. use "
                    f"{max(1, round(self.total_batch_size / tokens_per_micro_batch)) * tokens_per_micro_batch:,}"
                )
        if self.min_lr is not None and self.min_lr > self.max_lr:
            raise ValueError(
                f"TrainConfig.min_lr ({self.min_lr!r}) is larger than max_lr ({self.max_lr!r}): the cosine "
                "schedule decays from max_lr down to min_lr; lower min_lr or leave it None (max_lr / 10)"
            )
        if self.warmup_steps > self.max_steps:
            raise ValueError(
                f"TrainConfig.warmup_steps ({self.warmup_steps}) exceeds max_steps ({self.max_steps}): "
                "the warmup would never finish; use fewer warmup steps or a longer run"
            )
        # A JSON round trip gives a list; a string would unpack into characters, so refuse it first.
        if isinstance(self.betas, (str, bytes)) or not hasattr(self.betas, "__len__") or len(self.betas) != 2:
            raise ValueError(f"TrainConfig.betas must be two numbers in [0, 1), got {self.betas!r}")
        self.betas = tuple(check_value("TrainConfig", f"betas[{i}]", b, PROBABILITY)  # type: ignore[assignment]
                           for i, b in enumerate(self.betas))
        if self.precision not in PRECISIONS:
            raise ValueError(f"TrainConfig.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.fused_adamw not in ("auto", True, False):
            raise ValueError(f"TrainConfig.fused_adamw must be 'auto', True or False, got {self.fused_adamw!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"TrainConfig.device must be a string such as 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.resume is not None and not isinstance(self.resume, str):
            self.resume = str(self.resume)  # a pathlib.Path is fine too
        if self.out_dir is not None and not isinstance(self.out_dir, str):
            self.out_dir = str(self.out_dir)
        # "tensorboard,wandb" or ["tensorboard", "wandb"] (a CLI flag / YAML list) -> a tuple
        names = [self.log_to] if isinstance(self.log_to, str) else list(self.log_to or ())
        self.log_to = tuple(dict.fromkeys(n.strip().lower() for item in names for n in str(item).split(",") if n.strip()))
        unknown = [n for n in self.log_to if n not in LOG_TARGETS]
        if unknown:
            raise ValueError(f"TrainConfig.log_to: unknown target(s) {unknown}; choose from {list(LOG_TARGETS)}")
        if self.log_to and self.out_dir is None:
            raise ValueError(f"TrainConfig.log_to={list(self.log_to)} writes into out_dir, but out_dir is None")
        if self.resume == "auto" and self.out_dir is None:
            raise ValueError("TrainConfig.resume='auto' looks for checkpoints in out_dir, but out_dir is None")

    @property
    def final_lr(self) -> float:
        """Where the cosine decay ends: ``min_lr``, or ``max_lr / 10`` when it is None."""
        return self.max_lr / 10 if self.min_lr is None else self.min_lr

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["betas"] = list(self.betas)  # JSON has no tuples
        data["log_to"] = list(self.log_to)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        return _from_dict(cls, data)


# What each numeric TrainConfig field accepts (checked in __post_init__, before anything else).
TRAIN_CONFIG_RULES: dict[str, Range] = {
    "micro_batch_size": POSITIVE_INT, "seq_len": POSITIVE_INT, "max_steps": POSITIVE_INT,
    "total_batch_size": Range(low=1, integer=True, optional=True),
    "eval_steps": POSITIVE_INT, "log_interval": POSITIVE_INT, "max_bad_steps": POSITIVE_INT,
    "warmup_steps": NON_NEGATIVE_INT, "eval_interval": NON_NEGATIVE_INT, "checkpoint_interval": NON_NEGATIVE_INT,
    "keep_last_checkpoints": NON_NEGATIVE_INT, "seed": NON_NEGATIVE_INT,
    "max_lr": POSITIVE,
    "min_lr": Range(low=0, optional=True),  # None = max_lr / 10; at most max_lr (checked after)
    "weight_decay": NON_NEGATIVE,
    "eps": POSITIVE,
    "grad_clip": Range(low=0, optional=True),  # 0 or None = no clipping
    "peak_flops": Range(low=0, low_open=True, optional=True),  # FLOP/s; None = from the GPU's name
}
TRAIN_CONFIG_FLAGS = ("decay_embeddings", "compile", "save_trainable_only", "overwrite", "progress", "plot")
