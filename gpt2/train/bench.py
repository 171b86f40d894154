"""The speed-up ladder: one training configuration per rung, each adding one optimisation.

====================  =====================================================================
rung                  adds (on top of every rung above it)
====================  =====================================================================
``fp32``              baseline: fp32 matmuls, explicit softmax attention, vocab 50257, for-each AdamW
``tf32``              TF32 tensor-core matmuls (CUDA only; the same as fp32 on CPU)
``bf16``              bf16 autocast (fp32 master weights)
``compile``           ``torch.compile``
``flash``             ``F.scaled_dot_product_attention`` (flash attention kernels on GPUs)
``vocab_pad``         vocabulary padded to a multiple of 64 (50257 -> 50304)
``fused_adamw``       the fused AdamW kernel
====================  =====================================================================

Every rung builds a fresh model from the same seed and times :meth:`gpt2.trainer.Trainer.train_step`
itself (data loading, forward, backward, clipping, optimizer step), so the numbers are the
Trainer's own. The first ``warmup`` steps (which include compilation) are not timed. The timed
steps come in ``repeats`` blocks of ``steps``: a rung's ms/step is the median of the blocks'
medians and its ``spread`` is (slowest - fastest block) / median, so a busy machine shows up
as a large spread instead of as a quietly wrong number.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gpt2.model.config import SHAPES, GPTConfig
from gpt2.model.gpt import GPT
from gpt2.train.config import TrainConfig
from gpt2.train.distributed import uses_cuda
from gpt2.train.metrics import mfu as model_flops_utilisation

logger = logging.getLogger(__name__)

RUNGS = ("fp32", "tf32", "bf16", "compile", "flash", "vocab_pad", "fused_adamw")

# Shapes for the ladder: the GPT-2 presets, and "tiny" for CPU smoke runs (GPT-2's vocabulary, so
# the vocab_pad rung still pads 50257 to 50304).


@dataclass
class RungResult:
    rung: str
    settings: dict[str, Any]
    ms_per_step: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    loss: float | None = None  # loss of the last timed step (a sanity check: all rungs learn alike)
    note: str = ""
    skipped: bool = False
    step_ms: list[float] = field(default_factory=list)  # every timed step, all repeats
    repeat_ms: list[float] = field(default_factory=list)  # median ms/step of each repeat
    spread: float | None = None  # (max - min) / median of repeat_ms; 0.1 = the repeats differ by 10%
    peak_memory_gib: float | None = None  # torch.cuda.max_memory_allocated over the rung; None off CUDA

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def rung_settings(rung: str) -> dict[str, Any]:
    """The cumulative settings of ``rung``: everything up to and including it is switched on."""
    if rung not in RUNGS:
        raise ValueError(f"unknown rung {rung!r}; choose from {RUNGS}")
    on = set(RUNGS[: RUNGS.index(rung) + 1])
    return {
        "precision": "bf16" if "bf16" in on else ("tf32" if "tf32" in on else "fp32"),
        "compile": "compile" in on,
        "flash": "flash" in on,
        "pad_vocab_multiple": 64 if "vocab_pad" in on else 1,
        "fused_adamw": "fused_adamw" in on,
    }


def model_config(model: str, **overrides: Any) -> GPTConfig:
    if model not in SHAPES:
        raise ValueError(f"unknown model {model!r}; choose from {sorted(SHAPES)}")
    return GPTConfig(**{**SHAPES[model], **overrides})


def run_ladder(
    model: str = "gpt2",
    *,
    batch_size: int = 16,
    seq_len: int = 1024,
    steps: int = 20,
    warmup: int = 5,
    repeats: int = 3,
    rungs: Sequence[str] | None = None,
    device: str = "auto",
    compile: bool | None = None,
    peak_flops: float | None = None,
    vocab_size: int | None = None,
    on_result: Callable[[RungResult], None] | None = None,
) -> list[RungResult]:
    """Time ``repeats`` blocks of ``steps`` training steps (after ``warmup`` untimed ones) for each rung.

    ``compile=None`` compiles on CUDA and skips the compile rung elsewhere (compiling on a CPU
    takes longer than the whole smoke run; pass True to force it); with ``compile=False`` the
    later rungs run without compilation. ``vocab_size`` overrides GPT-2's 50257 (a smaller
    vocabulary keeps CPU smoke runs fast; vocab_pad still rounds it up to a multiple of 64).
    ``on_result`` is called after each rung.
    """
    from gpt2.train.trainer import Trainer  # the benchmark drives the Trainer itself

    rungs = list(RUNGS if rungs is None else rungs)
    for rung in rungs:
        rung_settings(rung)  # validates the name
    if steps < 1 or warmup < 0 or repeats < 1:
        raise ValueError(
            f"steps and repeats must be >= 1 and warmup >= 0, got steps={steps}, repeats={repeats}, warmup={warmup}"
        )
    shape = {"vocab_size": vocab_size} if vocab_size is not None else {}
    base = model_config(model, **shape)
    if seq_len > base.block_size:
        raise ValueError(f"seq_len={seq_len} exceeds {model}'s block_size={base.block_size}")
    resolved_device = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    if compile is None:
        compile = resolved_device.type == "cuda"
    # One token stream for every rung; random ids are enough to time a step.
    generator = torch.Generator().manual_seed(0)
    n_steps = steps * repeats + warmup
    tokens = torch.randint(0, base.vocab_size, (n_steps * batch_size * seq_len + 1,), generator=generator)

    results = []
    for rung in rungs:
        settings = rung_settings(rung)
        if settings["compile"] and not compile:
            settings["compile"] = False
            if rung == "compile":
                result = RungResult(
                    rung, settings, skipped=True, note="compile disabled (CPU default; pass compile=True)"
                )
                results.append(result)
                if on_result:
                    on_result(result)
                continue
        result = _time_rung(
            Trainer,
            model,
            shape,
            rung,
            settings,
            tokens,
            batch_size,
            seq_len,
            steps,
            warmup,
            repeats,
            device,
            peak_flops,
        )
        if not compile and RUNGS.index(rung) > RUNGS.index("compile"):
            result.note = "without compile"
        if rung == "tf32" and resolved_device.type != "cuda":
            result.note = "TF32 is CUDA-only: same as fp32 here"
        results.append(result)
        if on_result:
            on_result(result)
    return results


@contextlib.contextmanager
def _quiet_library():
    """The Trainer's set-up lines (INFO) for every rung would bury the table; warnings still show."""
    library = logging.getLogger("gpt2")
    level = library.level
    library.setLevel(logging.WARNING)
    try:
        yield
    finally:
        library.setLevel(level)


