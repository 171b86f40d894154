"""Typed, validated configuration for training: :class:`TrainConfig`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

from gpt2.errors import InvalidValueError
from gpt2.model.config import (
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    PROBABILITY,
    Range,
    _from_dict,
    check_fields,
    check_value,
)

# TrainConfig.precision (and the commands' --precision): "auto" picks per device, the others name a policy
# of gpt2.train.precision.
Precision = Literal["auto", "fp32", "tf32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
LOG_TARGETS = ("tensorboard", "wandb")  # TrainConfig.log_to (parsed_log_to); see gpt2.train.metrics.make_sinks
OPTIMIZERS = ("adamw", "muon")  # TrainConfig.optimizer; see gpt2.train.optim
STRATEGIES = ("ddp", "fsdp")  # TrainConfig.strategy; see gpt2.train.distributed
AUTO = "auto"  # TrainConfig.micro_batch_size="auto": found when the Trainer starts (gpt2.train.batch_finder)


@dataclass
class RecoveryConfig:
    """Divergence recovery (``TrainConfig.recovery``; docs/training.md, "When a run goes wrong"): when
    ``max_bad_steps`` non-finite steps come in a row, or the loss stays above ``divergence_factor`` x the best loss so
    far for ``patience`` steps, go back to the newest checkpoint confirmed good, i.e. whose next step had a good loss
    (or an in-memory copy before the first one), multiply the learning rate by ``lr_factor``, skip the batches that
    blew up and go on; after ``max_recoveries`` recoveries stop with TrainingDivergedError.
    """

    enabled: bool = True  # False: no divergence detection; max_bad_steps non-finite steps stop the run
    max_bad_steps: int = 5  # non-finite steps in a row (each skipped) before recovery / TrainingDivergedError
    max_recoveries: int = 3  # recoveries before the run stops with TrainingDivergedError
    lr_factor: float = 0.5  # each recovery multiplies the learning rate by this
    divergence_factor: float = 2.0  # diverging: the loss above this x the best so far (and 1 nat above it)
    patience: int = 3  # for this many steps in a row

    def __post_init__(self) -> None:
        check_fields(self, RECOVERY_CONFIG_RULES)


@dataclass
class TrainConfig:
    """Everything :class:`gpt2.train.trainer.Trainer` needs besides the model and the data.

    Steps are counted from 1: the record of step ``s`` describes the ``s``-th optimizer update and
    ``checkpoints/step_000s`` holds the weights after it.
    """

    # --- batch and length of the run -----------------------------------------------------
    # Sequences per forward/backward on one process; "auto": the largest that fits in memory, found when the Trainer
    # starts (gpt2.train.batch_finder; on a CPU within memory_limit_gb), with total_batch_size kept by accumulation.
    micro_batch_size: int | Literal["auto"] = 16  # sequences per forward/backward on one process, or auto
    seq_len: int = 1024  # tokens per sequence (at most the model's block_size)
    # Tokens per optimizer step over all processes and accumulation micro-steps; GPT-2 small
    # used ~0.5M (2**19 = 524,288). None = one micro-batch per process (no accumulation).
    total_batch_size: int | None = None
    max_steps: int = 1000  # optimizer steps in the whole run (a resumed run continues to it)

    # --- optimizer and schedule ------------------------------------------------------------
    # peak learning rate (6e-4 is GPT-3 small's: GPT-3 paper, table 2.1)
    max_lr: float = 6e-4
    # Floor of the cosine decay; None = max_lr / 10, the ratio GPT-3 and build-nanogpt use.
    min_lr: float | None = None
    # Decay the LR (a half cosine to min_lr) after the warmup, as nanoGPT's decay_lr; False = stay at max_lr
    # (min_lr unused), e.g. for one pass over a small text whose validation split continues its end.
    decay_lr: bool = True
    warmup_steps: int = 0  # linear warmup from max_lr / warmup_steps to max_lr
    # AdamW weight decay, on 2-D weights only (see decay_embeddings); 0.1 is GPT-3's
    weight_decay: float = 0.1
    # GPT-3 used beta2 = 0.95 instead of Adam's 0.999: the second-moment estimate then forgets
    # old gradients faster, which keeps updates stable when gradient scales shift during training.
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8  # Adam's epsilon (GPT-3 paper)
    grad_clip: float | None = 1.0  # max global gradient norm; None or 0 = no clipping
    # Weight decay on the embeddings (token table, tied to the LM head, and positions).
    # build-nanogpt decays them (True); the default follows the common practice of exempting them.
    decay_embeddings: bool = False
    # "auto": the fused AdamW kernel wherever torch has one for the parameters' device and dtype (CUDA, and the CPU
    # since torch 2.4; checked, not assumed), else the multi-tensor ("foreach") one.
    fused_adamw: bool | Literal["auto"] = "auto"
    # "muon": torch.optim.Muon for the blocks' matrices, AdamW (max_lr, betas...) for embeddings,
    # head, biases and gains (docs/training.md).
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_lr: float = 0.02  # Muon's peak LR (Keller Jordan's default); the schedule scales it like max_lr
    # Muon's decoupled weight decay (each step scales the matrices by 1 - lr * wd); its reference uses 0.
    muon_weight_decay: float = 0.0

    # --- precision and speed ---------------------------------------------------------------
    precision: Precision = "auto"  # auto: bf16 (fp16 on old GPUs); on a CPU bf16 with AMX or AVX512-BF16, else fp32
    compile: bool = False  # torch.compile the model for training and evaluation
    device: str = "auto"  # "auto" = cuda:LOCAL_RANK when CUDA is available, else cpu

    # --- processes and memory ------------------------------------------------------------
    # How the processes of a torchrun job share the model. "ddp": each holds all of it (weights, gradients,
    # AdamW's moments: 16 bytes a parameter in fp32) and gradients are averaged. "fsdp": FSDP2
    # (torch.distributed.fsdp.fully_shard) keeps 1/N of each on each of N processes and gathers a block's
    # weights only while it runs; checkpoints are then sharded (docs/distributed.md). One process: the same.
    strategy: Literal["ddp", "fsdp"] = "ddp"  # ddp: each process holds the whole model; fsdp: 1/N of it (FSDP2)
    # Keep only each transformer block's input during the forward and recompute the rest in the backward: one more
    # forward of the blocks (the head is not recomputed) for far less activation memory (docs/benchmarks.md).
    activation_checkpointing: bool = False  # recompute each block's activations in the backward: less memory
    # micro_batch_size="auto" on a CPU: the memory (GiB) one process may use (on a GPU its memory is the limit).
    memory_limit_gb: float | None = None  # micro_batch_size="auto" on a CPU: GiB one process may use

    # --- evaluation ------------------------------------------------------------------------
    eval_interval: int = 250  # validation loss every N steps and at the end; 0 = only at the end
    # Micro-batches per process averaged per validation (always the same ones: the validation
    # loader restarts each time); with N processes N times as many rows are read.
    eval_steps: int = 20

    # --- checkpoints -----------------------------------------------------------------------
    out_dir: str | None = "out"  # metrics.jsonl, loss.png, checkpoints/; None = write nothing
    checkpoint_interval: int = 1000  # checkpoint every N steps and at the end; 0 = only at the end
    # Older checkpoints are deleted, except the newest one confirmed good (recovery goes back to it); 0 = keep all.
    keep_last_checkpoints: int = 3
    # Save only parameters with requires_grad=True (e.g. LoRA adapters on a frozen base): small
    # checkpoints; resuming then needs the same base weights in the model passed to the Trainer.
    save_trainable_only: bool = False
    resume: str | None = None  # None | "auto" (newest checkpoint in out_dir, if any) | a path
    # Resume the weights (and step, data position) alone; the optimizer and loss scaler start
    # fresh: for a checkpoint whose optimizer state does not fit this run's optimizer.
    resume_weights_only: bool = False
    # Resume an adapter-only checkpoint onto another base model than the one it was trained on.
    allow_base_mismatch: bool = False
    # A fresh run refuses an out_dir that holds another run's checkpoints or metrics, or files
    # gpt2 did not write; True deletes that run's files (those its record .gpt2-outputs.json proves
    # gpt2 wrote, unchanged) first and keeps everything else; a metrics.jsonl or results.json the
    # user edited is refused, since the new run would replace it.
    overwrite: bool = False

    # --- safety ----------------------------------------------------------------------------
    recovery: RecoveryConfig = dataclasses.field(default_factory=RecoveryConfig)  # divergence recovery

    # --- logging ---------------------------------------------------------------------------
    log_interval: int = 10  # console line every N steps (every step goes to metrics.jsonl)
    progress: bool = True  # tqdm progress bar on rank 0
    # Peak FLOP/s of one accelerator for MFU; None = looked up from the GPU's name.
    peak_flops: float | None = None
    # loss-curve PNG (loss.png) at the end
    plot: bool = True
    # Extra metric sinks on rank 0: "tensorboard" (out_dir/tensorboard) and/or "wandb" (out_dir/wandb,
    # offline without an API key); the console and metrics.jsonl are always written.
    log_to: tuple[str, ...] = ()
    seed: int = 1337  # seeds torch, numpy and random when the Trainer is built

    def __post_init__(self) -> None:
        # One check after another, in this order: the first problem found is the one reported.
        if isinstance(self.recovery, dict):
            self.recovery = _from_dict(RecoveryConfig, self.recovery)
        if not isinstance(self.recovery, RecoveryConfig):
            raise InvalidValueError(f"TrainConfig.recovery must be a RecoveryConfig, got {self.recovery!r}")
        self.micro_batch_size = _checked_or_auto("micro_batch_size", self.micro_batch_size, POSITIVE_INT)
        check_fields(self, TRAIN_CONFIG_RULES)
        self._check_batch_split()
        self._check_schedule()
        self.betas = _checked_betas(self.betas)
        for name, (choices, described) in TRAIN_CONFIG_CHOICES.items():
            if getattr(self, name) not in choices:
                raise InvalidValueError(f"TrainConfig.{name} must be {described}, got {getattr(self, name)!r}")
        if not isinstance(self.device, str) or not self.device:
            raise InvalidValueError(
                f"TrainConfig.device must be a string such as 'auto', 'cpu' or 'cuda', got {self.device!r}"
            )
        self._normalise_paths()
        self.log_to = parsed_log_to(self.log_to)
        if self.log_to and self.out_dir is None:
            raise InvalidValueError(f"TrainConfig.log_to={list(self.log_to)} writes into out_dir, but out_dir is None")
        if self.resume == "auto" and self.out_dir is None:
            raise InvalidValueError("TrainConfig.resume='auto' looks for checkpoints in out_dir, but out_dir is None")
        if self.resume == "auto" and self.overwrite:
            raise InvalidValueError("overwrite=True deletes the run in out_dir, resume='auto' continues it: choose one")

    def _check_batch_split(self) -> None:
        """total_batch_size splits into whole micro-batches on one process; with micro_batch_size="auto" (found when
        the Trainer starts) into whole sequences, which every size the search may choose divides.
        """
        if self.micro_batch_size == AUTO:
            sequences_per_process(self, world_size=1)
        else:
            grad_accum_steps(self, world_size=1)

    def _check_schedule(self) -> None:
        """The learning-rate schedule's fields agree with each other."""
        if self.decay_lr and self.min_lr is not None and self.min_lr > self.max_lr:
            raise InvalidValueError(
                f"TrainConfig.min_lr ({self.min_lr!r}) is larger than max_lr ({self.max_lr!r}): the cosine "
                "schedule decays from max_lr down to min_lr; lower min_lr or leave it None (max_lr / 10)"
            )
        if self.warmup_steps > self.max_steps:
            raise InvalidValueError(
                f"TrainConfig.warmup_steps ({self.warmup_steps}) exceeds max_steps ({self.max_steps}): "
                "the warmup would never finish; use fewer warmup steps or a longer run"
            )

    def _normalise_paths(self) -> None:
        """``resume`` and ``out_dir`` as strings (a ``pathlib.Path`` is fine too); an empty ``out_dir`` is refused."""
        if self.resume is not None and not isinstance(self.resume, str):
            self.resume = str(self.resume)
        if self.out_dir is not None and not isinstance(self.out_dir, str):
            self.out_dir = str(self.out_dir)
        # Path("") is the current directory
        if self.out_dir == "":
            raise InvalidValueError(
                "TrainConfig.out_dir is empty: give a folder for the run's files, or None to write none"
            )

    @property
    def final_lr(self) -> float:
        """Where the cosine decay ends: ``min_lr``, or ``max_lr / 10`` when it is None; ``max_lr`` without decay."""
        if not self.decay_lr:
            return self.max_lr
        return self.max_lr / 10 if self.min_lr is None else self.min_lr

    def to_dict(self) -> dict[str, Any]:
        # tuples stay tuples: JSON writes them as lists, which from_dict reads back
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        return _from_dict(cls, data)


