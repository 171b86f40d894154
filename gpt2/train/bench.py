"""The speed-up ladder: one training configuration per rung, each adding one optimisation to the rungs above it
(:data:`RUNGS`): fp32 (explicit softmax attention, vocab 50257, for-each AdamW), TF32 matmuls (CUDA only), bf16
autocast, ``torch.compile``, flash attention (SDPA), the vocabulary padded to 50304, fused AdamW.

Every rung builds a fresh model from one seed and times :meth:`gpt2.train.trainer.Trainer.train_step`
itself (data, forward, backward, clipping, optimizer step) after ``warmup`` untimed steps, in
``repeats`` blocks of ``steps``: ms/step is the median of the blocks' medians and ``spread`` is
(slowest - fastest block) / median, so a busy machine shows as a large spread, not a wrong number.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gpt2.errors import InvalidValueError
from gpt2.model.config import GPTConfig
from gpt2.model.gpt import GPT
from gpt2.train.config import RecoveryConfig, TrainConfig
from gpt2.train.distributed import uses_cuda
from gpt2.train.metrics import mfu as model_flops_utilisation

RUNGS = ("fp32", "tf32", "bf16", "compile", "flash", "vocab_pad", "fused_adamw")


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


def rung_settings(rung: str) -> dict[str, Any]:
    """The cumulative settings of ``rung``: everything up to and including it is switched on."""
    if rung not in RUNGS:
        raise InvalidValueError(f"unknown rung {rung!r}; choose from {RUNGS}")
    on = set(RUNGS[: RUNGS.index(rung) + 1])
    return {
        # The precision rungs come in this order: the last one switched on is the step's precision.
        "precision": [name for name in ("fp32", "tf32", "bf16") if name in on][-1],
        "compile": "compile" in on,
        "flash": "flash" in on,
        "pad_vocab_multiple": 64 if "vocab_pad" in on else 1,
        "fused_adamw": "fused_adamw" in on,
    }


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

    ``compile=None`` compiles on CUDA and skips the compile rung elsewhere (compiling on a CPU takes longer than the
    whole smoke run; pass True to force it); with ``compile=False`` the later rungs run without compilation.
    ``vocab_size`` overrides GPT-2's 50257 (a smaller vocabulary keeps CPU smoke runs fast; vocab_pad still rounds it up
    to a multiple of 64). ``on_result`` is called after each rung.
    """
    rungs = RUNGS if rungs is None else rungs
    # every name checked before the first rung runs
    ladder = [(rung, rung_settings(rung)) for rung in rungs]
    if steps < 1 or warmup < 0 or repeats < 1:
        raise InvalidValueError(
            f"steps and repeats must be >= 1 and warmup >= 0, got steps={steps}, repeats={repeats}, warmup={warmup}"
        )
    # the Trainer refuses a seq_len beyond its block_size
    base = GPTConfig.from_name(model)
    if vocab_size is not None:
        base = dataclasses.replace(base, vocab_size=vocab_size)
    if compile is None:
        compile = uses_cuda(device)
    n_steps = steps * repeats + warmup
    # One token stream for every rung; random ids are enough to time a step.
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, base.vocab_size, (n_steps * batch_size * seq_len + 1,), generator=generator)
    # Each rung trains with this configuration and its own precision, compile and fused AdamW.
    config = TrainConfig(
        micro_batch_size=batch_size,
        seq_len=seq_len,
        max_steps=n_steps,
        device=device,
        out_dir=None,
        progress=False,
        eval_interval=0,
        peak_flops=peak_flops,
        seed=0,
        # random tokens: a skipped step would still be timed honestly
        recovery=RecoveryConfig(max_bad_steps=n_steps),
    )
    results = []
    for rung, settings in ladder:
        result = _run_rung(rung, settings, base, config, tokens, compile=compile, repeats=repeats, warmup=warmup)
        results.append(result)
        if on_result:
            on_result(result)
    return results


