"""The bf16 training step's casts and copies: how many, the bytes they write, and the CPU time of the
non-matmul ops, per optimizer step of ``gpt2.train.trainer.Trainer.train_step()`` with ``precision="bf16"``.

On an Intel Xeon with AMX the bf16 step of GPT-2 124M ran at 20-25% of the bf16 matmul rate, with casts and copies
12.5% of its time. Where bf16 matmuls are emulated (CPUs without AMX or AVX512-BF16, as the AVX2 machine these
numbers were first taken on) the step's total time says nothing about that goal, but the number of casts and copies
and the bytes they write do not depend on the CPU: they are counted here, from ``torch.profiler``'s events of one
step (after ``--warmup`` untimed steps), on one thread:

- ``aten::to`` / ``aten::_to_copy`` / ``aten::copy_`` calls. A cast is ``to`` -> ``_to_copy`` -> ``copy_``; the
  ``copy_`` calls outside a ``_to_copy`` are plain copies (into a buffer, a bias into ``addmm``'s output). Bytes are
  what each ``copy_`` writes (its destination's elements x their size).
- the casts by direction (fp32 -> bf16, bf16 -> fp32, other: integer and scalar casts) and by phase: forward,
  backward (inside the autograd engine), optimizer (inside ``Optimizer.step`` / ``zero_grad``).
- the time of the ops, grouped: matmuls (emulated in bf16 on CPUs without native bf16: not meaningful there), casts,
  copies, loss (the rest of the fused linear + cross-entropy, softmax included), attention, GELU, LayerNorm,
  optimizer and clipping, other. Twice: the profiler's self time of each op (its clock is the wall clock: on a
  shared machine the time other jobs take the core is counted too), and the CPU time (``time.process_time``) of each
  aten op in one more step, timed by a ``TorchDispatchMode`` (it sees the ops below autograd, each once: a cast is
  one ``_to_copy``; the loss and the optimizer are told by the Python functions they run in). The CPU times are the
  ones to compare; on a busy machine they still move by tens of percent (shared caches and cores).

``--top N`` lists the N cast and copy sites (op, the op that called it, dtypes, destination shape) that write the
most bytes. ``--shape small`` (the default) is 4 layers x 128 wide with GPT-2's vocabulary 50257, B=4, T=128 (tens of
seconds a step where bf16 is emulated); ``--shape 124m`` is GPT-2 124M at B=4, T=256: there one emulated bf16 step
takes many minutes (about 10 per micro-step on a 2-core AVX2 EPYC, estimated from B=1, T=16), x ``--accum``.
``--batch`` and ``--seq-len`` change the micro-batch: ``--shape 124m --batch 1 --seq-len 16`` makes the same casts of
the same weights as B=4, T=256 (the loss's 1024 rows are one chunk either way), with 64x fewer activation and logit
bytes, in about 10 s of CPU time a micro-step.

    PYTHONPATH=. python benchmarks/bf16_casts.py [--shape small|124m] [--accum 1,4] [--batch B] [--seq-len T] [--top 20]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

# the documented way to see every aten op as it runs; a benchmark, not the library, so the private module path is
# acceptable here (as in benchmarks/step_vs_peers.py)
from torch.utils._python_dispatch import TorchDispatchMode

from gpt2.model.config import SHAPES, GPTConfig
from gpt2.model.gpt import GPT
from gpt2.train.config import RecoveryConfig, TrainConfig
from gpt2.train.precision import describe_machine
from gpt2.train.trainer import Trainer

# (model shape, micro-batch, sequence length, vocabulary); "tiny" is for the smoke test
BENCH_SHAPES = {
    "small": ("mini", 4, 128, 50257),
    "124m": ("gpt2", 4, 256, 50257),
    "tiny": ("tiny", 2, 16, 256),
}
# the sizes of the dtypes as the profiler names them
DTYPE_BYTES = {
    "float": 4,
    "double": 8,
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "bool": 1,
    "signed char": 1,
    "unsigned char": 1,
}
SHORT_DTYPES = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16", "double": "fp64", "long int": "int64"}
MATMULS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"}
CASTS = {"aten::to", "aten::_to_copy"}
# the ops that are the work of a scope, by the name of the scope's event (a prefix)
SCOPES = {
    "_LinearCrossEntropy": "loss",
    "aten::scaled_dot_product_attention": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention",
    "Optimizer.": "optimizer+clip",
}
# the ops that are a group's wherever they run
NAMED = {
    "aten::gelu": "GELU",
    "aten::gelu_backward": "GELU",
    "aten::native_layer_norm": "LayerNorm",
    "aten::native_layer_norm_backward": "LayerNorm",
    "aten::_softmax": "loss",
    "aten::_log_softmax": "loss",
    "aten::logsumexp": "loss",
    # clip_grad_norm_
    "aten::_foreach_norm": "optimizer+clip",
    "aten::linalg_vector_norm": "optimizer+clip",
    "aten::_foreach_mul_": "optimizer+clip",
}
GROUPS = ("casts", "copies", "loss", "attention", "GELU", "LayerNorm", "optimizer+clip", "other")
# the same groups for the ops a TorchDispatchMode sees (below autograd: one op per cast, no wrappers)
DISPATCH_MATMULS = {"mm", "addmm", "addmm_", "bmm", "baddbmm"}
DISPATCH_NAMED = {
    "_to_copy": "casts",
    "copy_": "copies",
    "_scaled_dot_product_flash_attention_for_cpu": "attention",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "attention",
    "_softmax": "loss",
    "_log_softmax": "loss",
    "logsumexp": "loss",
    "gelu": "GELU",
    "gelu_backward": "GELU",
    "native_layer_norm": "LayerNorm",
    "native_layer_norm_backward": "LayerNorm",
}
# the Python code an op runs under, by the start of its function's qualified name or its file
DISPATCH_SCOPES = (
    ("_LinearCrossEntropy.", "loss"),
    ("torch/optim/", "optimizer+clip"),
    ("clip_grad", "optimizer+clip"),
)


@dataclass
class StepCounts:
    """What one profiled step did: calls per op, bytes written by copies, casts by kind, CPU time by group."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    casts: Counter = field(default_factory=Counter)
    cast_bytes: Counter = field(default_factory=Counter)
    sites: Counter = field(default_factory=Counter)
    site_bytes: Counter = field(default_factory=Counter)
    group_us: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    matmul_us: float = 0.0
    step_cpu_s: float = 0.0
    cpu_seconds: dict[str, float] = field(default_factory=dict)


