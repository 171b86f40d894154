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

def _from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Build the dataclass ``cls`` from a dict (e.g. read from JSON), naming any unknown field."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; known fields: {sorted(known)}")
    return cls(**data)


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
        return _from_dict(cls, data)


# ------------------------------------------------------------------------------------------
# Training configuration
# ------------------------------------------------------------------------------------------

# "auto" picks per device: bf16 on CUDA GPUs that support it, fp16 + loss scaling on older CUDA
# GPUs, fp32 elsewhere (CPU). See gpt2.precision.
PRECISIONS = ("auto", "fp32", "tf32", "bf16", "fp16")


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
    fused_adamw: bool | str = "auto"  # "auto" = fused kernel when every parameter is on CUDA

    # --- precision and speed ---------------------------------------------------------------
    precision: str = "auto"  # one of PRECISIONS
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
    seed: int = 1337  # seeds torch, numpy and random when the Trainer is built

    def __post_init__(self) -> None:
        positive = ("micro_batch_size", "seq_len", "max_steps", "eval_steps", "log_interval", "max_bad_steps")
        for name in positive:
            _require_int(self, name, minimum=1)
        for name in ("warmup_steps", "eval_interval", "checkpoint_interval", "keep_last_checkpoints", "seed"):
            _require_int(self, name, minimum=0)
        if self.total_batch_size is not None:
            _require_int(self, "total_batch_size", minimum=1)
            tokens_per_micro_batch = self.micro_batch_size * self.seq_len
            if self.total_batch_size % tokens_per_micro_batch != 0:
                raise ValueError(
                    f"TrainConfig.total_batch_size ({self.total_batch_size:,} tokens) must be a multiple of "
                    f"micro_batch_size * seq_len = {self.micro_batch_size} * {self.seq_len} = "
                    f"{tokens_per_micro_batch:,} tokens (times the number of processes); e.g. use "
                    f"{max(1, round(self.total_batch_size / tokens_per_micro_batch)) * tokens_per_micro_batch:,}"
                )
        for name in ("max_lr", "min_lr", "weight_decay", "eps", "grad_clip", "peak_flops"):
            _require_number(self, name, optional=name in ("min_lr", "grad_clip", "peak_flops"))
        if not self.max_lr > 0:
            raise ValueError(f"TrainConfig.max_lr must be > 0, got {self.max_lr!r}")
        if self.min_lr is None:
            self.min_lr = self.max_lr / 10
        if self.min_lr < 0:
            raise ValueError(f"TrainConfig.min_lr must be >= 0, got {self.min_lr!r}")
        if self.min_lr > self.max_lr:
            raise ValueError(
                f"TrainConfig.min_lr ({self.min_lr!r}) is larger than max_lr ({self.max_lr!r}): the cosine "
                "schedule decays from max_lr down to min_lr; lower min_lr or leave it None (max_lr / 10)"
            )
        if self.warmup_steps > self.max_steps:
            raise ValueError(
                f"TrainConfig.warmup_steps ({self.warmup_steps}) exceeds max_steps ({self.max_steps}): "
                "the warmup would never finish; use fewer warmup steps or a longer run"
            )
        if self.weight_decay < 0:
            raise ValueError(f"TrainConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        self.betas = tuple(self.betas)  # type: ignore[assignment]  # a JSON round trip gives a list
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"TrainConfig.betas must be two numbers in [0, 1), got {self.betas!r}")
        if not self.eps > 0:
            raise ValueError(f"TrainConfig.eps must be > 0, got {self.eps!r}")
        if self.grad_clip is not None and self.grad_clip < 0:
            raise ValueError(f"TrainConfig.grad_clip must be > 0, or 0/None to disable, got {self.grad_clip!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"TrainConfig.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.fused_adamw not in ("auto", True, False):
            raise ValueError(f"TrainConfig.fused_adamw must be 'auto', True or False, got {self.fused_adamw!r}")
        if self.peak_flops is not None and not self.peak_flops > 0:
            raise ValueError(f"TrainConfig.peak_flops must be > 0 FLOP/s (or None to detect), got {self.peak_flops!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"TrainConfig.device must be a string such as 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.resume is not None and not isinstance(self.resume, str):
            self.resume = str(self.resume)  # a pathlib.Path is fine too
        if self.out_dir is not None and not isinstance(self.out_dir, str):
            self.out_dir = str(self.out_dir)
        if self.resume == "auto" and self.out_dir is None:
            raise ValueError("TrainConfig.resume='auto' looks for checkpoints in out_dir, but out_dir is None")

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["betas"] = list(self.betas)  # JSON has no tuples
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        return _from_dict(cls, data)


def _require_int(config: Any, name: str, minimum: int) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{type(config).__name__}.{name} must be {kind}, got {value!r}")


def _require_number(config: Any, name: str, optional: bool) -> None:
    value = getattr(config, name)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = " (YAML reads 6e-4 as a string; write 6.0e-4)" if isinstance(value, str) else ""
        raise ValueError(f"{type(config).__name__}.{name} must be a number, got {value!r}{hint}")
    setattr(config, name, float(value))
