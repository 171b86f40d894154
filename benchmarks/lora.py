"""LoRA fine-tuning step benchmark: minlora against PEFT on the same ``gpt2.GPT``.

Every implementation adapts the same randomly initialised base model (same seed) with the same
rank, alpha and target layers, and runs the same step (forward, backward, AdamW on the LoRA
factors) on the same batch:

* ``minlora``: :func:`minlora.add_lora` with the fast path (``x W^T + ((x A^T) s) B^T``);
* ``minlora-plain``: the same adapters through the plain parametrization (``module.weight =
  W + s B A`` rebuilt on every forward), i.e. what minLoRA does;
* ``peft``: ``peft.inject_adapter_in_model`` on the same ``gpt2.GPT`` (PEFT wraps each
  ``nn.Linear`` in its ``lora.Linear``), so the base model and its attention kernels are identical.

``examples/benchmark_lora.py`` is the command line over :func:`run_lora_benchmark`. This file lives
outside the installed packages (it builds ``gpt2`` models; ``minlora`` itself never imports
``gpt2``): import it with the repository root on ``sys.path`` (``from benchmarks.lora import ...``).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn

IMPLEMENTATIONS = ("minlora", "minlora-plain", "peft")
PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

__all__ = [
    "IMPLEMENTATIONS",
    "BenchResult",
    "model_config",
    "build_lora_model",
    "time_training_steps",
    "run_lora_benchmark",
    "format_results",
]


@dataclass
class BenchResult:
    impl: str
    # median wall time of one optimizer step (over all timed steps of all rounds)
    step_ms: float
    tokens_per_second: float
    # torch.cuda.max_memory_allocated over the timed steps; None off CUDA
    peak_memory_mib: float | None
    trainable_params: int
    # equal across implementations: every adapter starts as a no-op (B = 0)
    first_loss: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_config(name: str, seq_len: int):
    """One of the library's named shapes (``gpt2`` = 124M, ``mini``, ``tiny``, ...; ``gpt2.config.SHAPES``)
    with GPT-2's vocabulary padded to 50304.
    """
    from gpt2.model.config import SHAPES, GPTConfig

    if name not in SHAPES:
        raise ValueError(f"unknown benchmark model {name!r}; use one of {', '.join(SHAPES)}")
    context = 256
    if name.startswith("gpt2"):
        context = 1024
    return GPTConfig(block_size=max(context, seq_len), pad_vocab_multiple=64, **SHAPES[name])


def build_lora_model(
    impl: str,
    config,
    *,
    rank: int,
    alpha: float,
    targets: Sequence[str],
    dropout: float,
    base_dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> nn.Module:
    """A randomly initialised ``gpt2.GPT`` (seeded) carrying ``impl``'s LoRA, only LoRA trainable."""
    from gpt2.model.gpt import GPT

    torch.manual_seed(seed)
    model = GPT(config).to(device=device, dtype=base_dtype)
    if impl in ("minlora", "minlora-plain"):
        from minlora import LoRAConfig, add_lora, mark_only_lora_as_trainable, set_fast_path

        add_lora(model, LoRAConfig(rank=rank, alpha=alpha, dropout=dropout, target_modules=tuple(targets)))
        mark_only_lora_as_trainable(model)
        set_fast_path(model, impl == "minlora")
    elif impl == "peft":
        try:
            import peft
        except ImportError as e:  # pragma: no cover - peft is a dev dependency
            raise RuntimeError("the 'peft' implementation needs `pip install peft`") from e
        peft_config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets))
        model = peft.inject_adapter_in_model(peft_config, model)
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
            # fp32 factors on a low-precision base, as minlora keeps them
            if "lora_" in name:
                p.data = p.data.float()
    else:
        raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLEMENTATIONS}")
    return model.train()