def grad_accum_steps(config: TrainConfig, world_size: int) -> int:
    """Micro-steps per optimizer step so that one step sees ``total_batch_size`` tokens over ``world_size``
    processes. The one owner of the rule that ``total_batch_size`` splits into whole micro-batches:
    TrainConfig checks it for one process, the Trainer for the processes it runs on. A ``micro_batch_size`` of
    "auto" has none until the Trainer has found the size (:mod:`gpt2.train.batch_finder`).
    """
    if config.micro_batch_size == AUTO:
        raise InvalidValueError(
            "TrainConfig.micro_batch_size='auto' has no accumulation steps until the Trainer has found the size "
            "(gpt2.train.batch_finder.resolve_micro_batch_size); give a number to compute them before that"
        )
    if config.total_batch_size is None:
        return 1
    return _whole_split(config, micro_batch_size=config.micro_batch_size, seq_len=config.seq_len, world_size=world_size)


def sequences_per_process(config: TrainConfig, world_size: int) -> int | None:
    """Sequences each of ``world_size`` processes reads per optimizer step: ``total_batch_size / (seq_len x
    world_size)`` (None without a total_batch_size). Every size ``micro_batch_size="auto"`` may choose divides it.
    """
    if config.total_batch_size is None:
        return None
    return _whole_split(config, seq_len=config.seq_len, world_size=world_size)