def ancestors(event) -> list[str]:
    names = []
    parent = event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return names


def written_bytes(event) -> int:
    """What a ``copy_`` writes: its destination (the first input) in its dtype."""
    shape, dtype = event.input_shapes[0], event.input_dtypes[0]
    return int(torch.Size(shape).numel()) * DTYPE_BYTES.get(dtype, 4)


def phase(chain: list[str]) -> str:
    if any(name.startswith("Optimizer.") for name in chain):
        return "optimizer"
    if any(name.startswith("autograd::engine::evaluate_function") for name in chain):
        return "backward"
    return "forward"


def group(event, chain: list[str]) -> str:
    """The group of an op's self time (matmuls are counted apart)."""
    name = event.name
    if name in CASTS or (name in ("aten::copy_", "aten::empty_strided") and chain[:1] == ["aten::_to_copy"]):
        return "casts"
    if name == "aten::copy_":
        return "copies"
    for scope_name in chain:
        for prefix, scope in SCOPES.items():
            if scope_name.startswith(prefix):
                return scope
    for prefix, scope in SCOPES.items():
        if name.startswith(prefix):
            return scope
    return NAMED.get(name, "other")


def count_copy(counts: StepCounts, event, chain: list[str]) -> None:
    written = written_bytes(event)
    counts.bytes[event.name] += written
    dst, src = (SHORT_DTYPES.get(d, d) for d in event.input_dtypes[:2])
    if chain[:1] == ["aten::_to_copy"]:
        # the copy_ inside a cast: the cast's kind and where it was called from
        kind = f"{src} -> {dst}"
        if kind not in ("fp32 -> bf16", "bf16 -> fp32"):
            kind = "other"
        key = (kind, phase(chain))
        counts.casts[key] += 1
        counts.cast_bytes[key] += written
        counts.bytes["casts"] += written
        site = ("cast", chain[2] if len(chain) > 2 else "-", f"{src} -> {dst}", str(event.input_shapes[0]))
    else:
        counts.calls["plain copy_"] += 1
        counts.bytes["plain copy_"] += written
        site = ("copy_", chain[0] if chain else "-", f"{src} -> {dst}", str(event.input_shapes[0]))
    counts.sites[site] += 1
    counts.site_bytes[site] += written


