"""One GPT-2 124M training step: gpt2's Trainer against transformers and litgpt, and against the matmul peak.

The goals it checks (one thread, CPU time, GPT-2 124M, B=4, T=256, forward + backward + clip + AdamW step, random
init): fp32 step <= 0.85x transformers' and >= 80% MFU of the fp32 2048^2 ``torch.mm`` rate measured in the same
process; bf16 step <= 0.6x transformers' and >= 40% MFU of the bf16 rate. Everything below runs in one process on
one thread, timed by ``time.process_time`` (CPU time: other jobs' time on a shared machine is not counted, though
they still slow ours through the caches and cores they share), in interleaved rounds (mm, ours, mm, bare, mm,
transformers, mm, litgpt; the next round), after one untimed warm-up step each:

- ``ours``: ``gpt2.train.trainer.Trainer.train_step()`` itself (the step of ``gpt2 train``: read the batch, count
  the scored targets, forward with ``reduction="sum"`` scaled by 1 / count, backward, clipping at 1.0 (gradients
  within the limit are not multiplied), AdamW from ``build_optimizer`` (fused where torch has the kernel),
  bookkeeping) on ``gpt2.GPT``.
- ``bare``: the same model and optimizer stepped without the Trainer (zero_grad, forward, backward, clip, step);
  ``ours - bare`` per round is the Trainer's own overhead.
- ``transformers``: ``GPT2LMHeadModel`` (its default attention, dropout 0), its own loss (``labels=input_ids``,
  shifted inside), ``clip_grad_norm_(1.0)``, ``torch.optim.AdamW(fused=True)`` with weight decay 0.1 on every
  parameter (no decay grouping: it does not change the step's cost).
- ``litgpt``: ``litgpt.model.GPT`` at the GPT-2 124M shape (litgpt ships no GPT-2 config: pythia-160m's layout with
  GPT-2's sequential residual, tanh GELU, vocabulary 50257 and the LM head tied to the embedding; litgpt has no
  learned positions, so RoPE on a quarter of each head as in pythia), loss by ``litgpt.utils.chunked_cross_entropy``
  as litgpt's pretrain script computes it, the same clipping and fused AdamW as transformers.
- ``mm``: ``torch.mm`` of two 2048 x 2048 matrices (2 * 2048^3 FLOP each) in the step's precision, ``--mm-reps``
  products before each step, so that a round's rate spans the round (a busy neighbour moves it by tens of percent).

Each runs in the allocator state it has in a process of its own: on a CPU the Trainer keeps freed memory in the
process (``gpt2.train.host_memory``: glibc neither unmaps nor trims it), and ``bare``, stepped beside it, shares
that; the peers run under glibc's own thresholds, which map and unmap their large blocks at every step. Where the
state changes (before ``ours`` and before the first peer), one more step runs untimed first, and the table ends with
the page faults per step of each (``ru_minflt``).

MFU = ``GPT.flops_per_token(T)`` x B x T (6 N per token plus attention, from our model, used for all three) / step
CPU time / the mm rate of the same round ("MFU from the medians": the median step against the median rate).
``--profile N`` times one more fp32 ``ours`` step op by op (CPU time of every aten op, by input shapes, with each
matrix product's rate against the mm rate) and prints the top N. bf16 (autocast, fp32 master weights) runs only on
CPUs that multiply bf16 natively (AMX, AVX512-BF16) unless ``--force-bf16``: elsewhere it is emulated and says
nothing about the goals.
"The optimizer step alone" times ``build_optimizer``'s fused AdamW against its foreach AdamW over the 124M model,
then clipping gradients within the limit: ``clip_grad_norm_`` (a multiply by 1.0) against their norm alone.

    PYTHONPATH=. python benchmarks/step_vs_peers.py [--rounds 5] [--small] [--precisions fp32,bf16] [--profile 25]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import resource
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

# the documented way to see every aten op as it runs (torch.profiler's clock is the wall clock); a benchmark, not
# the library, so the private module path is acceptable here
from torch.utils._python_dispatch import TorchDispatchMode

from gpt2.model.config import SHAPES, GPTConfig
from gpt2.model.gpt import GPT
from gpt2.torch_compat import cpu_native_bf16
from gpt2.train import host_memory
from gpt2.train.config import RecoveryConfig, TrainConfig
from gpt2.train.optim import build_optimizer, fused_adamw_supported
from gpt2.train.precision import auto_precision, describe_machine
from gpt2.train.trainer import Trainer

LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 6e-4, (0.9, 0.95), 1e-8, 0.1, 1.0
GOALS = {"fp32": (0.85, 0.80), "bf16": (0.60, 0.40)}  # (step / transformers at most, MFU at least)
PEERS = ("transformers", "litgpt")
# Whether each runs with freed memory kept in the process (the module docstring)
KEPT_MEMORY = {"ours": True, "bare": True, "transformers": False, "litgpt": False}

Step = Callable[[], float]


@dataclass(frozen=True)
class Shape:
    model: str
    batch: int
    seq_len: int
    vocab: int

    @property
    def dims(self) -> dict[str, int]:
        return SHAPES[self.model]

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(**self.dims, vocab_size=self.vocab)

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """``--model``, ``--batch``, ``--seq-len`` and ``--vocab``: GPT-2 124M, B=4, T=256 unless told."""
        parser.add_argument("--model", default="gpt2", choices=sorted(SHAPES), help="the shape (gpt2 = 124M)")
        parser.add_argument("--batch", type=int, default=4)
        parser.add_argument("--seq-len", type=int, default=256)
        parser.add_argument("--vocab", type=int, default=50257)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Shape:
        return cls(args.model, args.batch, args.seq_len, args.vocab)


def autocast(precision: str) -> contextlib.AbstractContextManager:
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def fixed_batch(shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """One (x, y) batch of random ids, y the next token of x, for the steps that do not read a Trainer's loader."""
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq_len + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def peer_adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """The peers' optimizer: AdamW over every parameter, fused where this torch has the kernel."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = fused_adamw_supported(params[0].device, params[0].dtype)
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=fused)


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    defaults = optimizer.defaults
    if defaults.get("fused"):
        return "fused"
    if defaults.get("foreach"):
        return "foreach"
    return "for-loop"


# ------------------------------------------------------------------ the contenders
def build_ours(shape: Shape, precision: str) -> tuple[Trainer, Step, Step]:
    """A Trainer over a stream of random ids, and two steps on its model and optimizer: ``train_step`` and bare."""
    torch.manual_seed(0)
    steps = 8
    tokens = torch.randint(
        0, shape.vocab, (steps * shape.batch * shape.seq_len + 1,), generator=torch.Generator().manual_seed(0)
    )
    config = TrainConfig(
        micro_batch_size=shape.batch,
        seq_len=shape.seq_len,
        max_steps=10**6,
        max_lr=LR,
        weight_decay=WEIGHT_DECAY,
        grad_clip=CLIP,
        precision=precision,
        device="cpu",
        out_dir=None,
        progress=False,
        eval_interval=0,
        plot=False,
        seed=0,
        recovery=RecoveryConfig(max_bad_steps=10**6),
    )
    trainer = Trainer(GPT(shape.gpt_config()), config, tokens, sinks=[])

    def train_step() -> float:
        return trainer.train_step()["loss"]

    model, optimizer = trainer.model, trainer.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    x, y = fixed_batch(shape)
    scale = 1.0 / y.numel()

    def bare_step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with autocast(precision):
            _, loss = model(x, y, reduction="sum")
        loss = loss * scale
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
        return loss.item()

    return trainer, train_step, bare_step


def build_transformers(shape: Shape, precision: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, Step]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as transformers_logging

    # its note on the config's unset loss_type would cut into the table
    transformers_logging.set_verbosity_error()
    dims = shape.dims
    config = GPT2Config(
        vocab_size=shape.vocab,
        n_positions=1024,
        n_embd=dims["n_embd"],
        n_layer=dims["n_layer"],
        n_head=dims["n_head"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).train()
    optimizer = peer_adamw(model)
    x, _ = fixed_batch(shape)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with autocast(precision):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        return loss.item()

    return model, optimizer, step


def build_litgpt(shape: Shape, precision: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, Step]:
    from litgpt.config import Config
    from litgpt.model import GPT as LitGPT
    from litgpt.utils import chunked_cross_entropy

    dims = shape.dims
    config = Config(
        name="gpt2-124m-shape",
        block_size=1024,
        vocab_size=shape.vocab,
        padded_vocab_size=shape.vocab,
        n_layer=dims["n_layer"],
        n_head=dims["n_head"],
        n_embd=dims["n_embd"],
        bias=True,
        parallel_residual=False,
        gelu_approximate="tanh",
        rotary_percentage=0.25,
    )
    torch.manual_seed(0)
    model = LitGPT(config).train()
    # GPT-2 ties the head to the embedding: the same parameter count and optimizer work as ours
    model.lm_head.weight = model.transformer.wte.weight
    # GPT-2's N(0, 0.02) (litgpt's pretrain script initialises its own way; nn.Embedding's N(0, 1) in a tied
    # head would start the loss near 30)
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)
    optimizer = peer_adamw(model)
    x, y = fixed_batch(shape)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with autocast(precision):
            logits = model(x)
        loss = chunked_cross_entropy(logits, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        return loss.item()

    return model, optimizer, step


def mm_step(precision: str, size: int, reps: int) -> tuple[Step, float]:
    """``reps`` products of two ``size`` x ``size`` matrices, and their FLOPs."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    out = torch.empty(size, size, dtype=dtype)

    def step() -> float:
        for _ in range(reps):
            torch.mm(a, b, out=out)
        return 0.0

    return step, 2.0 * size**3 * reps