def time_training_steps(
    model: nn.Module,
    *,
    batch_size: int,
    seq_len: int,
    precision: str,
    steps: int,
    warmup: int,
    device: torch.device,
    vocab_size: int,
    seed: int,
    compile: bool = False,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[float], float | None, float]:
    """Run ``warmup`` then ``steps`` LoRA training steps; returns (step seconds, peak MiB or None, first loss).
    ``progress`` (if given) gets a line when the warm-up (where compilation happens) is done.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda" or None)
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = None
    if precision == "fp16":
        scaler = torch.amp.GradScaler(device.type)
    step_model = model
    if compile:
        step_model = torch.compile(model)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator).to(device)
    y = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator).to(device)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        ctx = contextlib.nullcontext()
        if autocast_dtype:
            ctx = torch.autocast(device.type, dtype=autocast_dtype)
        with ctx:
            _, loss = step_model(x, y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        return loss.detach()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    t_warm = time.perf_counter()
    first_loss = float(step())
    for _ in range(max(0, warmup - 1)):
        step()
    sync()
    if progress is not None:
        progress(f"warm-up done in {time.perf_counter() - t_warm:.1f} s; timing {steps} step(s)")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    peak = None
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    return times, peak, first_loss


def run_lora_benchmark(
    impls: Sequence[str] = IMPLEMENTATIONS,
    *,
    model: Any = "tiny",
    batch_size: int = 8,
    seq_len: int = 128,
    precision: str = "fp32",
    base_dtype: str = "fp32",
    steps: int = 10,
    warmup: int = 3,
    compile: bool = False,
    device: str = "auto",
    rank: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    targets: Sequence[str] = ("c_attn", "c_proj", "c_fc"),
    seed: int = 0,
    repeats: int = 1,
    progress: Callable[[str], None] | None = None,
) -> list[BenchResult]:
    """Benchmark each implementation (``repeats`` rounds, a fresh model per run); the step time is
    the median over all timed steps of all rounds, the peak memory the largest of the rounds.

    ``progress`` gets a one-line status before and after every run (default: printed to stderr,
    so a long benchmark is never silent; pass ``lambda line: None`` to silence it).
    """
    if progress is None:

        def progress(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    _check_run_settings(base_dtype, steps, repeats)
    # a shape's name or a GPTConfig
    config = model
    if isinstance(model, str):
        config = model_config(model, seq_len)
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    peaks: dict[str, float | None] = {}
    first: dict[str, tuple[float, int]] = {}
    # Rounds visit the implementations in turn, so slow drifts of a shared machine's load hit all
    # of them alike; each run builds a fresh model and frees it, so peak memory is its own.
    runs, done = repeats * len(impls), 0
    for round_index in range(repeats):
        for impl in impls:
            label = f"[{done + 1}/{runs}] {impl} (round {round_index + 1}/{repeats}, {precision}, {dev.type})"
            progress(f"{label}: building the model, then {warmup} warm-up + {steps} timed steps...")
            t_run = time.perf_counter()
            net = build_lora_model(
                impl,
                config,
                rank=rank,
                alpha=alpha,
                targets=targets,
                dropout=dropout,
                base_dtype=_DTYPES[base_dtype],
                device=dev,
                seed=seed,
            )
            run_times, peak, first_loss = time_training_steps(
                net,
                batch_size=batch_size,
                seq_len=seq_len,
                precision=precision,
                steps=steps,
                warmup=warmup,
                device=dev,
                vocab_size=config.vocab_size,
                seed=seed,
                compile=compile,
                progress=lambda line, label=label: progress(f"{label}: {line}"),
            )
            times[impl] += run_times
            done += 1
            progress(
                f"{label}: median step {statistics.median(run_times) * 1000:,.1f} ms "
                f"({time.perf_counter() - t_run:.1f} s for the run)"
            )
            if peak is not None:
                peaks[impl] = max(peak, peaks.get(impl) or 0.0)
            first.setdefault(impl, (first_loss, sum(p.numel() for p in net.parameters() if p.requires_grad)))
            del net
            _release_memory(dev, compile)
    return [
        _result(impl, times[impl], peaks.get(impl), *first[impl], tokens_per_step=batch_size * seq_len)
        for impl in impls
    ]


def _check_run_settings(base_dtype: str, steps: int, repeats: int) -> None:
    if base_dtype not in _DTYPES:
        raise ValueError(f"base_dtype must be one of {sorted(_DTYPES)}, got {base_dtype!r}")
    if steps < 1 or repeats < 1:
        raise ValueError(f"steps and repeats must be >= 1, got steps={steps}, repeats={repeats}")


def _release_memory(device: torch.device, compiled: bool) -> None:
    """Free what a finished run held (its model already deleted), so the next run's peak is its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if compiled:
        torch.compiler.reset()


def _result(
    impl: str, times: list[float], peak: float | None, first_loss: float, trainable: int, *, tokens_per_step: int
) -> BenchResult:
    step_s = statistics.median(times)
    return BenchResult(
        impl=impl,
        step_ms=step_s * 1000,
        tokens_per_second=tokens_per_step / step_s,
        peak_memory_mib=peak,
        trainable_params=trainable,
        first_loss=first_loss,
    )


def format_results(results: Sequence[BenchResult]) -> str:
    """A markdown table of the results."""
    lines = [
        "| implementation | step (ms) | tokens/s | peak memory (MiB) | trainable params | loss at step 1 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        peak = "n/a (CPU)"
        if r.peak_memory_mib is not None:
            peak = f"{r.peak_memory_mib:,.0f}"
        lines.append(
            f"| {r.impl} | {r.step_ms:,.1f} | {r.tokens_per_second:,.0f} | {peak} | {r.trainable_params:,} | "
            f"{r.first_loss:.4f} |"
        )
    return "\n".join(lines)