def _run_rung(
    rung: str,
    settings: dict[str, Any],
    base: GPTConfig,
    config: TrainConfig,
    tokens: torch.Tensor,
    *,
    compile: bool,
    repeats: int,
    warmup: int,
) -> RungResult:
    """One rung of :func:`run_ladder` with its :func:`rung_settings`, or skipped: ``config.max_steps`` steps of a new
    model (``base`` with the rung's attention and vocabulary padding), the ``repeats`` blocks of steps after
    ``warmup`` timed (with a note where the rung differs from its name).
    """
    # the benchmark drives the Trainer itself
    from gpt2.train.trainer import Trainer

    settings["compile"] = settings["compile"] and compile
    if rung == "compile" and not compile:
        return RungResult(rung, settings, skipped=True, note="skipped: compiling on a CPU is slow (--compile times it)")
    gpt_config = dataclasses.replace(base, flash=settings["flash"], pad_vocab_multiple=settings["pad_vocab_multiple"])
    config = dataclasses.replace(config, **{name: settings[name] for name in ("precision", "compile", "fused_adamw")})
    on_cuda = uses_cuda(config.device)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    steps = (config.max_steps - warmup) // repeats
    # the same initial weights for every rung
    torch.manual_seed(0)
    # The Trainer's set-up lines (INFO) for every rung would bury the table; warnings still show.
    library = logging.getLogger("gpt2")
    level = library.level
    library.setLevel(logging.WARNING)
    try:
        trainer = Trainer(GPT(gpt_config), config, tokens, sinks=[])
        records = [trainer.train_step() for _ in range(config.max_steps)][warmup:]
        flops_per_token, peak = trainer.flops_per_token, trainer.peak_flops
        memory = None
        if on_cuda:
            memory = torch.cuda.max_memory_allocated() / 2**30
        del trainer
    finally:
        library.setLevel(level)
        gc.collect()
        # a no-op where CUDA was never initialised
        torch.cuda.empty_cache()
    step_ms = [r["dt_ms"] for r in records]
    # the median ignores an occasional hiccup (GC, other processes) inside a repeat
    repeat_ms = [statistics.median(step_ms[i * steps : (i + 1) * steps]) for i in range(repeats)]
    ms = statistics.median(repeat_ms)
    tokens_per_second = config.micro_batch_size * config.seq_len / (ms / 1000.0)
    note = ""
    if not compile and RUNGS.index(rung) > RUNGS.index("compile"):
        note = "without compile"
    if rung == "tf32" and not on_cuda:
        note = "TF32 is CUDA-only: same as fp32 here"
    return RungResult(
        rung,
        settings,
        ms_per_step=ms,
        tokens_per_second=tokens_per_second,
        mfu=model_flops_utilisation(flops_per_token, tokens_per_second, peak),
        loss=records[-1]["loss"],
        note=note,
        step_ms=step_ms,
        repeat_ms=repeat_ms,
        spread=(max(repeat_ms) - min(repeat_ms)) / ms,
        peak_memory_gib=memory,
    )


SPREAD_WARNING = 0.10  # repeats further apart than this get a note under the table


def format_table(results: Sequence[RungResult], title: str | None = None) -> str:
    """A markdown table to paste into an issue: ``title`` (device, torch version, shape) first, then per rung ms/step
    (median of the repeats), their spread, tokens/s, MFU, peak CUDA memory and speed-up over the first timed rung; then
    a note naming rungs whose repeats disagree by more than 10%.
    """
    lines = []
    if title:
        lines += [title, ""]
    lines += [
        "| rung | ms/step | spread | tokens/s | MFU | peak memory | speed-up | note |",
        "|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    baseline = next((r.ms_per_step for r in results if r.ms_per_step is not None), None)
    lines += [_table_row(r, baseline) for r in results]
    return "\n".join(lines + _table_notes(results))


def _table_row(r: RungResult, baseline: float) -> str:
    """One rung's row of :func:`format_table`; an empty cell where a number is unknown."""
    if r.skipped or r.ms_per_step is None:
        return f"| {r.rung} | - | | - | | | | {r.note} |"
    # a timed row: the first timed rung's ms/step is its baseline
    cells = {"mfu": "", "memory": "", "speedup": f"{baseline / r.ms_per_step:.2f}x", "spread": ""}
    if r.mfu is not None:
        cells["mfu"] = f"{100 * r.mfu:.1f}%"
    if r.peak_memory_gib is not None:
        cells["memory"] = f"{r.peak_memory_gib:.1f} GiB"
    # a spread means something only between two repeats or more
    if len(r.repeat_ms) > 1:
        cells["spread"] = f"{100 * r.spread:.0f}%"
    return (
        f"| {r.rung} | {r.ms_per_step:.1f} | {cells['spread']} | {r.tokens_per_second:,.0f} | {cells['mfu']} "
        f"| {cells['memory']} | {cells['speedup']} | {r.note} |"
    )


def _table_notes(results: Sequence[RungResult]) -> list[str]:
    """The lines under the table: how ms/step was taken, and which rungs' repeats disagree."""
    notes = []
    repeats = max((len(r.repeat_ms) for r in results), default=0)
    if repeats > 1:
        notes.append(f"\nms/step: median of {repeats} repeats; spread: (slowest - fastest repeat) / median")
    noisy = [r.rung for r in results if len(r.repeat_ms) > 1 and r.spread > SPREAD_WARNING]
    if noisy:
        notes.append(
            f"note: the repeats of {', '.join(noisy)} differ by more than {100 * SPREAD_WARNING:.0f}%: the machine "
            "was busy or the clock varied; treat those rows as rough, or rerun with more --steps / --repeats"
        )
    return notes