# ------------------------------------------------------------------ timing and printing
def cpu_seconds(step: Step) -> tuple[float, float]:
    start = time.process_time()
    loss = step()
    return time.process_time() - start, loss


def spread(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def percent(value: float) -> str:
    return f"{100 * value:.1f}%"


def peer_versions(peers: list[str]) -> list[str]:
    from importlib.metadata import version

    return [f"{peer} {version(peer)}" for peer in peers]


def available_peers(wanted: list[str]) -> list[str]:
    """The peers that import here; a one-line note for each that does not."""
    found = []
    for peer in wanted:
        try:
            if peer == "litgpt":
                import litgpt.model  # noqa: F401
            else:
                import transformers  # noqa: F401
        except ImportError as error:
            print(f"note: {peer} skipped: it does not import here ({error})")
            continue
        found.append(peer)
    return found


def run_precision(precision: str, shape: Shape, peers: list[str], args: argparse.Namespace) -> None:
    """The interleaved rounds of one precision: a line per round, then the medians and spreads."""
    trainer, ours, bare = build_ours(shape, precision)
    flops_per_step = trainer.model.flops_per_token(shape.seq_len) * shape.batch * shape.seq_len
    steps: dict[str, Step] = {"ours": ours, "bare": bare}
    kinds = {"ours": optimizer_kind(trainer.optimizer)}
    builders = {"transformers": build_transformers, "litgpt": build_litgpt}
    for peer in peers:
        _, optimizer, steps[peer] = builders[peer](shape, precision)
        kinds[peer] = optimizer_kind(optimizer)
    mm, mm_flops = mm_step(precision, args.mm_size, args.mm_reps)
    print(
        f"\n{precision}: {flops_per_step / 1e9:.1f} GFLOP per step (GPT.flops_per_token({shape.seq_len}) = "
        f"{flops_per_step / shape.batch / shape.seq_len / 1e6:.1f} MFLOP x {shape.batch * shape.seq_len} tokens); "
        f"AdamW: {', '.join(f'{name} {kind}' for name, kind in kinds.items())}"
    )
    warm = {name: cpu_seconds(step)[1] for name, step in steps.items()}
    mm()
    print("warm-up losses: " + ", ".join(f"{name} {loss:.4f}" for name, loss in warm.items()))
    columns = ["mm GFLOP/s", *(f"{name} s" for name in steps)]
    columns += [f"ours/{peer}" for peer in peers] + ["overhead s"] + [f"MFU {name}" for name in ("ours", *peers)]
    print(" | ".join(["round", *columns]))
    table: dict[str, list[float]] = {column: [] for column in columns}
    faults: dict[str, list[int]] = {name: [] for name in steps}
    kept = None
    for round_index in range(args.rounds):
        seconds = {"mm": 0.0}
        for name, step in steps.items():
            # products before every step: the round's rate is measured across the round, not in one burst
            seconds["mm"] += cpu_seconds(mm)[0]
            if KEPT_MEMORY[name] != kept:
                # the first step in the other allocator state fills the heap, or maps and trims it: untimed
                kept = KEPT_MEMORY[name]
                host_memory.set_kept(kept)
                step()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            seconds[name] = cpu_seconds(step)[0]
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        rate = mm_flops * len(steps) / seconds["mm"]
        row = {"mm GFLOP/s": rate / 1e9, **{f"{name} s": seconds[name] for name in steps}}
        row |= {f"ours/{peer}": seconds["ours"] / seconds[peer] for peer in peers}
        row["overhead s"] = seconds["ours"] - seconds["bare"]
        row |= {f"MFU {name}": flops_per_step / seconds[name] / rate for name in ("ours", *peers)}
        for column, value in row.items():
            table[column].append(value)
        print(" | ".join([str(round_index + 1), *(format_cell(column, row[column]) for column in columns)]))
    medians = {column: statistics.median(values) for column, values in table.items()}
    print(" | ".join(["median", *(format_cell(column, medians[column]) for column in columns)]))
    ranges = (f"{format_cell(name, min(values))}-{format_cell(name, max(values))}" for name, values in table.items())
    print(" | ".join(["min-max", *ranges]))
    # MFU of the medians: the median step against the median rate (the per-round values pair each step with its
    # round's rate)
    mfus = {name: flops_per_step / medians[f"{name} s"] / (medians["mm GFLOP/s"] * 1e9) for name in ("ours", *peers)}
    print("MFU from the medians: " + ", ".join(f"{name} {percent(mfu)}" for name, mfu in mfus.items()))
    print("page faults per step (medians): " + ", ".join(f"{n} {statistics.median(f):,.0f}" for n, f in faults.items()))
    report_goals(precision, medians, peers)
    if args.profile and precision == "fp32":
        profile_step(ours, args.profile, medians["mm GFLOP/s"] * 1e9)
    del trainer, steps
    gc.collect()


def format_cell(column: str, value: float) -> str:
    if column.startswith("MFU"):
        return percent(value)
    if column.startswith("ours/"):
        return f"{value:.3f}x"
    return f"{value:.3f}"


def report_goals(precision: str, medians: dict[str, float], peers: list[str]) -> None:
    ratio_goal, mfu_goal = GOALS[precision]
    mfu = medians["MFU ours"]
    lines = [f"goal {precision}: MFU >= {percent(mfu_goal)}: {percent(mfu)} ({verdict(mfu >= mfu_goal)})"]
    if "transformers" in peers:
        ratio = medians["ours/transformers"]
        lines.append(f"step <= {ratio_goal}x transformers: {ratio:.3f}x ({verdict(ratio <= ratio_goal)})")
    print("; ".join(lines))


def verdict(met: bool) -> str:
    if met:
        return "met"
    return "MISSED"


# aten's matrix products and where their operands sit: (m, k) @ (k, n) is 2 m k n FLOP
GEMMS = {"mm": (0, 1), "addmm": (1, 2), "addmm_": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2)}