def _whole_split(config: TrainConfig, **factors: int) -> int:
    """``total_batch_size`` divided by the product of ``factors`` (named as TrainConfig names them), refused unless
    it divides: the one message of the batch-split rule.
    """
    unit = math.prod(factors.values())
    if config.total_batch_size % unit != 0:
        names = " x ".join(factors)
        values = " x ".join(str(v) for v in factors.values())
        nearest = max(1, round(config.total_batch_size / unit)) * unit
        raise InvalidValueError(
            f"TrainConfig.total_batch_size={config.total_batch_size:,} tokens is not divisible by {names} = {values} "
            f"= {unit:,} tokens; pick a total_batch_size that is a multiple of {' * '.join(factors)} (e.g. {nearest:,})"
        )
    return config.total_batch_size // unit


def _checked_or_auto(name: str, value: Any, rule: Range) -> Any:
    """A field that takes ``rule``'s numbers or "auto": "auto", or the number as :func:`check_value` stores it."""
    if isinstance(value, str) and value == AUTO:
        return AUTO
    if not (rule.has_kind(value) and rule.contains(value)):
        raise InvalidValueError(f"TrainConfig.{name} must be {rule.describe()} or '{AUTO}', got {value!r}")
    return check_value("TrainConfig", name, value, rule)