def _time_rung(
    Trainer, model, shape, rung, settings, tokens, batch_size, seq_len, steps, warmup, repeats, device, peak_flops
):
    with _quiet_library():
        records, flops_per_token, peak, memory = _run_rung(
            Trainer, model, shape, settings, tokens, batch_size, seq_len, steps * repeats + warmup, device, peak_flops
        )
    records = records[warmup:]
    step_ms = [r["dt_ms"] for r in records]
    # the median ignores an occasional hiccup (GC, other processes) inside a repeat
    repeat_ms = [statistics.median(step_ms[i * steps : (i + 1) * steps]) for i in range(repeats)]
    ms = statistics.median(repeat_ms)
    tokens_per_second = batch_size * seq_len / (ms / 1000.0)
    mfu = model_flops_utilisation(flops_per_token, tokens_per_second, peak)
    logger.debug("rung %s: %.1f ms/step, %s tok/s", rung, ms, f"{tokens_per_second:,.0f}")
    return RungResult(
        rung,
        settings,
        ms_per_step=ms,
        tokens_per_second=tokens_per_second,
        mfu=mfu,
        loss=records[-1]["loss"],
        step_ms=step_ms,
        repeat_ms=repeat_ms,
        spread=(max(repeat_ms) - min(repeat_ms)) / ms,
        peak_memory_gib=memory,
    )


def _run_rung(Trainer, model, shape, settings, tokens, batch_size, seq_len, n_steps, device, peak_flops):
    """Per-step records of ``n_steps`` steps of a fresh model with ``settings``, FLOPs per token,
    peak FLOP/s and peak CUDA memory in GiB (None off CUDA)."""
    on_cuda = uses_cuda(device)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)  # the same initial weights for every rung
    gpt = GPT(model_config(model, **shape, flash=settings["flash"], pad_vocab_multiple=settings["pad_vocab_multiple"]))
    config = TrainConfig(
        micro_batch_size=batch_size,
        seq_len=seq_len,
        max_steps=n_steps,
        precision=settings["precision"],
        compile=settings["compile"],
        fused_adamw=settings["fused_adamw"],
        device=device,
        out_dir=None,
        progress=False,
        eval_interval=0,
        peak_flops=peak_flops,
        seed=0,
        max_bad_steps=n_steps,  # random tokens: a skipped step would still be timed honestly
    )
    trainer = Trainer(gpt, config, tokens, sinks=[])
    try:
        records = [trainer.train_step() for _ in range(n_steps)]
        flops_per_token, peak = trainer.flops_per_token, trainer.peak_flops
        memory = torch.cuda.max_memory_allocated() / 2**30 if on_cuda else None
    finally:
        del trainer, gpt
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return records, flops_per_token, peak, memory


SPREAD_WARNING = 0.10  # repeats further apart than this get a note under the table


def format_table(results: Sequence[RungResult], title: str | None = None) -> str:
    """A markdown table to paste into an issue: ``title`` (device, torch version, shape) first,
    then per rung ms/step (median of the repeats), their spread, tokens/s, MFU, peak CUDA memory
    and speed-up over the first timed rung; then a note naming rungs whose repeats disagree by
    more than 10%."""
    lines = [title, ""] if title else []
    lines += [
        "| rung | ms/step | spread | tokens/s | MFU | peak memory | speed-up | note |",
        "|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    baseline = next((r.ms_per_step for r in results if r.ms_per_step), None)
    for r in results:
        if r.skipped or r.ms_per_step is None:
            lines.append(f"| {r.rung} | - | | - | | | | {r.note} |")
            continue
        mfu = f"{100 * r.mfu:.1f}%" if r.mfu is not None else ""
        speedup = f"{baseline / r.ms_per_step:.2f}x" if baseline else ""
        spread = f"{100 * r.spread:.0f}%" if r.spread is not None and len(r.repeat_ms) > 1 else ""
        memory = f"{r.peak_memory_gib:.1f} GiB" if r.peak_memory_gib is not None else ""
        lines.append(
            f"| {r.rung} | {r.ms_per_step:.1f} | {spread} | {r.tokens_per_second:,.0f} | {mfu} | {memory} "
            f"| {speedup} | {r.note} |"
        )
    noisy = [r.rung for r in results if r.spread is not None and len(r.repeat_ms) > 1 and r.spread > SPREAD_WARNING]
    repeats = max((len(r.repeat_ms) for r in results), default=0)
    if repeats > 1:
        lines.append(f"\nms/step: median of {repeats} repeats; spread: (slowest - fastest repeat) / median")
    if noisy:
        lines.append(
            f"note: the repeats of {', '.join(noisy)} differ by more than {100 * SPREAD_WARNING:.0f}%: the machine "
            "was busy or the clock varied; treat those rows as rough, or rerun with more --steps / --repeats"
        )
    return "\n".join(lines)