def tally(events) -> StepCounts:
    counts = StepCounts()
    for event in events:
        chain = ancestors(event)
        counts.calls[event.name] += 1
        if event.name == "aten::copy_":
            count_copy(counts, event, chain)
        if event.name in MATMULS:
            counts.matmul_us += event.self_cpu_time_total
        else:
            counts.group_us[group(event, chain)] += event.self_cpu_time_total
    return counts


def python_scope() -> str | None:
    """The group of the Python code running an op: the fused loss, the optimizer or clipping; None elsewhere."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        for marker, scope in DISPATCH_SCOPES:
            if code.co_qualname.startswith(marker) or marker in code.co_filename:
                return scope
        frame = frame.f_back
    return None


class CpuTimeByGroup(TorchDispatchMode):
    """CPU time (``time.process_time``) of every aten op run under it, by group: unlike the profiler's wall
    clock, it does not count the time other jobs on a shared machine take the core.
    """

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[str, float] = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.process_time()
        out = func(*args, **(kwargs or {}))
        seconds = time.process_time() - start
        name = func.overloadpacket.__name__
        if name in DISPATCH_MATMULS:
            self.seconds["matmuls"] += seconds
            return out
        named = DISPATCH_NAMED.get(name)
        if named in ("casts", "copies"):
            self.seconds[named] += seconds
            return out
        self.seconds[python_scope() or named or "other"] += seconds
        return out


@dataclass(frozen=True)
class Run:
    """What one profiled step trains: the model's shape and vocabulary, the micro-batch, the accumulation."""

    model_shape: str
    batch: int
    seq_len: int
    vocab: int
    accum: int


def build_trainer(run: Run) -> Trainer:
    batch, seq_len, vocab, accum = run.batch, run.seq_len, run.vocab, run.accum
    torch.manual_seed(0)
    tokens = torch.randint(0, vocab, (64 * accum * batch * seq_len + 1,), generator=torch.Generator().manual_seed(0))
    config = TrainConfig(
        micro_batch_size=batch,
        seq_len=seq_len,
        total_batch_size=batch * seq_len * accum,
        max_steps=10**6,
        precision="bf16",
        device="cpu",
        out_dir=None,
        progress=False,
        eval_interval=0,
        plot=False,
        seed=0,
        recovery=RecoveryConfig(max_bad_steps=10**6),
    )
    model = GPT(GPTConfig(**SHAPES[run.model_shape], vocab_size=vocab, block_size=seq_len))
    return Trainer(model, config, tokens, sinks=[])


def profile_step(run: Run, warmup: int, cpu_time: bool) -> StepCounts:
    """One bf16 step of a fresh Trainer under torch.profiler, after ``warmup`` steps; with ``cpu_time`` one more
    under :class:`CpuTimeByGroup`.
    """
    trainer = build_trainer(run)
    for _ in range(warmup):
        trainer.train_step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.process_time()
        trainer.train_step()
        step_cpu_s = time.process_time() - start
    counts = tally(prof.events())
    counts.step_cpu_s = step_cpu_s
    if cpu_time:
        timer = CpuTimeByGroup()
        with timer:
            trainer.train_step()
        counts.cpu_seconds = dict(timer.seconds)
    trainer.close()
    return counts


def megabytes(value: float) -> str:
    return f"{value / 1e6:.1f}"