def _checked_betas(betas: Any) -> tuple[float, float]:
    """Adam's two betas, each in [0, 1), as a tuple."""
    # A JSON round trip gives a list; a string would unpack into characters, so refuse it first.
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise InvalidValueError(f"TrainConfig.betas must be two numbers in [0, 1), got {betas!r}")
    first, second = (check_value("TrainConfig", f"betas[{i}]", b, PROBABILITY) for i, b in enumerate(betas))
    return (first, second)


def parsed_log_to(log_to: Any) -> tuple[str, ...]:
    """``"tensorboard,wandb"`` or ``["tensorboard", "wandb"]`` (a CLI flag / YAML list) as a tuple of known
    targets, each once (:func:`gpt2.train.metrics.make_sinks` reads its targets through it too).
    """
    if isinstance(log_to, str):
        items = [log_to]
    else:
        items = list(log_to or ())
    names = tuple(dict.fromkeys(n.strip().lower() for item in items for n in str(item).split(",") if n.strip()))
    unknown = [n for n in names if n not in LOG_TARGETS]
    if unknown:
        raise InvalidValueError(f"TrainConfig.log_to: unknown target(s) {unknown}; choose from {list(LOG_TARGETS)}")
    return names


# What each numeric TrainConfig field accepts (checked in __post_init__, before anything else).
TRAIN_CONFIG_RULES: dict[str, Range] = {
    "seq_len": POSITIVE_INT,
    "max_steps": POSITIVE_INT,
    "total_batch_size": Range(low=1, integer=True, optional=True),
    "eval_steps": POSITIVE_INT,
    "log_interval": POSITIVE_INT,
    "warmup_steps": NON_NEGATIVE_INT,
    "eval_interval": NON_NEGATIVE_INT,
    "checkpoint_interval": NON_NEGATIVE_INT,
    "keep_last_checkpoints": NON_NEGATIVE_INT,
    "seed": Range(low=0, high=2**32 - 1, integer=True),  # numpy's seed range
    "max_lr": POSITIVE,
    "min_lr": Range(low=0, optional=True),  # None = max_lr / 10; at most max_lr (checked after)
    "weight_decay": NON_NEGATIVE,
    "muon_lr": POSITIVE,
    "muon_weight_decay": NON_NEGATIVE,
    "eps": POSITIVE,
    "grad_clip": Range(low=0, optional=True),  # 0 or None = no clipping
    "peak_flops": Range(low=0, low_open=True, optional=True),  # FLOP/s; None = from the GPU's name
    "memory_limit_gb": Range(low=0, low_open=True, optional=True),
}

RECOVERY_CONFIG_RULES: dict[str, Range] = {
    "max_bad_steps": POSITIVE_INT,
    "max_recoveries": NON_NEGATIVE_INT,
    "lr_factor": Range(low=0, high=1, low_open=True),  # (0, 1]; 1 = go back and skip data only
    "divergence_factor": Range(low=1, low_open=True),  # > 1: above the best loss
    "patience": POSITIVE_INT,
}

# The fields that take one of a few values: what they accept, and how the error message says it.
TRAIN_CONFIG_CHOICES: dict[str, tuple[tuple[Any, ...], str]] = {
    "precision": (PRECISIONS, f"one of {PRECISIONS}"),
    "optimizer": (OPTIMIZERS, f"one of {OPTIMIZERS}"),
    "strategy": (STRATEGIES, f"one of {STRATEGIES}"),
    "fused_adamw": (("auto", True, False), "'auto', True or False"),
}