class CpuTimeByOp(TorchDispatchMode):
    """CPU time (``time.process_time``) of every aten op run under it, by op and input shapes: unlike
    torch.profiler's wall clock, it does not count the time other jobs on a shared machine take the core.
    """

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: Counter[tuple[str, str]] = Counter()
        self.flops: dict[tuple[str, str], float] = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.process_time()
        out = func(*args, **(kwargs or {}))
        seconds = time.process_time() - start
        name = func.overloadpacket.__name__
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
        key = (name, " ".join(str(list(shape)) for shape in shapes))
        self.seconds[key] += seconds
        self.calls[key] += 1
        if name in GEMMS:
            self.flops[key] += gemm_flops(args, GEMMS[name])
        return out


def gemm_flops(args: tuple, operands: tuple[int, int]) -> float:
    a, b = (args[i] for i in operands)
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


def profile_step(step: Step, rows: int, mm_rate: float) -> None:
    """One more step under :class:`CpuTimeByOp`: the top ``rows`` (op, input shapes) by CPU time, each matrix
    product's rate against the 2048^2 ``mm_rate``, and the totals: products, other ops, and the rest (Python,
    autograd, the profiling itself).
    """
    profiler = CpuTimeByOp()
    start = time.process_time()
    with profiler:
        step()
    total = time.process_time() - start
    print(f"\nCPU time of one more ours step (fp32) by aten op and input shapes: {total:.3f} s in all")
    # Seen from Python, every tensor has a Python object that holds a reference: autograd then sums the tied
    # embedding's and head's gradients into a fresh block (an ``add`` of two (vocab, n_embd) tensors) where a
    # plain step adds them in place.
    print("(under this profiler the tied weight's two gradients are summed out of place; a plain step sums in place)")
    print("op | input shapes | calls | CPU s | share | GFLOP/s (vs mm 2048^2)")
    ranked = sorted(profiler.seconds.items(), key=lambda item: -item[1])
    for key, seconds in ranked[:rows]:
        rate = ""
        if key in profiler.flops:
            gflops = profiler.flops[key] / seconds / 1e9
            rate = f"{gflops:.1f} ({gflops * 1e9 / mm_rate:.0%})"
        cells = [*key, str(profiler.calls[key]), f"{seconds:.3f}", percent(seconds / total), rate]
        print(" | ".join(cells))
    by_op: dict[str, float] = defaultdict(float)
    for (name, _), seconds in profiler.seconds.items():
        by_op[name] += seconds
    top = sorted(by_op.items(), key=lambda item: -item[1])[:rows]
    print("by op: " + ", ".join(f"{name} {seconds:.3f} s ({percent(seconds / total)})" for name, seconds in top))
    gemm_seconds = sum(profiler.seconds[key] for key in profiler.flops)
    other = sum(profiler.seconds.values()) - gemm_seconds
    ideal = sum(profiler.flops.values()) / mm_rate
    print(
        f"matrix products {gemm_seconds:.3f} s ({percent(gemm_seconds / total)}; {ideal:.3f} s at the mm 2048^2 "
        f"rate), other ops {other:.3f} s ({percent(other / total)}), outside ops "
        f"{total - gemm_seconds - other:.3f} s ({percent((total - gemm_seconds - other) / total)})"
    )