def report(counts: StepCounts, accum: int, top: int) -> None:
    print(f"\ngrad accumulation {accum}: one step, {counts.step_cpu_s:.2f} s CPU time under the profiler")
    print("op | calls | MB written")
    for name in ("aten::to", "aten::_to_copy", "aten::copy_"):
        print(f"{name} | {counts.calls[name]} | {megabytes(counts.bytes[name])}")
    print(f"  copy_ in casts | {sum(counts.casts.values())} | {megabytes(counts.bytes['casts'])}")
    print(f"  plain copy_ | {counts.calls['plain copy_']} | {megabytes(counts.bytes['plain copy_'])}")
    print(
        "casts by kind and phase: "
        + ", ".join(
            f"{kind} {where} {n} ({megabytes(counts.cast_bytes[kind, where])} MB)"
            for (kind, where), n in sorted(counts.casts.items())
        )
    )
    non_matmul = sum(counts.group_us.values())
    print(
        f"profiler self time, ms (wall clock): matmuls {counts.matmul_us / 1e3:.1f}, "
        f"non-matmul {non_matmul / 1e3:.1f}: "
        + ", ".join(f"{name} {counts.group_us.get(name, 0.0) / 1e3:.1f}" for name in GROUPS)
    )
    if counts.cpu_seconds:
        cpu = counts.cpu_seconds
        non_matmul = sum(cpu.values()) - cpu.get("matmuls", 0.0)
        print(
            f"CPU time of one more step's ops, ms: matmuls {cpu.get('matmuls', 0.0) * 1e3:.1f} (emulated where bf16 "
            f"is not native), non-matmul {non_matmul * 1e3:.1f}: "
            + ", ".join(f"{name} {cpu.get(name, 0.0) * 1e3:.1f}" for name in GROUPS)
        )
    if top:
        print(f"top {top} cast / copy sites by bytes: kind | called from | dtypes | destination shape | calls | MB")
        ranked = sorted(counts.sites, key=lambda site: (-counts.site_bytes[site], -counts.sites[site]))
        for site in ranked[:top]:
            print(" | ".join([*site, str(counts.sites[site]), megabytes(counts.site_bytes[site])]))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="--shape 124m (B=4, T=256): one bf16 step takes many minutes (about 10 per micro-step) on a CPU "
        "without AMX / AVX512-BF16, where bf16 matmuls are emulated; --shape 124m --batch 1 --seq-len 16 makes the "
        "same casts of the same weights in seconds (64x fewer activation and logit bytes).",
    )
    parser.add_argument(
        "--shape",
        choices=BENCH_SHAPES,
        default="small",
        help="small: 4 layers x 128, B=4, T=128 (the default); 124m: GPT-2 124M, B=4, T=256",
    )
    parser.add_argument("--accum", default="1,4", help="gradient accumulation steps to profile, comma-separated")
    parser.add_argument("--batch", type=int, help="micro-batch size (default: the shape's)")
    parser.add_argument("--seq-len", type=int, help="sequence length (default: the shape's)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before the profiled one")
    parser.add_argument("--top", type=int, default=0, help="list the N cast / copy sites that write the most bytes")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-cpu-time", action="store_true", help="skip the extra step that measures CPU time by op")
    args = parser.parse_args()
    try:
        args.accum = [int(value) for value in args.accum.split(",")]
    except ValueError:
        parser.error(f"--accum takes comma-separated whole numbers such as 1,4, got {args.accum!r}")
    if min(args.accum) < 1:
        parser.error(f"--accum values must be at least 1, got {args.accum}")
    for option in ("batch", "seq_len"):
        value = getattr(args, option)
        if value is not None and value < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1, got {value}")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("gpt2").setLevel(logging.WARNING)
    print(describe_machine("cpu", args.threads))
    model_shape, batch, seq_len, vocab = BENCH_SHAPES[args.shape]
    batch, seq_len = args.batch or batch, args.seq_len or seq_len
    dims = SHAPES[model_shape]
    print(
        f"shape {args.shape}: {dims['n_layer']} layers x {dims['n_embd']} wide, vocabulary {vocab}, B={batch}, "
        f"T={seq_len}; precision bf16 (autocast, fp32 master weights), Trainer.train_step"
    )
    for accum in args.accum:
        run = Run(model_shape, batch, seq_len, vocab, accum)
        report(profile_step(run, args.warmup, not args.no_cpu_time), accum, args.top)


if __name__ == "__main__":
    main()