def optimizer_alone(shape: Shape, rounds: int) -> None:
    """build_optimizer's AdamW step alone over the model's parameters (random gradients): fused vs foreach."""
    torch.manual_seed(0)
    model = GPT(shape.gpt_config())
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizers = {
        kind: build_optimizer(model, TrainConfig(max_lr=LR, weight_decay=WEIGHT_DECAY, fused_adamw=fused))
        for kind, fused in (("fused", True), ("foreach", False))
    }
    for optimizer in optimizers.values():
        # the state's first allocation is not the step's cost
        optimizer.step()
    n = model.num_params()
    print(f"\nthe optimizer step alone: AdamW over {n / 1e6:.1f}M parameters (build_optimizer), CPU s per step")
    print("round | fused s | foreach s | fused/foreach")
    times: dict[str, list[float]] = {kind: [] for kind in optimizers}
    for round_index in range(rounds):
        for kind, optimizer in optimizers.items():
            start = time.process_time()
            optimizer.step()
            times[kind].append(time.process_time() - start)
        fused, foreach = times["fused"][-1], times["foreach"][-1]
        print(f"{round_index + 1} | {fused:.3f} | {foreach:.3f} | {fused / foreach:.3f}x")
    ratios = [f / g for f, g in zip(times["fused"], times["foreach"])]
    fused, foreach = statistics.median(times["fused"]), statistics.median(times["foreach"])
    print(f"median | {fused:.3f} | {foreach:.3f} | {statistics.median(ratios):.3f}x")
    print(f"min-max | {spread(times['fused'])} | {spread(times['foreach'])} | {spread(ratios)}")
    # Gradients within the limit: clip_grad_norm_ multiplies each by 1.0, the Trainer only measures their norm.
    grads = [p.grad for p in model.parameters()]
    clips = {
        "clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf),
        "norm alone": lambda: torch.nn.utils.get_total_norm(grads),
    }
    clip_times: dict[str, list[float]] = {name: [] for name in clips}
    for _ in range(rounds):
        for name, clip in clips.items():
            clip_times[name].append(cpu_seconds(clip)[0])
    ratios = [f / g for f, g in zip(clip_times["norm alone"], clip_times["clip_grad_norm_"])]
    medians = {name: statistics.median(values) for name, values in clip_times.items()}
    print(
        f"gradients within the clipping limit, CPU s (medians): clip_grad_norm_ {medians['clip_grad_norm_']:.3f}, "
        f"the norm alone (the Trainer) {medians['norm alone']:.3f}: {statistics.median(ratios):.3f}x ({spread(ratios)})"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated, of fp32 and bf16")
    parser.add_argument("--force-bf16", action="store_true", help="time bf16 even where the CPU emulates it")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (one step of each per round)")
    Shape.add_arguments(parser)
    parser.add_argument("--small", action="store_true", help="the 4 x 128 shape (B=4, T=128)")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated, of transformers and litgpt")
    parser.add_argument("--mm-size", type=int, default=2048)
    parser.add_argument("--mm-reps", type=int, default=1, help="matrix products before each step of a round")
    parser.add_argument("--optimizer-rounds", type=int, default=5, help="0 skips the optimizer-alone rounds")
    parser.add_argument("--profile", type=int, default=0, help="top N ops of one more fp32 ours step")
    args = parser.parse_args()
    if args.small:
        args.batch, args.seq_len = 4, 128
    unknown = set(args.precisions.split(",")) - set(GOALS) | set(args.peers.split(",")) - set(PEERS) - {""}
    if unknown or args.rounds < 1:
        parser.error(f"--precisions takes fp32,bf16, --peers {','.join(PEERS)}, --rounds >= 1 (got {unknown or ''})")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    # The Trainer's set-up lines would bury the table; warnings still show.
    logging.getLogger("gpt2").setLevel(logging.WARNING)
    shape = Shape.from_args(args)
    peers = available_peers([peer for peer in args.peers.split(",") if peer])
    print(describe_machine())
    auto, why = auto_precision("cpu")
    print(f"precision auto -> {auto}: {why}")
    print(
        f"{args.model} shape ({shape.dims['n_layer']} layers x {shape.dims['n_embd']}, {shape.dims['n_head']} heads, "
        f"vocab {shape.vocab}), B={shape.batch} T={shape.seq_len}, CPU seconds per step, {args.rounds} rounds; "
        f"torch {torch.__version__}; {', '.join(peer_versions(peers)) or 'no peers'}"
    )
    for precision in args.precisions.split(","):
        if precision == "bf16" and cpu_native_bf16() is None and not args.force_bf16:
            print("\nbf16 skipped: this CPU has no native bf16 matmul (AMX or AVX512-BF16); --force-bf16 times it")
            continue
        run_precision(precision, shape, peers, args)
    if args.optimizer_rounds:
        optimizer_alone(shape, args.optimizer_rounds)


if __name__ == "__main__":
    main()
